"""How far float32's arithmetic moves a training step's gradients from the exact ones
(``gradient_bound``): the forward's roundings (tests/rounding.py's float analysis, carried to the
gradients by differentiating twice) and the backward's own, each operation's, whatever the order of
its sums. Two float32 paths of a step (the fused loss or the plain one, the C loss or PyTorch's, the
CPU or CUDA) give gradients within the sum of their bounds (``same_gradients``). Derived from the
format's arithmetic, never measured: tests/test_rounding.py holds float32 to it against float64."""
from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from aiayn.model.layers import FeedForward
from aiayn.model.positional import SinusoidalPositions
from tests.arith import LAMBDA, U32, smoothed_loss_gradients
from aiayn.train.objective import label_smoothed_loss_reference
from tests.rounding import FORMATS, Marks, _float_log_probs, _hoeffding, _roundings, loss_errors

PICKS = 8  # entries of each parameter's gradient held to their bound, beside its largest and one projection
FLIP_SCAN, FLIP_SAMPLE = 4096, 256  # ``_relu_flips``


@dataclass(frozen=True)
class GradientBound:
    """For each parameter (by name): the entries ``index`` of its flattened gradient (its largest and
    ``PICKS`` drawn), a sign vector ``signs`` over all its entries, and bounds on how far the arithmetic
    moves each picked entry (``entries``), the projection Σ signs g (``projection``) and the norm of
    the whole gradient, computed in float32 in any order (``norm``)."""
    index: dict[str, Tensor]
    signs: dict[str, Tensor]
    entries: dict[str, Tensor]
    projection: dict[str, float]
    norm: float


def same_gradients(got: dict[str, Tensor], want: dict[str, Tensor], bound: GradientBound,
                   other: GradientBound | None = None) -> None:
    """Two paths' gradients (by parameter name) within the sum of their bounds (``other``: the second
    path's, if its arithmetic differs) at every picked entry and in every projection; the projections
    are summed in float64 (1.01: their own rounding, and float64's in the bounds)."""
    other = other or bound
    for name, g in want.items():
        a, b = got[name].detach().double().flatten(), g.detach().double().flatten()
        idx = bound.index[name]
        limit = 1.01 * (bound.entries[name] + other.entries[name])
        err = (a[idx] - b[idx]).abs()
        assert bool((err <= limit).all()), (name, idx[err > limit].tolist(), err.max().item(), limit.min().item())
        s = bound.signs[name]
        proj = abs(float((a * s).sum() - (b * s).sum()))
        assert proj <= 1.01 * (bound.projection[name] + other.projection[name]), (name, proj, bound.projection[name])


def zero_bound(bound: GradientBound) -> GradientBound:
    """No error at all: the exact path's, against which a float32 one is held to its bound alone."""
    return GradientBound(bound.index, bound.signs, {n: torch.zeros_like(e) for n, e in bound.entries.items()},
                         {n: 0.0 for n in bound.projection}, 0.0)


