"""The CUDA paths against the plain paths, on a GPU (skipped, with the reason, where there is none).

Their CPU halves run everywhere in tests/train, tests/model and tests/decode (the loss's block sizes,
the attention upcast rule, the beam pool's merge, cuDNN left out of decoding); these check the same
on the device: the training step, the loss, bf16 attention and beam search.
"""
from __future__ import annotations

import io

import pytest
import torch

import aiayn
from aiayn.data.batching import collate
from aiayn.data.stream import to_device
from aiayn.checkpoint.run import Learner
from aiayn.train import runtime as rt
from aiayn.train import updates
from tests.arith import U32, loss_sums, smoothed_loss_gradients, within
from tests.grad_rounding import gradient_bound, same_gradients
from tests.rounding import FORMATS, logit_bounds, same_float_search, summed_loss_bound
from tests.train.steps import passes, read_step
from tests.train.test_fp16 import gradients_not_finite_at_any_scale, overflow_then_recover
from aiayn.train.config import TrainConfig
from aiayn.train.objective import label_smoothed_loss, label_smoothed_loss_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def _tiny(**kw):
    base = dict(vocab_size=301, p_drop=0.0, n_layers=2, d_model=64, d_ff=128, n_heads=4, d_k=16, d_v=16)
    base.update(kw)
    return aiayn.get_preset("tiny", **base)


def _batch(cfg, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    pairs = [(torch.randint(4, cfg.vocab_size, (int(L),), generator=g).numpy(),
              torch.randint(4, cfg.vocab_size, (int(M),), generator=g).numpy())
             for L, M in zip(torch.randint(3, 15, (n,), generator=g), torch.randint(3, 15, (n,), generator=g))]
    return collate(pairs, cfg.pad_id, cfg.bos_id, cfg.eos_id)


def _step_grads(cfg, batch, device, precision):
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).to(device).train()
    b = to_device(batch, device)
    sums, _ = passes(model, [b], TrainConfig(), 1 / batch.n_tgt_tokens, device, precision)
    norm = updates.grad_norm(list(model.parameters()), None)
    values = read_step(sums, norm, float(batch.n_tgt_tokens), device)
    return values, {n: p.grad.float().cpu() for n, p in model.named_parameters()}


def test_training_step_on_cuda_equals_the_cpu_step(float32_sums):
    """fp32: the loop's step on CUDA (pinned, non_blocking batch; device sums; one read) gives the
    CPU's loss and NLL, gradient norm and gradients, each device within its float32 roundings of the
    exact ones (``_loss_bound``; ``gradient_bound``, tests/grad_rounding.py, with CUDA's fast exp and
    log for "fp32-cuda")."""
    cfg = _tiny()
    batch = _batch(cfg)
    (cpu_vals, cpu_g), (gpu_vals, gpu_g) = _step_grads(cfg, batch, torch.device("cpu"), "fp32"), \
        _step_grads(cfg, batch, CUDA, "fp32")
    for i, eps_ls in ((0, 0.1), (1, 0.0)):  # the loss, the NLL: each device within its roundings
        bound = _loss_bound(cfg, batch, "fp32", eps_ls) + _loss_bound(cfg, batch, "fp32-cuda", eps_ls)
        assert abs(cpu_vals[i] - gpu_vals[i]) <= bound, (i, cpu_vals[i], gpu_vals[i], bound)
    assert cpu_vals[2:5] == gpu_vals[2:5] and cpu_vals[6] == gpu_vals[6]  # KL (0), tokens, clock, FLOPs
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).train()  # the step's model
    scale = 1 / batch.n_tgt_tokens
    on_cpu, on_cuda = (gradient_bound(model, fmt, batch, 0.1, scale, cfg.pad_id) for fmt in ("fp32", "fp32-cuda"))
    assert abs(cpu_vals[5] - gpu_vals[5]) <= on_cpu.norm + on_cuda.norm  # the gradient norm
    same_gradients(gpu_g, cpu_g, on_cuda, on_cpu)


