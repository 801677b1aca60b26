"""Greedy search, beam search and sampling over a batch of sentences (§6.1).

The search talks to the model through a two-method protocol (``StepDecoder``) so that tests
can drive it with hand-written probability tables:

    state = decoder.start(src, max_len)          # src (B, S); state holds B rows
    log_probs, state = decoder.step(tokens, state)   # tokens (N,) -> log_probs (N, V)
    state = state.reorder(idx)                   # idx (N',) rows to keep, in order

Everything is vectorized over the (sentence * beam) rows; the only Python loop is over time
steps. A sentence leaves the batch (its decoder rows are dropped with ``reorder``) as soon as
it is done, so outputs never depend on which other sentences share the batch.

On a GPU the host waits for the device whenever it reads a value back, so each step reads one:
which sentences are done, (N,) flags. The rest is known on the host without asking (which
sentences still decode, whether one has a forced token at this step), found on the device (the
rows that leave, by a stable sort of those flags), or left there (the finished hypotheses, copied
to the host once at the end). The search never copies host data to the device after its start.
(``reorder_beams``, below, spares the decoder's state the reads that finding the beams'
structure in the reorder's indices would take.)

Definitions (documented choices):
- |Y| counts generated tokens *including* EOS, as tensor2tensor does; the score of a finished
  hypothesis is sum(log p) / lp(|Y|) with the GNMT penalty lp(L) = ((5 + L) / 6)^α, or with
  ``length_norm`` "power" lp(L) = L^α (transformers' length_penalty, which counts |Y| alike).
- The maximum output length is max_len = min(floor(a * |x| + b), cap) tokens, EOS included;
  |x| is the number of non-pad source tokens. A hypothesis that reaches max_len tokens without
  EOS is finished as it stands (flag ``eos=False``), with |Y| = max_len.
- EOS is forbidden while fewer than ``min_len`` tokens have been generated; pad and BOS are
  never generated.
- Beam search keeps the K best extensions of the live hypotheses at each step (top K of K*V).
  Those ending in EOS (or reaching max_len) move to the finished pool and leave the beam; the
  next step refills all K slots from the remaining live ones. So beam size 1 is greedy search.
  (tensor2tensor instead finishes EOS candidates from the top 2K; ours is OpenNMT's choice.)
- A forced target prefix (``Constraints.prefix``; interactive and post-editing tools) makes every
  hypothesis of a sentence begin with the given tokens: at step t <= its length, every other
  token's log-probability is -inf, and the forced token's own counts in the score. Its maximum
  output length is at least the prefix's length + 1. (While a prefix is forced, beam search takes
  the decoder's full ``step``, not ``step_topk``: the forced token need not be among the best.)
- ``no_repeat_ngram`` n > 0 (decode/ngram.py) bans, per hypothesis and step, every token that would
  complete an n-gram its tokens already hold, forced prefix tokens included; a forced token itself
  is never banned. Beam search then takes the decoder's full ``step`` from step n + 1 on (the ban
  differs per row), ``step_topk`` before.
- Exact early stop: with α >= 0 and log-probs <= 0, a live hypothesis with log-prob s can at
  best reach s / lp(max_len) (s only falls and lp only grows). A sentence is done when no live
  hypothesis's bound beats the nbest-th best finished score (nbest = 1: the best), or when no
  live hypothesis is left. With α = 0, lp = 1 and the bound is s itself.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

from aiayn.decode.config import DecodeConfig
from aiayn.decode.ngram import ban_repeated_ngrams
from aiayn.decode.topk import select_topk, topk_rows  # noqa: F401 (topk_rows: part of this module's interface)
from aiayn.execution.attention import attention_backends

NEG_INF = float("-inf")

# allowed(rows, prefix) -> (N, V) bool: the tokens each row may generate next. rows (N,): the batch
# sentence (row of src) of each hypothesis; prefix (N, t - 1): the tokens it has generated so far.
Allowed = Callable[[Tensor, Tensor], Tensor]


@runtime_checkable
class Rescoring(Protocol):
    """An ``Allowed`` that also moves probability among the tokens it allows (never adding any):
    ``rescore(log_probs, rows, prefix)`` returns log_probs (N, V) masked and rescored, in place."""

    def __call__(self, rows: Tensor, prefix: Tensor) -> Tensor: ...

    def rescore(self, log_probs: Tensor, rows: Tensor, prefix: Tensor) -> Tensor: ...


def _apply_allowed(log_probs: Tensor, allowed: Allowed | None, rows: Tensor, prefix: Tensor) -> Tensor:
    """log_probs (N, V) with the tokens ``allowed`` forbids set to -inf (in place); a ``Rescoring``
    rescores them too."""
    if isinstance(allowed, Rescoring):
        return allowed.rescore(log_probs, rows, prefix)
    if allowed is not None:
        log_probs.masked_fill_(~allowed(rows, prefix), NEG_INF)
    return log_probs


class DecoderState(Protocol):
    def reorder(self, idx: Tensor) -> "DecoderState":
        """Rows ``idx`` (N',) of this state, in that order (repeats allowed)."""

    # Optional: ``reorder`` of the rows ``beam_rows(keep, parent, K)``, told that structure (sentences
    # ``keep`` go on, row j of each continues its row ``parent[:, j]``), so that it need not be found
    # in the indices; a state without it gets ``reorder``. (``CachedState`` has it.)
    # def reorder_beams(self, keep, parent) -> DecoderState


class StepDecoder(Protocol):
    def start(self, src: Tensor, max_len: int) -> DecoderState:
        """Encode src (B, S) once; the state can decode up to max_len tokens per row."""

    def step(self, tokens: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """Feed the last tokens (N,); return log-probabilities (N, V) of the next token."""

    # Optional, for beam search: ``step`` followed by ``select_topk`` (what it must equal), done in
    # one go; a decoder without it gets exactly that. (``CachedDecoder`` has it: with the C kernels
    # the (N, V) log-probabilities are never written.)
    # def step_topk(self, tokens, state, k, banned) -> tuple[Tensor, Tensor, DecoderState]


@dataclass(frozen=True)
class SpecialIds:
    pad: int = 0
    bos: int = 2
    eos: int = 3


@dataclass(frozen=True)
class Hypothesis:
    """One output sentence: tokens exclude BOS and EOS."""

    tokens: tuple[int, ...]
    score: float  # sum log p / lp(|Y|)
    log_prob: float  # sum log p over |Y| tokens (EOS included when generated)
    length: int  # |Y|
    eos: bool  # False when stopped at the maximum length


class Stopped(Exception):
    """The caller's ``stop()`` ended the search between two steps (nobody waits for its results)."""


Stop = Callable[[], bool]  # asked before every step: True ends the search (``Stopped``)


@dataclass(frozen=True)
class Constraints:
    """What every hypothesis of a batch must satisfy besides its ``DecodeConfig`` (module
    docstring): at most ``max_len_cap`` tokens, EOS included (the model's positions); begin with
    its sentence's forced ``prefix`` (B, P; -1 after a sentence's prefix); take at each step only
    the tokens ``allowed`` gives. None everywhere: unconstrained."""
    max_len_cap: int | None = None
    prefix: Tensor | None = None
    allowed: Allowed | None = None


def _check_stop(stop: Stop | None, t: int, T: int) -> None:
    if stop is not None and stop():
        raise Stopped(f"search stopped by its caller before step {t} of at most {T}")


def length_penalty(length: Tensor | float, alpha: float, norm: str = "gnmt") -> Tensor | float:
    """GNMT length penalty lp(L) = ((5 + L) / 6)^α (Wu et al. 2016; §6.1 with α = 0.6), or with
    ``norm`` "power" L^α (transformers' beam scores; L >= 1). Both grow with L for α >= 0, which
    the early stop needs."""
    return length ** alpha if norm == "power" else ((5.0 + length) / 6.0) ** alpha


def max_output_lengths(src: Tensor, cfg: DecodeConfig, pad_id: int, cap: int | None = None) -> Tensor:
    """(B,) maximum output lengths floor(a * |x| + b), at least 1 and at most ``cap``."""
    src_len = (src != pad_id).sum(dim=1).double()  # (B,)
    out = torch.floor(cfg.max_len_a * src_len + cfg.max_len_b).long().clamp_(min=1)
    return out.clamp_(max=cap) if cap is not None else out


def _banned(t: int, cfg: DecodeConfig, ids: SpecialIds, device: torch.device) -> Tensor:
    """Token ids never generated at step t (1-based index of the new token): pad and BOS always,
    EOS while t <= min_len. (nb,) int64."""
    return torch.tensor([ids.pad, ids.bos] + ([ids.eos] if t <= cfg.min_len else []), device=device)


class _BannedSets:
    """``_banned`` of every step, made once (a tensor made at every step is a copy to the device)."""

    def __init__(self, cfg: DecodeConfig, ids: SpecialIds, device: torch.device):
        self.min_len = cfg.min_len
        self.early, self.late = _banned(1, cfg, ids, device), _banned(cfg.min_len + 1, cfg, ids, device)

    def at(self, t: int) -> Tensor:
        return self.early if t <= self.min_len else self.late


class _Forced:
    """Where a forced target prefix (``Constraints.prefix``) has a token, known on the host.

    ``prefix`` (B, P) holds each sentence's forced tokens, -1 after its prefix; the (B, P) flags
    are read once, at the start."""

    def __init__(self, prefix: Tensor):
        self.prefix = prefix
        self.flags = (prefix >= 0).tolist()

    def at(self, rows: Tensor, rows_host: list[int], t: int) -> Tensor | None:
        """The forced token at step t of each live row (N,) (-1: none), or None when no row has one;
        ``rows`` (N,) the original sentence of each live row, ``rows_host`` the same on the host."""
        if t > self.prefix.size(1) or not any(self.flags[r][t - 1] for r in rows_host):
            return None
        return self.prefix[rows, t - 1]


def reads_wait(device: torch.device) -> bool:
    """Whether reading a value of ``device`` on the host waits for the device's queued work: on
    accelerators, not on the CPU (where the search may read to skip work)."""
    return device.type != "cpu"


def _split(done: Tensor, flags: list[bool]) -> tuple[Tensor, Tensor]:
    """The rows that are done and those that go on, (n,) and (N - n,), each in increasing order,
    given ``done`` (N,) bool and its copy ``flags`` on the host. A stable sort puts the rows that
    go on first; ``nonzero`` would read the count back from the device."""
    order = torch.argsort(done.to(torch.uint8), stable=True)  # (N,)
    n_keep = flags.count(False)
    return order[n_keep:], order[:n_keep]


def reorder_state(state: DecoderState, keep: Tensor | None, parent: Tensor | None, K: int) -> DecoderState:
    """The state whose row i * K + j continues row keep[i] * K + parent[i, j] (``keep`` (B',) the
    sentences that go on, None for all; ``parent`` (B', K), None for K = 1 and parent 0). Through the
    state's ``reorder_beams`` where it has one, else ``reorder`` of those rows."""
    fn = getattr(state, "reorder_beams", None)
    if fn is not None:
        return fn(keep, parent)
    return state.reorder(beam_rows(keep, parent, K))


def beam_rows(keep: Tensor | None, parent: Tensor | None, K: int) -> Tensor:
    """The rows (B' * K,) that ``reorder_state``'s ``keep`` and ``parent`` describe."""
    if parent is None:
        return keep
    first = keep if keep is not None else torch.arange(parent.size(0), device=parent.device)
    return (first[:, None] * K + parent).view(-1)


def _force(log_probs: Tensor, forced: Tensor) -> Tensor:
    """log_probs (N, V) with every token but ``forced`` (N,) set to -inf in the rows that have one (in place)."""
    others = torch.arange(log_probs.size(1), device=log_probs.device)[None, :] != forced[:, None]  # (N, V)
    return log_probs.masked_fill_(others & (forced >= 0)[:, None], NEG_INF)


def _prefix_lengths(max_len: Tensor, prefix: Tensor | None, cap: int | None) -> Tensor:
    """max_len (B,) raised to each sentence's prefix length + 1 (still at most ``cap``)."""
    if prefix is None:
        return max_len
    out = torch.maximum(max_len, (prefix >= 0).sum(dim=1).to(max_len.device) + 1)
    return out.clamp_(max=cap) if cap is not None else out


def _step_topk(decoder: StepDecoder, tokens: Tensor, state: DecoderState, k: int,
               banned: Tensor) -> tuple[Tensor, Tensor, DecoderState]:
    """The decoder's ``step_topk`` if it has one, else ``step`` then ``select_topk``."""
    fused = getattr(decoder, "step_topk", None)
    if fused is not None:
        return fused(tokens, state, k, banned)
    log_probs, state = decoder.step(tokens, state)
    values, ids = select_topk(log_probs, k, banned)
    return values, ids, state


# ---------------------------------------------------------------------------------------------
# Output


class _Results:
    """Output buffers for B sentences x F hypotheses on the search's device, written as sentences
    finish and read on the host once, at the end (``hypotheses``)."""

    def __init__(self, B: int, F: int, T: int, device: torch.device):
        self.tokens = torch.zeros(B, F, T, dtype=torch.long, device=device)
        self.score = torch.full((B, F), NEG_INF, dtype=torch.float64, device=device)
        self.log_prob = torch.full((B, F), NEG_INF, dtype=torch.float64, device=device)
        self.length = torch.zeros(B, F, dtype=torch.long, device=device)
        self.eos = torch.zeros(B, F, dtype=torch.bool, device=device)

    def write(self, rows: Tensor, tokens: Tensor, score: Tensor, log_prob: Tensor,
              length: Tensor | int, eos: Tensor) -> None:
        """rows (n,); tokens (n, F, T'); the other tensors (n, F), or a length for all."""
        self.tokens[rows, :, : tokens.size(2)] = tokens
        self.score[rows] = score.double()
        self.log_prob[rows] = log_prob.double()
        if isinstance(length, int):
            self.length.index_fill_(0, rows, length)  # (a scalar assigned by index is a tensor made on the host)
        else:
            self.length[rows] = length
        self.eos[rows] = eos

    def hypotheses(self) -> list[list[Hypothesis]]:
        out = []
        for toks, sc, lp, n, e in zip(self.tokens.tolist(), self.score.tolist(), self.log_prob.tolist(),
                                      self.length.tolist(), self.eos.tolist()):
            out.append([Hypothesis(tuple(tk[: ln - int(ee)]), s, l, ln, ee)
                        for tk, s, l, ln, ee in zip(toks, sc, lp, n, e) if s != NEG_INF])
        return out


# ---------------------------------------------------------------------------------------------
# One path per row: greedy search and sampling


def _path_search(decoder: StepDecoder, src: Tensor, cfg: DecodeConfig, ids: SpecialIds,
                 choose: Callable[[Tensor], Tensor], constraints: Constraints | None = None,
                 stop: Stop | None = None) -> _Results:
    """Extend each row by ``choose(log_probs) -> tokens (N,)`` until EOS or its max length. A step
    reads one value back, its end check: which rows are done."""
    constraints = constraints or Constraints()
    cap, prefix, allowed = constraints.max_len_cap, constraints.prefix, constraints.allowed
    B, dev = src.size(0), src.device
    max_len = _prefix_lengths(max_output_lengths(src, cfg, ids.pad, cap), prefix, cap).to(dev)  # (B,)
    T = int(max_len.max())
    res = _Results(B, 1, T, dev)
    state = decoder.start(src, T)
    rows = torch.arange(B, device=dev)  # original row of each live row
    rows_host = list(range(B))  # the same, on the host
    forced_steps = _Forced(prefix) if prefix is not None else None
    banned = _BannedSets(cfg, ids, dev)
    seqs = torch.zeros(B, T, dtype=torch.long, device=dev)  # (N, T)
    total = torch.zeros(B, dtype=torch.float64, device=dev)  # (N,) sum log p
    last = torch.full((B,), ids.bos, dtype=torch.long, device=dev)
    for t in range(1, T + 1):
        _check_stop(stop, t, T)
        log_probs, state = decoder.step(last, state)
        log_probs = _apply_allowed(log_probs.index_fill_(1, banned.at(t), NEG_INF), allowed, rows,
                                   seqs[:, : t - 1])  # (N, V)
        forced = forced_steps.at(rows, rows_host, t) if forced_steps is not None else None
        if cfg.no_repeat_ngram:
            ban_repeated_ngrams(log_probs, seqs[:, : t - 1], cfg.no_repeat_ngram, ids.pad,
                                None if forced is None else forced >= 0)
        if forced is not None:
            log_probs = _force(log_probs, forced)
        tok = choose(log_probs)  # (N,)
        total += log_probs.gather(1, tok[:, None]).squeeze(1).double()
        seqs[:, t - 1] = tok
        is_eos = tok == ids.eos
        done = is_eos | (max_len <= t)
        flags = done.tolist()  # the step's one read
        if any(flags):
            d, keep = _split(done, flags)
            score = total[d] / length_penalty(float(t), cfg.alpha, cfg.length_norm)
            res.write(rows[d], seqs[d, None, :t], score[:, None], total[d, None], t, is_eos[d, None])
            if keep.numel() == 0:
                break
            state = reorder_state(state, keep, None, 1)
            rows, seqs, total, max_len, tok = rows[keep], seqs[keep], total[keep], max_len[keep], tok[keep]
            rows_host = [r for r, f in zip(rows_host, flags) if not f]
        last = tok
    return res


def filter_logits(log_probs: Tensor, cfg: DecodeConfig) -> Tensor:
    """Sampling distribution (as logits, N x V): temperature, then top-k, then top-p (nucleus)."""
    logits = log_probs / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < logits.size(-1):
        kth = logits.topk(cfg.top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if cfg.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
        drop_sorted = mass_before >= cfg.top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, NEG_INF)
    return logits


# ---------------------------------------------------------------------------------------------
# Beam search


class _Pool:
    """The F best finished hypotheses of each of N sentences (score -inf = empty slot)."""

    def __init__(self, N: int, F: int, T: int, device: torch.device, dtype: torch.dtype):
        self.tokens = torch.zeros(N, F, T, dtype=torch.long, device=device)
        self.score = torch.full((N, F), NEG_INF, dtype=dtype, device=device)
        self.log_prob = torch.full((N, F), NEG_INF, dtype=dtype, device=device)
        self.length = torch.zeros(N, F, dtype=torch.long, device=device)
        self.eos = torch.zeros(N, F, dtype=torch.bool, device=device)

    def merge(self, tokens: Tensor, log_prob: Tensor, ends: Tensor, is_eos: Tensor, t: int, alpha: float,
              norm: str = "gnmt") -> None:
        """Add candidates (N, K) that end at step t (scored with ``length_penalty(t, alpha, norm)``);
        keep the F best per sentence.

        A stable sort keeps earlier-finished hypotheses ahead of later ties.
        """
        F = self.score.size(1)
        cand = torch.where(ends, log_prob / length_penalty(float(t), alpha, norm), NEG_INF)  # (N, K)
        score = torch.cat([self.score, cand], dim=1)  # (N, F + K)
        best = score.sort(dim=1, descending=True, stable=True).indices[:, :F]  # (N, F)
        T = self.tokens.size(2)
        self.tokens = torch.cat([self.tokens, tokens], 1).gather(1, best[..., None].expand(-1, -1, T))
        self.score = score.gather(1, best)
        self.log_prob = torch.cat([self.log_prob, log_prob], 1).gather(1, best)
        self.length = torch.cat([self.length, torch.full_like(ends, t, dtype=torch.long)], 1).gather(1, best)
        self.eos = torch.cat([self.eos, is_eos], 1).gather(1, best)

    def select(self, keep: Tensor) -> None:
        for name in ("tokens", "score", "log_prob", "length", "eos"):
            setattr(self, name, getattr(self, name)[keep])


def _beam_search(decoder: StepDecoder, src: Tensor, cfg: DecodeConfig, ids: SpecialIds,
                 constraints: Constraints | None = None, stop: Stop | None = None) -> _Results:
    """Beam search with exact early stopping (module docstring); K = beam size, F = nbest. A step
    reads one value back: which sentences are done."""
    constraints = constraints or Constraints()
    cap, prefix, allowed = constraints.max_len_cap, constraints.prefix, constraints.allowed
    B, K, F, dev = src.size(0), cfg.beam_size, cfg.nbest, src.device
    max_len = _prefix_lengths(max_output_lengths(src, cfg, ids.pad, cap), prefix, cap).to(dev)  # (N,)
    T = int(max_len.max())
    res = _Results(B, F, T, dev)
    lp_max = length_penalty(max_len.double(), cfg.alpha, cfg.length_norm)  # (N,) for the early-stop bound
    state = decoder.start(src, T).reorder(torch.arange(B, device=dev).repeat_interleave(K))
    rows = torch.arange(B, device=dev)
    rows_host = list(range(B))  # the same, on the host
    forced_steps = _Forced(prefix) if prefix is not None else None
    live = torch.full((B, K), NEG_INF, device=dev)  # (N, K) sum log p of live hypotheses
    live[:, 0] = 0.0  # all K beams start as the same empty prefix: expand only one
    seqs = torch.zeros(B, K, T, dtype=torch.long, device=dev)  # (N, K, T)
    pool = None
    last = torch.full((B * K,), ids.bos, dtype=torch.long, device=dev)
    banned = _BannedSets(cfg, ids, dev)
    # (a merge without endings changes nothing: where a read waits for the device, it is cheaper than asking)
    merge_always = reads_wait(dev)
    for t in range(1, T + 1):
        _check_stop(stop, t, T)
        # The K best of a sentence's K*V extensions are among each beam's k = min(K, V) best
        # tokens: take those first (per row, where adding the beam's score cannot change the
        # order), then the K best of the K*k sums. Same values as topk over all K*V sums, without that pass.
        forced = forced_steps.at(rows, rows_host, t) if forced_steps is not None else None
        ngram = cfg.no_repeat_ngram if t > cfg.no_repeat_ngram else 0  # a hypothesis may hold an n-gram
        if forced is None and allowed is None and not ngram:
            row_lp, row_tok, state = _step_topk(decoder, last, state, K, banned.at(t))
        else:  # a prefix, a constraint or the n-gram ban needs the (N*K, V) log-probabilities
            log_probs, state = decoder.step(last, state)
            if allowed is not None or ngram:
                prior = seqs[:, :, : t - 1].reshape(seqs.size(0) * K, t - 1)  # (N*K, t-1)
            if allowed is not None:
                log_probs = _apply_allowed(log_probs, allowed, rows.repeat_interleave(K), prior)
            if ngram:
                ban_repeated_ngrams(log_probs, prior, ngram, ids.pad,
                                    None if forced is None else (forced >= 0).repeat_interleave(K))
            if forced is not None:  # every beam of the sentence continues with its forced token
                log_probs = _force(log_probs, forced.repeat_interleave(K))
            row_lp, row_tok = select_topk(log_probs, K, banned.at(t))
        if pool is None:
            live = live.to(row_lp.dtype)
            pool = _Pool(B, F, T, dev, row_lp.dtype)
        N, k = live.size(0), row_lp.size(1)  # (N*K, k) rows
        cand = (row_lp.view(N, K, k) + live[:, :, None]).view(N, K * k)
        top_lp, top_j = cand.topk(K, dim=1)  # (N, K)
        parent, tok = top_j // k, row_tok.view(N, K * k).gather(1, top_j)
        seqs = seqs.gather(1, parent[..., None].expand(-1, -1, T))
        seqs[:, :, t - 1] = tok
        is_eos = tok == ids.eos
        ends = is_eos | (max_len <= t)[:, None]  # (N, K); -inf candidates stay -inf in the pool
        if merge_always or bool(ends.any()):
            pool.merge(seqs, top_lp, ends, is_eos & ends, t, cfg.alpha, cfg.length_norm)
        live = top_lp.masked_fill(ends, NEG_INF)
        bound = live.max(dim=1).values / lp_max  # (N,) best reachable normalized score
        done = pool.score[:, F - 1] >= bound  # also true when no live hypothesis is left
        flags = done.tolist()  # the step's one read
        keep = None
        if any(flags):
            d, keep = _split(done, flags)
            res.write(rows[d], pool.tokens[d, :, :t], pool.score[d], pool.log_prob[d], pool.length[d], pool.eos[d])
            if keep.numel() == 0:
                break
            pool.select(keep)
            rows, live, seqs, max_len, lp_max = rows[keep], live[keep], seqs[keep], max_len[keep], lp_max[keep]
            parent, tok = parent[keep], tok[keep]
            rows_host = [r for r, f in zip(rows_host, flags) if not f]
        state = reorder_state(state, keep, parent, K)
        last = tok.reshape(-1)
    return res


# ---------------------------------------------------------------------------------------------
# Entry point


@torch.inference_mode()
def search(decoder: StepDecoder, src: Tensor, cfg: DecodeConfig, ids: SpecialIds = SpecialIds(),
           constraints: Constraints = Constraints(), generator: torch.Generator | None = None,
           stop: Stop | None = None) -> list[list[Hypothesis]]:
    """Decode a batch src (B, S): per sentence, up to ``cfg.nbest`` hypotheses, best first.

    Beam search when beam_size > 1, greedy search when 1, sampling when ``cfg.sampling``
    (then nbest independent samples per sentence, sorted by score). ``constraints``: the maximum
    length's cap; ``prefix`` (B, P), target tokens each sentence's hypotheses must begin with, -1
    after a sentence's prefix (module docstring); ``allowed`` (module docstring), which restricts
    every step's choice (with sampling its rows index the repeated batch). ``stop()``, where given,
    is asked before every step (a Python call, no device read); when it says True the search
    raises ``Stopped``.
    """
    if constraints.prefix is not None:
        constraints = replace(constraints, prefix=constraints.prefix.to(src.device))
    with attention_backends(src.device):
        return _search(decoder, src, cfg, ids, constraints, generator, stop)


def _search(decoder: StepDecoder, src: Tensor, cfg: DecodeConfig, ids: SpecialIds, constraints: Constraints,
            generator: torch.Generator | None, stop: Stop | None) -> list[list[Hypothesis]]:
    if cfg.sampling:
        gen = generator if generator is not None else torch.Generator(device=src.device).manual_seed(cfg.seed)

        def draw(log_probs: Tensor) -> Tensor:
            probs = filter_logits(log_probs, cfg).softmax(dim=-1)
            return torch.multinomial(probs, 1, generator=gen).squeeze(1)

        prefix = constraints.prefix
        repeated = replace(constraints, prefix=None if prefix is None else prefix.repeat_interleave(cfg.nbest, dim=0))
        res = _path_search(decoder, src.repeat_interleave(cfg.nbest, dim=0), cfg, ids, draw, repeated, stop)
        flat = res.hypotheses()
        return [sorted((h for hs in flat[b * cfg.nbest:(b + 1) * cfg.nbest] for h in hs),
                       key=lambda h: -h.score) for b in range(src.size(0))]
    if cfg.beam_size == 1:
        res = _path_search(decoder, src, cfg, ids, lambda lp: lp.argmax(dim=-1), constraints, stop)
    else:
        res = _beam_search(decoder, src, cfg, ids, constraints, stop)
    return res.hypotheses()
