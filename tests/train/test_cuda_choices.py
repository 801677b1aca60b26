"""The training step's choices for CUDA, proven where they can be on the CPU: TF32 and the attention
backends (process settings, set without a GPU), Adam's device-side skip (the update queued before
the step's numbers are read), DDP's options, and the fall back from a model that fails to compile.
Each leaves the CPU's training as it was, bit for bit."""
from __future__ import annotations

import json

import pytest
import torch

import aiayn
from aiayn.checkpoint import load_checkpoint
from aiayn.execution.attention import attention_backends
from aiayn.checkpoint.run import Learner
from aiayn.train import parallel, step, updates
from aiayn.train import runtime as rt
from aiayn.train.objective import make_optimizer
from tests.train.test_training import _logged, _train_in_process

CUDA = torch.device("cuda")


@pytest.fixture
def cuda_flags():
    """Puts the TF32 flags back as they were."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_tf32_is_a_cuda_setting_only(cuda_flags):
    """``train.tf32``: CUDA's float32 matmuls and convolutions in TF32; a CPU run changes nothing (and
    oneDNN's CPU matmul precision is never touched)."""
    cpu_precision = torch.backends.mkldnn.matmul.fp32_precision
    rt.use_tf32(CUDA, True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    rt.use_tf32(CUDA, False)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    rt.use_tf32(torch.device("cpu"), True)
    assert not torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.mkldnn.matmul.fp32_precision == cpu_precision


@pytest.mark.parametrize("capability,name,chosen", [((7, 5), "Tesla T4", "fp16"), ((7, 0), "Tesla V100-SXM2-16GB", "fp16"),
                                                     ((8, 0), "NVIDIA A100-SXM4-40GB", "bf16"),
                                                     ((9, 0), "NVIDIA H100 80GB HBM3", "bf16"),
                                                     ((6, 0), "Tesla P100-PCIE-16GB", "fp16"),
                                                     ((6, 1), "NVIDIA GeForce GTX 1080 Ti", "fp32"),
                                                     ((6, 1), "Tesla P40", "fp32"),
                                                     ((5, 3), "NVIDIA Tegra X1", "fp16"), ((6, 2), "NVIDIA Tegra X2", "fp16"),
                                                     ((5, 2), "Tesla M60", "fp32"),
                                                     ((3, 7), "Tesla K80", "fp32")])
def test_auto_precision_is_bf16_only_where_the_gpu_has_it_natively(monkeypatch, capability, name, chosen):
    """``train.precision=auto`` on CUDA: bf16 from compute capability 8.0 on, fp16 (with its loss scaler)
    before it where fp16 runs at least twice float32's rate (7.x; 5.3, 6.0, 6.2), fp32 elsewhere (6.1's
    fp16 runs at 1/64 of its fp32), whatever ``torch.cuda.is_bf16_supported`` answers (True on a T4, by
    emulation)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    precision, why = rt.resolve_precision("auto", CUDA)
    assert precision == chosen
    native = {"bf16": "native bf16", "fp16": "has no native bf16", "fp32": "has neither native bf16 nor fast fp16"}[chosen]
    assert why == f"auto: {name}, compute capability {capability[0]}.{capability[1]}, {native}"
    if capability == (7, 5):
        assert rt.describe_precision(precision, why) == \
            "precision: fp16 with loss scaling (auto: Tesla T4, compute capability 7.5, has no native bf16)"
    assert rt.resolve_precision("fp32", CUDA) == ("fp32", "train.precision=fp32")


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_on_the_cpu_is_bf16_only_where_native(monkeypatch, native):
    """On the CPU: bf16 where the CPU has native bf16 (``cpu_supports_bf16``), else fp32; fp16 is an
    error there."""
    monkeypatch.setattr(rt, "cpu_supports_bf16", lambda: native)
    assert rt.resolve_precision("auto", torch.device("cpu"))[0] == ("bf16" if native else "fp32")
    with pytest.raises(rt.UserError, match="fp16 needs CUDA"):
        rt.resolve_precision("fp16", torch.device("cpu"))


@pytest.mark.parametrize("x86, onednn, avx512_bf16, amx, limit, native", [
    (True, True, True, False, "", True),  # Zen 4, Zen 5, Cooper Lake
    (True, True, False, True, "", True),  # Sapphire Rapids on (AMX)
    (True, True, False, False, "", False),  # Skylake, Cascade Lake, Ice Lake: oneDNN says yes, by emulation
    (True, True, True, False, "AVX512_CORE", False),  # held to AVX-512 without bf16
    (True, True, True, False, "avx2", False),  # held to AVX2 (the name in any case)
    (True, True, True, False, "AVX512_CORE_BF16", True),
    (True, False, True, False, "", False),  # a PyTorch without oneDNN's bf16
    (False, True, False, False, "", True),  # Arm with the BF16 extension (oneDNN's answer)
    (False, False, False, False, "", False),
])
def test_native_bf16_on_the_cpu_is_the_instructions_not_onednns_emulation(monkeypatch, x86, onednn, avx512_bf16,
                                                                          amx, limit, native):
    """oneDNN answers True on every AVX-512 CPU, emulating bf16 where the CPU has no bf16 products:
    native bf16 on x86 is AVX512-BF16 or AMX, present and not held back by ``ONEDNN_MAX_CPU_ISA``."""
    monkeypatch.setattr(rt, "_is_x86", lambda: x86)
    monkeypatch.setattr(rt, "_onednn_has_bf16", lambda: onednn)
    from aiayn.host import isa

    flags = frozenset({"avx512f", "avx512_vnni"} | ({"avx512_bf16"} if avx512_bf16 else set())
                      | ({"amx_tile", "amx_bf16"} if amx else set()))
    monkeypatch.setattr(isa, "cpu_flags", lambda: flags)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
    assert rt.cpu_supports_bf16() is native


def test_training_logs_its_precision_and_why(caplog):
    """The precision chosen is logged at the start of training, with its reason."""
    with caplog.at_level("INFO", logger="aiayn.train.runtime"):
        place = rt.start(device="cpu", precision="auto", timeout_s=120.0, tf32=True, threads=0, seed=1)
        device, precision = place.device, place.precision
    line = rt.describe_precision(*rt.resolve_precision("auto", device))
    assert line.startswith(f"precision: {precision} (auto: ") and line in caplog.messages


def test_training_attention_leaves_out_cudnn_unless_asked():
    """``train.cudnn_attention`` false (the default): training's attention on CUDA as decoding's, no
    cuDNN (a plan per new batch shape); true leaves PyTorch's choice alone."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(CUDA, cudnn=False):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    with attention_backends(CUDA, cudnn=True):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


def _adam_after(flags: list[float | None]) -> tuple[torch.Tensor, dict]:
    """Parameters and Adam's state after one ``update`` per flag (None: no skip flag; "off": no step)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = make_optimizer(model.parameters(), 1e-2, (0.9, 0.98), 1e-9, fused=True)
    for i, flag in enumerate(flags):
        g = torch.Generator().manual_seed(i)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        if flag == "off":
            opt.zero_grad(set_to_none=True)
            continue
        skip = None if flag is None else torch.tensor(flag)
        updates.update(Learner(model, opt), 1.0, None, skip=skip)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt.state_dict()["state"]


def test_skip_flag_is_a_step_not_taken():
    """``update``'s ``skip``: 1 leaves the parameters, the moments and the step count as no step
    would; 0 is the plain step, bit for bit."""
    plain, plain_state = _adam_after([None, None, None])
    zero, zero_state = _adam_after([0.0, 0.0, 0.0])
    assert torch.equal(plain, zero)
    assert all(torch.equal(plain_state[0][k], zero_state[0][k]) for k in plain_state[0])
    skipped, skipped_state = _adam_after([None, 1.0, None])
    not_taken, not_taken_state = _adam_after([None, "off", None])
    assert torch.equal(skipped, not_taken)
    assert all(torch.equal(skipped_state[0][k], not_taken_state[0][k]) for k in not_taken_state[0])
    assert float(skipped_state[0]["step"]) == 2.0
    with pytest.raises(ValueError, match="fused"):
        model = torch.nn.Linear(2, 2)
        model.weight.grad = torch.zeros(2, 2)
        updates.update(Learner(model, make_optimizer(model.parameters(), 1e-2, (0.9, 0.98), 1e-9)), 0.0, None,
                    skip=torch.tensor(0.0))


def test_step_not_finite_flag():
    """``not_finite`` on the device takes ``TrainStep.step``'s test on the host: loss + KL, and the norm."""
    def flag(loss, kl, norm):
        return float(updates.not_finite(torch.tensor([loss, 1.0, kl, 0.0, 0.0, norm], dtype=torch.float64)))
    assert flag(3.0, 0.0, 2.0) == 0.0
    assert flag(float("nan"), 0.0, 2.0) == flag(3.0, float("inf"), 2.0) == flag(3.0, 0.0, float("inf")) == 1.0


def _weights(run) -> dict:
    return load_checkpoint(run / "last.pt")["model"]


def test_update_queued_before_the_read_trains_the_same(small_data_dir, tmp_path, monkeypatch):
    """With fused Adam the update is queued before the step's numbers are read: the same weights and
    logged losses, bit for bit, as the update after the read; a NaN step skipped the same way is
    tests/train/test_step_safety.py's."""
    _train_in_process(small_data_dir, tmp_path / "early", 4, "model.p_drop=0.1")
    monkeypatch.setattr(step, "update_early", lambda opt, scaler: False)
    _train_in_process(small_data_dir, tmp_path / "late", 4, "model.p_drop=0.1")
    assert _logged(tmp_path / "early") == _logged(tmp_path / "late")
    a, b = _weights(tmp_path / "early"), _weights(tmp_path / "late")
    assert all(torch.equal(a[k], b[k]) for k in a)


class _FailingCompile:
    """A stand-in for torch.compile whose model fails in forward, or in backward."""

    def __init__(self, when: str):
        self.when, self.calls = when, 0

    def __call__(self, net, **options):
        def compiled(*args, **kwargs):
            self.calls += 1
            if self.when == "forward":
                raise RuntimeError("backend failed in forward")
            out = net(*args, **kwargs)
            return _RaiseInBackward.apply(out) if isinstance(out, torch.Tensor) else out
        return compiled


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backend failed in backward")


@pytest.mark.parametrize("when", ["forward", "backward"])
def test_a_model_that_fails_to_compile_trains_as_the_plain_one(small_data_dir, tmp_path, monkeypatch, caplog, when):
    """``train.compile``: where compiling fails, at the first forward or backward, a warning says so and
    the run trains the plain model (with the C kernels again): the same weights as a run without
    compile, bit for bit."""
    _train_in_process(small_data_dir, tmp_path / "plain", 3, "model.p_drop=0.0", "train.fused_loss=off")
    failing = _FailingCompile(when)
    monkeypatch.setattr(torch, "compile", failing)
    with caplog.at_level("WARNING"):
        summary = _train_in_process(small_data_dir, tmp_path / "compiled", 3, "model.p_drop=0.0",
                                    "train.fused_loss=off", "train.compile=true")
    assert summary["steps"] == 3 and failing.calls == 1
    assert any("torch.compile failed" in r.getMessage() and when in r.getMessage() for r in caplog.records)
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "compiled")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "compiled" / "config.json").read_text())["train"]["compile"] is True