def gradient_bound(model: nn.Module, fmt: str, batch, eps_ls: float, scale: float, pad: int = 0,
                   seed: int = 0) -> GradientBound:
    """A bound on how far ``fmt``'s arithmetic ("fp32", "fp32-cuda") moves the gradients of
    ``scale`` times the summed label-smoothed loss (§5.4; eps_ls 0: the NLL) of ``batch`` (a
    ``Batch``'s src, tgt_in, tgt_out, padded with ``pad``), the model without dropout, from the exact
    ones: at each parameter's largest entry, ``PICKS`` entries drawn (``seed``) and one projection on
    random signs; and the gradient's norm, with its own float32 sum of P squares (2P roundings below
    its square, by Hoeffding: LAMBDA sqrt(2P) u / 2 of the norm, and the root's u).

    The forward is tests/rounding.py's float64 copy with each rounding marked (``_float_log_probs``);
    the loss is exact, its gradient in the logits moved as far as ``smoothed_loss_gradients`` says
    (the fused path's and the plain one's, the larger; worst case, no cancellation assumed). The
    backward's roundings, each an error δ in a computed gradient dL/dx, reach the parameters through
    x's own backward: as the gradient of Σ δ x, a term added to the loss. Where the float32 backward
    rounds (any order of its sums):
    - a linear map y = x Wᵀ + b: dx = dy W, 2 d_out roundings below |dy| |W|; dW = dyᵀ x, 2 N below
      |dy|ᵀ |x| (N rows); db, N below Σ |dy|;
    - Eq. 1 (explicit, or flash attention's recomputing the weights from the saved logsumexp): dP = dO
      Vᵀ, dV = Pᵀ dO, D = Σ_s P dP (= dO · O), dS = P (dP - D) (D shared by a row), dQ = dS K and
      dK = dSᵀ Q, the scale; the recomputed weights' own error (the exponential's, the recomputed
      scores') where they are used;
    - LayerNorm: dx = r (dx̂ - mean dx̂ - x̂ mean(dx̂ x̂)), dx̂ = dy w, the two means shared by a row,
      x̂ recomputed; dw = Σ dy x̂, db = Σ dy;
    - the embedding's lookup times sqrt(d_model): each row of dE a sum over its occurrences;
    - a value used twice or more (the residual stream, the encoder output, a tied matrix): the
      sum of its gradients, m - 1 roundings below their magnitudes' sum;
    - ReLU: exact, but where the forward's roundings may carry its input across 0 (|h| within
      ``rounding_bound``'s bound of h): there the gradient may pass or not, |dy| either way (worst
      case).
    The marks are summed by Hoeffding (tests/rounding.py, ``_hoeffding``), first order, with the
    gradients of the gradients from autograd in float64. Followed: ReLU models with sinusoidal
    positions (the paper's), without dropout; bf16 autocast is not (its two paths share most of their
    roundings, which a bound of each path alone cannot use: it comes out above the gradients)."""
    a = FORMATS[fmt]
    u = a.u
    m = copy.deepcopy(model).double().train()
    assert all(mod.p == 0 for mod in m.modules() if isinstance(mod, nn.Dropout)), "a model without dropout"
    assert isinstance(m.src_pos, SinusoidalPositions), "sinusoidal positions (learned ones are not followed)"
    assert all(mod.activation == "relu" for mod in m.modules() if isinstance(mod, FeedForward)), \
        "ReLU (Eq. 2): swish's and GELU's backward are not followed"
    params = dict(m.named_parameters())
    places = Marks()

    ops: list[tuple[str, dict]] = []

    def record(kind: str, **t) -> None:
        ops.append((kind, t))

    for mod in m.modules():
        if isinstance(mod, FeedForward) and mod.activation == "relu":
            mod.act = lambda h: _relu(h, record)
    z = _float_log_probs(m, batch.src, batch.tgt_in, places.moved, a, logits=True, record=record)  # (B,T,V)
    V = z.size(-1)
    target = batch.tgt_out.reshape(-1)
    keep = target != pad
    loss = scale * label_smoothed_loss_reference(z, batch.tgt_out, eps_ls, pad).loss

    flips = _relu_flips(ops, places)  # before the backward's marks: the forward's alone move h
    live = {id(t): t for _, ts in ops for t in ts.values() if isinstance(t, Tensor) and t.requires_grad}
    live[id(z)] = z
    grads = dict(zip(live, torch.autograd.grad(loss, list(live.values()), retain_graph=True, allow_unused=True)))
    g = lambda t: grads[id(t)].detach() if grads.get(id(t)) is not None else torch.zeros_like(t)  # noqa: E731
    terms: list[Tensor] = []
    uses: dict[int, list] = defaultdict(list)  # a value's id -> (the value, each use's gradient magnitude)

    def wrong(x: Tensor | None, c: Tensor, coef: Tensor | None = None, systematic: bool = False,
              term=None) -> None:
        """dL/dx computed off by at most c: entrywise (coef None), or one error per row of the last
        dimension, times coef, for every entry of the row (c (..., 1)); ``term(δ)``: the loss's
        added term for an error δ that reaches several gradients at once."""
        zb = places.mark(c, systematic)
        if term is not None:
            terms.append(term(zb))
        else:
            terms.append((zb * x).sum() if coef is None else (zb * (coef * x).sum(-1, keepdim=True)).sum())

    def used(x: Tensor, magnitude: Tensor) -> None:
        uses[id(x)].append((x, magnitude))

    for kind, t in ops:
        if kind == "linear":
            x, W, b, dy = t["x"], t["W"], t["b"], g(t["y"])
            d_out, rows = dy.size(-1), dy.reshape(-1, dy.size(-1)).abs()
            used(x, dy.abs() @ W.detach().abs())
            wrong(x, _roundings(2 * d_out, u) * (dy.abs() @ W.detach().abs()) + 2 * d_out * a.eta)
            dW = rows.T @ x.detach().reshape(-1, x.size(-1)).abs()
            used(W, dW)
            wrong(W, _roundings(2 * rows.size(0), u) * dW + 2 * rows.size(0) * a.eta)
            if b is not None:
                used(b, rows.sum(0))
                wrong(b, _roundings(rows.size(0), u) * rows.sum(0))
        elif kind == "add":
            used(t["x"], g(t["y"]).abs())  # dL/dx += dL/dy: its sum with x's other uses' below
        elif kind == "layer_norm":
            _layer_norm_backward(t, g, wrong, used, u)
        elif kind == "attention":
            _attention_backward(t, g, wrong, a)
        elif kind == "embed":
            E, tokens = t["E"], t["tokens"].reshape(-1)
            e = g(t["e"]).reshape(-1, E.size(1)).abs() * t["scale"]
            dE = torch.zeros_like(E).index_add_(0, tokens, e)
            count = torch.zeros(E.size(0), 1, dtype=E.dtype).index_add_(0, tokens, torch.ones(tokens.numel(), 1,
                                                                                               dtype=E.dtype))
            dE[t["pad"]] = 0  # padding_idx: no gradient
            used(E, dE)
            wrong(E, _roundings(2 * count + 1, u) * dE)
        elif kind == "relu":
            flip = flips[id(t["h"])]
            if bool(flip.any()):
                wrong(t["h"], torch.where(flip, g(t["y"]).abs(), 0.0), systematic=True)
    for entries in uses.values():
        if len(entries) > 1:
            x = entries[0][0]
            wrong(x, _roundings(len(entries) - 1, u) * sum(mag for _, mag in entries))
    zd = z.detach().reshape(-1, V)
    g_fused, g_plain = smoothed_loss_gradients(zd.float(), target, eps_ls, pad, g_loss=scale, **loss_errors(a, zd))
    log_abs = a.log_abs * abs(scale) * torch.softmax(zd, -1) * keep[:, None]  # log Z's absolute error, in every p
    wrong(z, (torch.maximum(g_fused.e, g_plain.e) + log_abs).view_as(z), systematic=True)

    G = torch.autograd.grad(loss + sum(terms), list(params.values()), create_graph=True)
    gen = torch.Generator().manual_seed(seed)
    index, signs, qs = {}, {}, []
    for (name, p), gp in zip(params.items(), G):
        flat = gp.flatten()
        index[name] = torch.cat([flat.detach().abs().argmax()[None], torch.randint(flat.numel(), (PICKS,),
                                                                                    generator=gen)])
        signs[name] = torch.randint(2, (flat.numel(),), generator=gen).double() * 2 - 1
        qs += [flat[index[name]], (flat * signs[name]).sum()[None]]
    norm = torch.sqrt(sum((gp ** 2).sum() for gp in G))
    qs.append(norm[None])
    bounds = _hoeffding(torch.cat(qs), places)
    P = sum(p.numel() for p in params.values())
    norm_bound = float(bounds[-1]) + (LAMBDA * float(_roundings(2 * P, u)) / 2 + u) * float(norm.detach())
    entries, projection, i = {}, {}, 0
    for name in params:
        entries[name] = bounds[i:i + PICKS + 1]
        projection[name] = float(bounds[i + PICKS + 1])
        i += PICKS + 2
    return GradientBound(index, signs, entries, projection, norm_bound)