def _loss_bound(cfg, batch, precision: str, eps_ls: float = 0.1) -> float:
    """How far ``precision``'s arithmetic (tests/rounding.py: "fp32", "fp32-cuda" with CUDA's fast exp
    and log, or "bf16" as autocast rounds: every parameter and result, a superset of autocast's
    places) moves the step's summed loss (``read_step``'s first number) from the exact one, its
    float32 sum over the tokens included (``summed_loss_bound``; under bf16 the loss itself is
    float32 on CUDA)."""
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).eval()  # the step's model (p_drop 0: train and eval forwards agree)
    return summed_loss_bound(model, precision, batch, eps_ls, cfg.pad_id, None if precision in FORMATS else "fp32-cuda")


def test_bf16_training_step_on_cuda_is_close_to_fp32(float32_sums):
    """bf16 autocast with the heads in bf16 through the fused kernels: the loss within bf16's roundings
    and float32's of the exact one (``_loss_bound``), so within their sum of the fp32 step's."""
    cfg = _tiny()
    batch = _batch(cfg, seed=1)
    fp32, _ = _step_grads(cfg, batch, CUDA, "fp32")
    bf16, _ = _step_grads(cfg, batch, CUDA, "bf16")
    assert abs(bf16[0] - fp32[0]) <= _loss_bound(cfg, batch, "bf16") + _loss_bound(cfg, batch, "fp32-cuda")


def test_fp16_step_on_cuda_skips_an_overflow_and_recovers():
    """fp16 with its gradient scaler, what ``precision=auto`` takes on a T4, V100 or P100: an overflowing
    step leaves the weights and Adam as they were and halves the scale; then a step updates
    (``overflow_then_recover``, which tests/train/test_fp16.py runs on the CPU)."""
    overflow_then_recover(CUDA)


def test_fp16_gradients_not_finite_at_any_scale_stop_the_run_on_cuda():
    """A NaN gradient behind a finite loss at every fp16 step: the scaler's skips take its scale below
    ``MIN_LOSS_SCALE`` and the run stops, its weights untouched (tests/train/test_fp16.py on the CPU)."""
    gradients_not_finite_at_any_scale(CUDA)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_on_cuda_equals_the_reference(dtype):
    """The large-block loss on CUDA against its autograd reference and against the CPU: loss, NLL and
    the logits' gradients within the sum of the two paths' derived bounds (``loss_sums``,
    ``smoothed_loss_gradients``: tests/arith.py)."""
    torch.manual_seed(0)
    V = 37000
    base = (torch.randn(8, 40, V) * 2).to(dtype)  # 320 rows: the bounds' float64 arithmetic stays quick
    target = torch.randint(1, V, (8, 40))
    target[3, 20:] = 0
    out = {}
    for name, fn, dev in (("fast", label_smoothed_loss, CUDA), ("ref", label_smoothed_loss_reference, CUDA),
                          ("cpu", label_smoothed_loss, torch.device("cpu"))):
        logits = base.to(dev, copy=True).requires_grad_(True)  # a copy: the fused loss writes its gradient over it
        sums = fn(logits, target.to(dev), 0.1, 0)
        (sums.loss + 0.5 * sums.nll).backward()
        out[name] = (sums.loss.item(), sums.nll.item(), logits.grad.float().cpu())
    # the loss and NLL: each path within its float32 roundings of the exact sums (``loss_sums``,
    # tests/arith.py; CUDA's expf within 2 ulp and logf 1 ulp, the CPU's 1 ulp each); 1.01: float64's own
    z, t = base.reshape(-1, V).float(), target.reshape(-1)
    cuda = dict(exp_rel=4 * U32, log_rel=2 * U32, ref_exp_rel=4 * U32, ref_log_rel=2 * U32)
    (fast_loss, fast_nll), (ref_loss, ref_nll) = loss_sums(z, t, 0.1, 0, **cuda)
    (cpu_loss, cpu_nll), _ = loss_sums(z, t, 0.1, 0)  # label_smoothed_loss on the CPU
    # the gradients of loss + 0.5 nll, each path's float32 arithmetic and its rounding to the logits' dtype
    zd = base.reshape(-1, V)
    fast_g, ref_g = smoothed_loss_gradients(zd, t, 0.1, 0, 1.0, 0.5, **cuda)
    cpu_g, _ = smoothed_loss_gradients(zd, t, 0.1, 0, 1.0, 0.5)
    for other, (o_loss, o_nll, o_g) in (("ref", (ref_loss, ref_nll, ref_g)), ("cpu", (cpu_loss, cpu_nll, cpu_g))):
        assert abs(out["fast"][0] - out[other][0]) <= 1.01 * float(fast_loss.e + o_loss.e), other
        assert abs(out["fast"][1] - out[other][1]) <= 1.01 * float(fast_nll.e + o_nll.e), other
        within(out["fast"][2].reshape(-1, V), out[other][2].reshape(-1, V).double(), 1.01 * (fast_g.e + o_g.e))