def test_data_parallel_options(tmp_path):
    """DDP with gradients as views of its buckets, without re-sending the buffers at every forward,
    and with a static graph where asked (not with accumulation: ``parallel.data_parallel``)."""
    import torch.distributed as tdist
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = aiayn.Transformer(aiayn.get_preset("tiny", vocab_size=30))
        ddp = parallel.data_parallel(model, static_graph=True)
        assert ddp.gradient_as_bucket_view and ddp.static_graph
        assert not getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True))
        assert not parallel.data_parallel(model, static_graph=False).static_graph
    finally:
        tdist.destroy_process_group()


def test_compiled_model_compiles_one_graph_per_padding_case_over_bucket_shapes():
    """``train.compile`` (``compile_model``) on length-bucketed batches: new (B, S, T) shapes reuse
    the graph; only a batch with a source mask and one without give two graphs. Dropout as on CUDA
    (the model's own, without ``train.fast_dropout``'s CPU draw, which is not traced). A counting backend stands in
    for inductor: what is counted is dynamo's graphs, as on a GPU."""
    from aiayn.model import ModelConfig
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, d_model=32, n_heads=4, d_k=8, d_v=8, d_ff=64, n_layers=2)
    assert _graphs_over_bucket_shapes(aiayn.Transformer(cfg), cfg, 16) == 2


