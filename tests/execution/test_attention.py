"""How a run computes Eq. 1 (``aiayn.execution.attention``) against the model's own attention: the C
kernels, float32 under bf16 autocast, the additive key mask (tiny models)."""
from __future__ import annotations

import pytest
import torch

import aiayn
from aiayn.execution import use_attention_kernels
from aiayn.model.attention import ScaledDotProductAttention
from tests.kernels.test_seq_attention import check_seq_attention
from tests.arith import within
from tests.rounding import attend_bound


class _Counting:
    """A Kernels stand-in that counts the attention calls it passes on to the real library, and keeps
    each call's arguments and results."""

    def __init__(self, lib):
        self.lib, self.forward, self.backward = lib, 0, 0
        self.calls = []  # (q, k, v, mask, causal, out, lse) of each forward
        self.grads = []  # (q, k, v, mask, causal, lse, dout, (dq, dk, dv)) of each backward

    def seq_attention_fast(self, d_k, d_v):
        return self.lib.seq_attention_fast(d_k, d_v)

    def supports_heads(self, *a):
        return self.lib.supports_heads(*a)

    def seq_attention_forward(self, *a):
        self.forward += 1
        out, lse = self.lib.seq_attention_forward(*a)
        self.calls.append((*a, out, lse))
        return out, lse

    def seq_attention_backward(self, *a):
        self.backward += 1
        grads = self.lib.seq_attention_backward(*a)
        self.grads.append((*a, grads))
        return grads


class _PyTorchEq1:
    """A Kernels stand-in that computes what ``ExecutedAttention`` computes without kernels: Eq. 1 by
    the model's own attention in float32 (bfloat16 heads widened, the output rounded back), and for the
    backward its autograd on the same operations recomputed. Through it, the plumbing of the kernels
    (which calls, which masks, which layouts, which gradients go where) meets PyTorch's own arithmetic."""

    def __init__(self):
        self.forward = 0

    def seq_attention_fast(self, d_k, d_v):
        return True

    def supports_heads(self, *a):
        return True

    @staticmethod
    def _eq1(q, k, v, mask, causal):
        with torch.autocast(q.device.type, enabled=False):
            out, _ = ScaledDotProductAttention(0.0)(q.float(), k.float(), v.float(), mask, causal)
        return out.to(q.dtype)

    def seq_attention_forward(self, q, k, v, mask, causal):
        self.forward += 1
        return self._eq1(q, k, v, mask, causal), torch.zeros(())  # no log-normalizers: the backward recomputes

    def seq_attention_backward(self, q, k, v, mask, causal, lse, g):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            return torch.autograd.grad(self._eq1(*leaves, mask, causal), leaves, g)


def _model_and_batch():
    torch.manual_seed(0)
    model = aiayn.Transformer(aiayn.ModelConfig(vocab_size=60, n_layers=2, d_model=64, d_ff=96, n_heads=2, d_k=32, d_v=32,
                                    p_drop=0.0))
    src, tgt = torch.randint(4, 60, (4, 9)), torch.randint(4, 60, (4, 7))
    src[1, 6:] = 0  # source padding: masked keys
    tgt[2, 4:] = 0
    return model, src, tgt


def _step(model, src, tgt, kernels, precision):
    """The loss and every parameter's gradient with ``kernels`` (None: PyTorch's attention)."""
    from aiayn.train import runtime as rt

    use_attention_kernels(model, kernels)
    model.zero_grad()
    with rt.autocast(torch.device("cpu"), precision):
        logits = model(src, tgt)
    loss = torch.nn.functional.cross_entropy(logits.float().view(-1, 60), tgt.view(-1), ignore_index=0)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_attention_kernels_are_pytorchs_attention(precision):
    """train.c_kernels' attention (seq_attention.c through execution.use_attention_kernels) is a fast
    path: every attention of the model's forward goes through it (encoder, masked decoder, encoder-decoder),
    and each call's output and gradients are Eq. 1's to the kernel's rounding (``check_seq_attention``),
    in float32 and under bf16 autocast (whose attention is computed in float32 either way). How the
    calls are put together is the next test's."""
    from aiayn.kernels.loader import load

    lib = load()
    if lib is None or not lib.seq_attention_fast(32, 32):
        pytest.skip("no C compiler or no AVX-512: training uses PyTorch's attention")
    counting = _Counting(lib)
    _step(*_model_and_batch(), counting, precision)
    assert counting.forward == 3 * 2 and counting.backward == 3 * 2  # 2 layers: encoder self, decoder self and cross
    for q, k, v, mask, causal, out, lse in counting.calls:
        check_seq_attention(q, k, v, mask, causal, out, lse)
    for q, k, v, mask, causal, lse, g, grads in counting.grads:  # the forward again for its output (the same bits)
        check_seq_attention(q, k, v, mask, causal, *lib.seq_attention_forward(q, k, v, mask, causal), g, grads)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_attention_through_the_kernels_plumbing_is_pytorchs(precision):
    """With PyTorch's own Eq. 1 in the kernels' place (``_PyTorchEq1``), the model's loss and every
    parameter's gradient through the kernels' path are the PyTorch path's bit for bit: the same
    operations in the same order, so the calls, masks, layouts and gradients are put where PyTorch's go."""
    model, src, tgt = _model_and_batch()
    eq1 = _PyTorchEq1()
    (l1, g1), (l2, g2) = _step(model, src, tgt, eq1, precision), _step(model, src, tgt, None, precision)
    assert eq1.forward == 3 * 2 and l1 == l2
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name