def test_beam_search_on_cuda_matches_the_cpu(confident_model):
    """Beam search on CUDA (cuDNN attention left out, merges without host checks) against the CPU's.
    In float64 the same hypotheses, each score within float64's roundings of the exact one
    (``same_float_search``, tests/rounding.py). On the confident copy model, fp32 and bf16 on CUDA find
    the CPU fp32 search's tokens: its every decision leads by ``CONFIDENT_MARGIN`` nats, more than
    twice what their roundings move a log-probability (tests/conftest.py)."""
    import copy

    from aiayn.decode.adapter import CachedDecoder
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.search import SpecialIds, search
    from aiayn.decode.loading import model_for_precision
    cfg = _tiny()
    torch.manual_seed(0)
    wide = aiayn.Transformer(cfg).eval().double()
    src = _batch(cfg, n=8, seed=2).src
    dcfg = DecodeConfig(beam_size=4, nbest=4, max_len_a=0, max_len_b=12)
    ids = SpecialIds(cfg.pad_id, cfg.bos_id, cfg.eos_id)
    cpu = search(CachedDecoder(wide), src, dcfg, ids)
    gpu = search(CachedDecoder(copy.deepcopy(wide).to(CUDA)), src.to(CUDA), dcfg, ids)
    same_float_search(wide, src, gpu, cpu, dcfg, ids, "fp64")  # each within float64's roundings (tests/rounding.py)
    model, src = confident_model
    want = [h[0].tokens for h in search(CachedDecoder(model), src, DecodeConfig(beam_size=4), SpecialIds())]
    for precision in ("fp32", "bf16"):
        m = model_for_precision(copy.deepcopy(model).to(CUDA), precision)
        got = search(CachedDecoder(m), src.to(CUDA), DecodeConfig(beam_size=4, precision=precision), SpecialIds())
        assert [h[0].tokens for h in got] == want, precision


def test_search_on_cuda_waits_once_per_step():
    """``torch.cuda.set_sync_debug_mode``: beam search and greedy search on CUDA synchronize with the
    host once per step (the done flags), counted through the warnings the debug mode gives."""
    import warnings

    from aiayn.decode.adapter import CachedDecoder
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.search import SpecialIds, search
    cfg = _tiny()
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).eval().to(CUDA)
    src = _batch(cfg, n=8, seed=2).src.to(CUDA)
    ids = SpecialIds(cfg.pad_id, cfg.bos_id, cfg.eos_id)
    for beam in (4, 1):
        dcfg = DecodeConfig(beam_size=beam, max_len_a=0, max_len_b=12)
        search(CachedDecoder(model), src, dcfg, ids)  # warm-up
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                search(CachedDecoder(model), src, dcfg, ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        assert 1 <= len(syncs) <= 12 + 12, (beam, len(syncs))  # one a step (12 steps), the start's and the end's reads
        # (at least the first step's read: the debug mode counts here, or the bound says nothing)


@pytest.mark.parametrize("beam", [4, 1])
def test_graph_replayed_search_on_cuda_equals_the_cached_search(beam, confident_model):
    """``GraphDecoder`` on CUDA (each step a replayed CUDA graph): in float64 the cached search's hypotheses
    and scores up to float64's roundings (``same_float_search``, tests/rounding.py); a second batch of the
    same bucket replays the captured graph over its own buffers; on the confident copy model, fp32 and bf16
    graphs find the CPU fp32 search's tokens (as in ``test_beam_search_on_cuda_matches_the_cpu``)."""
    import copy

    from aiayn.decode.adapter import CachedDecoder
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.graphs import GraphDecoder
    from aiayn.decode.search import SpecialIds, search
    from aiayn.decode.loading import model_for_precision
    cfg = _tiny()
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).eval().to(CUDA)
    src = _batch(cfg, n=8, seed=2).src.to(CUDA)
    dcfg = DecodeConfig(beam_size=beam, nbest=beam, max_len_a=0, max_len_b=12)
    ids = SpecialIds(cfg.pad_id, cfg.bos_id, cfg.eos_id)
    wide = model.double()
    graphs = GraphDecoder(wide)
    for batch in (src, src[2:7, :9]):
        want, got = search(CachedDecoder(wide), batch, dcfg, ids), search(graphs, batch, dcfg, ids)
        same_float_search(copy.deepcopy(wide).cpu(), batch.cpu(), got, want, dcfg, ids, "fp64")
    assert len(graphs._buckets) == 1 and next(iter(graphs._buckets.values()))._graph is not None
    confident, src = confident_model
    want = [hs[0].tokens for hs in search(CachedDecoder(confident), src, DecodeConfig(beam_size=beam), SpecialIds())]
    for precision in ("fp32", "bf16"):
        m = model_for_precision(copy.deepcopy(confident).to(CUDA), precision)
        out = search(GraphDecoder(m), src.to(CUDA), DecodeConfig(beam_size=beam, precision=precision), SpecialIds())
        assert [hs[0].tokens for hs in out] == want, precision