def _graphs_over_bucket_shapes(model, cfg, batches: int, bf16: bool = False) -> int:
    """The graphs dynamo compiles for ``model`` (``compile_model``; a counting backend stands in for
    inductor) over ``batches`` forward and backward passes of length-bucketed (B, S, T) shapes, two
    in three with a padded source, under bf16 autocast with ``bf16``."""
    import random
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    net = parallel.compile_model(model, backend=backend)
    rng = random.Random(0)
    for i in range(batches):
        B, S, T = rng.choice([(40, 10, 10), (33, 12, 14), (20, 20, 19), (25, 16, 16), (18, 23, 26), (50, 8, 9)])
        src, tgt = torch.randint(4, 300, (B, S)), torch.randint(4, 300, (B, T))
        if padded := i % 3 > 0:
            src[0, -2:] = cfg.pad_id
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = net(src, tgt, src_padded=padded)
        out.float().sum().backward()
    return len(graphs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_training_model_keeps_its_graphs_over_bucket_shapes_on_the_cpu(dtype):
    """The training step's compiled net on the CPU (``compiled`` of the run's execution, as
    ``TrainStep`` applies it, fast dropout and row padding on in the run's settings) over bucketed
    shapes under its autocast: one graph per padding case and no graph break. The fast dropout's
    integer draw broke the graph at every dropout, and each padded row count was a guard on the
    shape, so bf16 compiled nearly every batch anew."""
    from aiayn.execution import apply, compiled, training
    from aiayn.model import ModelConfig
    from aiayn.train.config import TrainConfig
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, d_model=32, n_heads=4, d_k=8, d_v=8, d_ff=64, n_layers=2)
    t = TrainConfig(fast_dropout=True, cpu_row_bits=3)
    assert t.fast_dropout and t.cpu_row_bits == 3
    model = apply(aiayn.Transformer(cfg).train(), compiled(training(t, torch.device("cpu"), None)))
    assert _graphs_over_bucket_shapes(model, cfg, 12, bf16=dtype == torch.bfloat16) == 2