def _relu(h: Tensor, record) -> Tensor:
    y = torch.relu(h)
    record("relu", h=h, y=y)
    return y


def _relu_flips(ops: list, places: list, seed: int = 0) -> dict[int, Tensor]:
    """Where each ReLU's input h = x W1ᵀ + b1 may lie on either side of 0 in float32: |h| within its
    forward bound (``_hoeffding`` of the forward's marks). The bound is taken entry by entry only
    where |h| <= FLIP_SCAN u M (M = |x| |W1|ᵀ + |b1|, the linear map's terms); elsewhere it is
    below FLIP_SCAN u M / 4, as checked on ``FLIP_SAMPLE`` entries drawn there (the bound runs at
    50-250 u M on the models of the tests)."""
    out, linear, gen = {}, None, torch.Generator().manual_seed(seed)
    for kind, t in ops:
        if kind == "linear":
            linear = t
        elif kind == "relu":
            h = t["h"].reshape(-1)
            M = linear["x"].detach().abs() @ linear["W"].detach().abs().T
            M = (M + linear["b"].detach().abs() if linear["b"] is not None else M).reshape(-1)
            assert M.numel() == h.numel(), "a ReLU right after its linear map (Eq. 2)"
            near = (h.detach().abs() <= FLIP_SCAN * U32 * M).nonzero()[:, 0]
            far = (h.detach().abs() > FLIP_SCAN * U32 * M).nonzero()[:, 0]
            far = far[torch.randperm(far.numel(), generator=gen)[:FLIP_SAMPLE]]
            bound = _hoeffding(h[torch.cat([near, far])], places, retain_graph=True)
            assert bool((bound[near.numel():] <= FLIP_SCAN * U32 * M[far] / 4).all()), \
                "a ReLU input's bound past FLIP_SCAN / 4 u M: raise FLIP_SCAN"
            flip = torch.zeros_like(h, dtype=torch.bool)
            flip[near] = h.detach()[near].abs() <= bound[:near.numel()]
            out[id(t["h"])] = flip.view_as(t["h"])
    return out