def test_attention_kernels_step_aside():
    """Where the kernels do not apply, PyTorch's attention: weights asked for, attention dropout in
    training, heads the AVX-512 path lacks, and a module with no kernels."""
    from aiayn.kernels.loader import load

    lib = load()
    if lib is None:
        pytest.skip("no C compiler")
    model = aiayn.Transformer(aiayn.ModelConfig(vocab_size=60, n_layers=1, d_model=64, d_ff=96, n_heads=2, d_k=32, d_v=32,
                                    p_drop=0.0, p_drop_attn=0.1))
    counting = _Counting(lib)
    use_attention_kernels(model, counting)
    src, tgt = torch.randint(4, 60, (2, 5)), torch.randint(4, 60, (2, 4))
    model.train()
    model(src, tgt)  # attention dropout in training
    assert counting.forward == 0
    model.eval()
    model.encode(src, need_weights=True)
    assert counting.forward == 0
    model(src, tgt)  # evaluation: no dropout, so the kernels (where this build has them)
    assert counting.forward == (3 if lib.seq_attention_fast(32, 32) else 0)
    odd = aiayn.Transformer(aiayn.ModelConfig(vocab_size=60, n_layers=1, d_model=64, d_ff=96, n_heads=2, d_k=16, d_v=16))
    use_attention_kernels(odd, counting)
    odd.eval()(src, tgt)
    assert counting.forward == (3 if lib.seq_attention_fast(32, 32) else 0)  # d_k 16: not taken


def test_attn_fp32_upcasts_on_the_cpu_only():
    """``attn_fp32``: under CPU bf16 autocast the attention core is float32 (the same bits as the
    model's own attention on the same bf16 heads made float32 by hand, autocast off: the same operations
    in the same order, then the same rounding to bf16 and W^O); on CUDA it is not upcast, since the fused
    kernels keep the softmax in float32 themselves (a stand-in for a CUDA tensor: only its device
    type and dtype are read)."""
    from types import SimpleNamespace

    from aiayn.execution.attention import ExecutedAttention
    from aiayn.model.attention import MultiHeadAttention
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model=16, n_heads=2, d_k=8, d_v=8, p_drop_attn=0.0, self_attention=True).eval()
    mha.core = ExecutedAttention(0.0, attn_fp32=True)
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])[:, None, None, :]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = mha.project_qkv(x)
        assert q.dtype == torch.bfloat16 and mha.core._upcast(q)
        out, _ = mha.attend(q, k, v, mask)
        with torch.autocast("cpu", enabled=False):
            want = ScaledDotProductAttention(0.0).eval()(q.float(), k.float(), v.float(), mask)[0]
        assert want.dtype == torch.float32
        want = mha.out_proj(want.to(torch.bfloat16))
    assert out.dtype == want.dtype and torch.equal(out, want)
    cuda_heads = SimpleNamespace(device=torch.device("cpu"), dtype=torch.bfloat16)
    cuda_heads.device = SimpleNamespace(type="cuda")
    assert not mha.core._upcast(cuda_heads)
    mha.core.attn_fp32 = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not mha.core._upcast(mha.project_qkv(x)[0])


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("S,T", [(9, 7), (40, 33)])
def test_no_key_mask_for_a_source_without_padding(kernels, precision, S, T):
    """``src_padded=False`` (``Batch.src_padded``: the batch is known to hold no padding) gives the
    attention no key mask, so the fused kernels may take flash; on the CPU the same logits and gradients,
    bit for bit, as the all-true mask, through PyTorch's attention and through the C kernels."""
    from aiayn.kernels.loader import load
    from aiayn.train import runtime as rt

    lib = load() if kernels else None
    if kernels and (lib is None or not lib.seq_attention_fast(32, 32)):
        pytest.skip("no C compiler or no AVX-512")
    torch.manual_seed(0)
    model = aiayn.Transformer(aiayn.ModelConfig(vocab_size=60, n_layers=2, d_model=64, d_ff=96, n_heads=2, d_k=32,
                                                d_v=32, p_drop=0.0))
    use_attention_kernels(model, lib)
    src, tgt = torch.randint(4, 60, (3, S)), torch.randint(4, 60, (3, T))
    results = []
    for padded in (True, False):
        model.zero_grad()
        with rt.autocast(torch.device("cpu"), precision):
            logits = model(src, tgt, src_padded=padded)
        logits.float().square().mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = results
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_key_mask_equals_the_boolean_one(dtype):
    """``additive_key_mask`` (what CUDA's training gets, made once for every layer): 0 at tokens,
    -inf at padding, its rows 16 entries apart (no copy by the memory-efficient kernel), and the same
    attention as the boolean mask."""
    from aiayn.execution.attention import additive_key_mask
    from aiayn.model.attention import MultiHeadAttention, key_mask
    src_pad = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    additive = additive_key_mask(key_mask(src_pad), dtype)
    assert additive.shape == (2, 1, 1, 7) and additive.dtype == dtype and additive.stride()[0] % 16 == 0
    assert additive[1, 0, 0].tolist() == [0.0] * 4 + [float("-inf")] * 3
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model=16, n_heads=2, d_k=8, d_v=8, p_drop_attn=0.0, self_attention=True).to(dtype)
    q, k, v = mha.project_qkv(torch.randn(2, 7, 16, dtype=dtype))
    plain, _ = mha.attend(q, k, v, key_mask(src_pad))
    fast, _ = mha.attend(q, k, v, additive)
    # each within its arithmetic's roundings of the exact attention (``attend_bound``, tests/rounding.py)
    bound = attend_bound(mha, q, k, v, key_mask(src_pad), "fp32" if dtype == torch.float32 else "bf16")
    within(fast, plain.double(), 2 * bound)