def test_unpadded_batch_on_cuda_without_mask_is_the_masked_one(float32_sums):
    """``src_padded=False`` (no key mask: flash) and the additive mask made once give the boolean
    mask's logits on CUDA under bf16 autocast, each within bf16's roundings of the exact logits
    (``logit_bounds``, tests/rounding.py: every parameter and result rounded, a superset of
    autocast's places), so within twice them of each other."""
    cfg = _tiny()
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).to(CUDA).eval()
    src = torch.randint(4, cfg.vocab_size, (3, 11), device=CUDA)  # 3 sentences: the bound's float64 stays quick
    tgt = torch.randint(4, cfg.vocab_size, (3, 9), device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        masked = model(src, tgt).float()
        unmasked = model(src, tgt, src_padded=False).float()
    bound = logit_bounds(model.cpu(), "bf16", src.cpu(), tgt.cpu(), cfg.pad_id)
    within(masked.cpu(), unmasked.cpu().double(), 2 * bound)
    # a padded batch in float32: the boolean mask against the additive one that a run's attention
    # (``use_attention_kernels``) makes once on CUDA, each within CUDA's float32 roundings of the exact logits
    import copy

    from aiayn.execution import use_attention_kernels
    model.to(CUDA)
    src[2, 7:] = cfg.pad_id
    executed = copy.deepcopy(model)
    use_attention_kernels(executed, None)
    with torch.no_grad():
        a, b = model(src, tgt), executed(src, tgt)
    within(a.cpu(), b.cpu().double(), 2 * logit_bounds(model.cpu(), "fp32-cuda", src.cpu(), tgt.cpu(), cfg.pad_id))


def test_update_queued_before_the_read_on_cuda():
    """The fused Adam step queued with its device-side skip flag: 0 is the plain step, 1 no step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(CUDA)
    from aiayn.train.objective import make_optimizer
    opt = make_optimizer(model.parameters(), 1e-2, (0.9, 0.98), 1e-9, fused=True)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 8, device=CUDA)).sum().backward()
    updates.update(Learner(model, opt), 0.0, None, skip=torch.ones((), device=CUDA))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    model(torch.randn(3, 8, device=CUDA)).sum().backward()
    updates.update(Learner(model, opt), 0.0, None, skip=torch.zeros((), device=CUDA))
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert rt.host_to_device([1.5, 2.0], CUDA).tolist() == [1.5, 2.0]


def test_rng_state_round_trips_the_cuda_generator():
    """Where CUDA is in use, the current device's generator (dropout's masks on the GPU) is saved
    as a tensor, survives a weights_only save and load, and comes back."""
    torch.rand(1, device="cuda")  # CUDA in use
    state = rt.rng_state()
    assert isinstance(state["cuda"], torch.Tensor)
    want = torch.rand(5, device="cuda")
    torch.cuda.manual_seed(7)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    rt.set_rng_state(torch.load(buf, weights_only=True))
    assert torch.equal(want, torch.rand(5, device="cuda"))