def _layer_norm_backward(t: dict, g, wrong, used, u: float) -> None:
    """LayerNorm's backward roundings (``gradient_bound``), x (..., D)."""
    x, r, xhat, w, dy = t["x"], t["r"].detach(), t["xhat"], t["w"], g(t["y"])
    D = x.size(-1)
    dxh = dy * w.detach()
    m1, m2 = dxh.mean(-1, keepdim=True), (dxh * xhat).mean(-1, keepdim=True)
    dx = r * (dxh - m1 - xhat * m2)
    used(x, dx.abs())
    wrong(x, u * r * (3 * dxh.abs() + 2 * m1.abs() + 5 * xhat.abs() * m2.abs()) + u * dx.abs())
    wrong(x, _roundings(D + 1, u) * dxh.abs().mean(-1, keepdim=True), coef=-r.expand_as(x))
    wrong(x, _roundings(2 * D + 1, u) * (dxh * xhat).abs().mean(-1, keepdim=True), coef=-r * xhat)
    rows = dy.reshape(-1, D).abs()
    dw = (rows * xhat.reshape(-1, D).abs()).sum(0)
    used(w, dw)
    wrong(w, _roundings(2 * rows.size(0) + 1, u) * dw + 2 * u * dw)
    used(t["b"], rows.sum(0))
    wrong(t["b"], _roundings(rows.size(0), u) * rows.sum(0))


def _attention_backward(t: dict, g, wrong, a) -> None:
    """Eq. 1's backward roundings (``gradient_bound``): q (B,H,T,K), k (B,H,S,K), v (B,H,S,Dv)."""
    u = a.u
    q_in, q, k, s, p, v, out = (t[n] for n in ("q_in", "q", "k", "scores", "p", "v", "out"))
    dO, dP, dS, pd = g(out), g(p), g(s), p.detach()
    T, S, K, Dv = q.size(-2), k.size(-2), q.size(-1), v.size(-1)
    finite = torch.isfinite(s.detach())
    vd, kd, qd, od = v.detach(), k.detach(), q.detach(), out.detach()
    wrong(p, _roundings(2 * Dv, u) * (dO.abs() @ vd.abs().transpose(-2, -1)))  # dP = dO Vᵀ
    wrong(v, _roundings(2 * T, u) * (pd.transpose(-2, -1) @ dO.abs()))  # dV = Pᵀ dO
    D = (pd * dP).sum(-1, keepdim=True)
    d_err = torch.maximum(_roundings(2 * S, u) * (pd * dP).abs().sum(-1, keepdim=True),
                          _roundings(2 * Dv, u) * (dO.abs() * od.abs()).sum(-1, keepdim=True))
    s_fin = torch.where(finite, s, 0.0)
    wrong(s_fin, d_err, coef=-torch.where(finite, pd, 0.0))  # D, shared by a row
    wrong(s_fin, torch.where(finite, u * pd * (dP.abs() + D.abs()) + u * dS.abs(), 0.0))  # dS = P (dP - D)
    # the weights flash attention recomputes, exp(s - lse): the exponential's error, the recomputed scores'
    lse = torch.logsumexp(s.detach(), -1, keepdim=True)
    x = torch.where(finite, s.detach() - lse, 0.0).abs()
    terms = qd.abs() @ kd.abs().transpose(-2, -1)
    rho = a.exp_rel + a.exp_per_x * x + 3 * u * (x + lse.abs() + 1) + _roundings(2 * K, u) * terms
    coef_s, dO_v = torch.where(finite, dP - D, 0.0), lambda: dO @ v.transpose(-2, -1)  # (B,H,T,S), v live
    wrong(None, torch.where(finite, rho * pd, 0.0),  # one error δP, in dS (δP (dP - D)) and in dV (δPᵀ dO)
          term=lambda zb: (zb * (coef_s * s_fin + dO_v())).sum())
    wrong(q, _roundings(2 * S, u) * (dS.abs() @ kd.abs()))  # dQ = dS K
    wrong(k, _roundings(2 * T, u) * (dS.abs().transpose(-2, -1) @ qd.abs()))  # dK = dSᵀ Q
    wrong(q_in, u * g(q_in).abs())  # the scale, on q (the C kernels, PyTorch's math path) ...
    wrong(k, u * g(k).abs())  # ... or on q and k (SDPA's sqrt of it on each)
