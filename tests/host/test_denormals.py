"""Flushing denormals reaches every thread and does not change what is computed."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aiayn.host import denormals
from aiayn.errors import UserError

# Mimics the CLI's start-up order (aiayn.cli.main): the setting, then the command modules are
# imported and the thread count set, then 2 threads multiply denormal inputs by 1. The inputs
# are made from their bits: a Python float converted on a flushing thread would already be 0.
_THREADS = """
import sys, torch
from aiayn import cli
from aiayn.host import denormals
import os
os.environ[denormals.ENV] = sys.argv[1]
print(int(denormals.configure_from_env()), end=" ")
cli.build_parser()
torch.set_num_threads(2)
x = torch.full((4_000_000,), 1 << 20, dtype=torch.int32).view(torch.float32)  # bits of a denormal (1.5e-38)
y = x * 1.0  # two threads, one half each
print(int((y != 0).sum()))
"""


def _run(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="x86 MXCSR on Linux")
def test_flush_reaches_the_worker_threads():
    assert _run(_THREADS, "keep") == "0 4000000"  # IEEE: a denormal times 1 is itself
    on, nonzero = _run(_THREADS, "flush").split()
    if on == "1":  # the CPU supports it (every x86-64 with SSE3)
        assert nonzero == "0"  # both threads flush, not only the calling one


def test_setting_too_late_misses_the_pool():
    """Why the CLI sets it first: once the thread pool exists, only the calling thread changes."""
    code = """
import torch
torch.set_num_threads(2)
(torch.ones(4_000_000) * 1.0).sum()  # the pool now exists
ok = torch.set_flush_denormal(True)
x = torch.full((4_000_000,), 1 << 20, dtype=torch.int32).view(torch.float32)
y = x * 1.0
print(int(ok), int((y != 0).sum()))
"""
    ok, nonzero = _run(code).split()
    if ok == "1":
        assert 0 < int(nonzero) < 4_000_000  # one half flushed, the worker's half not


# log_softmax and beam search of a model whose logits are spread far enough to underflow exp,
# printed exactly, with and without flushing.
_SAME = """
import json, os, sys, torch
from aiayn.host import denormals
os.environ[denormals.ENV] = sys.argv[1]
denormals.configure_from_env()
torch.set_num_threads(2)
from aiayn.decode.adapter import CachedDecoder
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import search
from aiayn.model import ModelConfig, Transformer
torch.manual_seed(0)
z = torch.randn(64, 4000, dtype=torch.float64).float() * 80  # spread ~ 600 > 87
ls = z.log_softmax(-1)
cfg = ModelConfig(vocab_size=300, d_model=32, d_ff=64, n_heads=2, d_k=16, d_v=16, n_layers=2, p_drop=0.0)
model = Transformer(cfg).eval()
with torch.no_grad():
    for p in model.parameters():
        p.mul_(6.0)  # peaky logits: exp underflows for most of the vocabulary
src = torch.randint(4, 300, (6, 9))
hyps = search(CachedDecoder(model), src, DecodeConfig(beam_size=4, nbest=2, max_len_a=1.0, max_len_b=5))
with torch.no_grad():
    logits = model(src, src[:, :5])  # (B, 5, V)
spread = float((logits.max(-1).values - logits.min(-1).values).min())
tiny = int(((z - z.max(-1, keepdim=True).values).exp() == 0).sum())
print(json.dumps({"ls": ls.flatten().tolist()[::97], "ls_sum": float(ls.double().sum()),
                  "hyps": [[(h.tokens, h.score) for h in hs] for hs in hyps], "zero_exp": tiny, "spread": spread}))
"""


def test_flush_changes_no_result():
    keep, flush = (json.loads(_run(_SAME, mode)) for mode in ("keep", "flush"))
    assert keep["zero_exp"] > 0 and keep["spread"] > 87.4  # exp underflows in both parts
    assert flush["ls"] == keep["ls"] and flush["ls_sum"] == keep["ls_sum"]
    assert flush["hyps"] == keep["hyps"]


def test_env_choice(monkeypatch):
    monkeypatch.setenv(denormals.ENV, "keep")
    assert denormals.configure_from_env() is False
    monkeypatch.setenv(denormals.ENV, "sometimes")
    with pytest.raises(UserError, match="AIAYN_DENORMALS"):
        denormals.configure_from_env()
