"""torch.compile's on-disk cache and ``ATEN_CPU_CAPABILITY`` (``parallel.inductor_cache_per_capability``):
inductor does not key its cached graphs on the setting, so a run held to AVX2 after one that was not
loaded graphs made for AVX-512 and computed NaN. aiayn gives each held setting a cache of its own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn.train.parallel import inductor_cache_per_capability

REPO = Path(__file__).resolve().parents[2]

COMPILED_FORWARD = """
import torch
from aiayn.model.config import ModelConfig
from aiayn.model.transformer import Transformer
from aiayn.train.parallel import compile_model
torch.manual_seed(0)
model = Transformer(ModelConfig(vocab_size=500, n_layers=2, d_model=32, d_ff=64, n_heads=4, d_k=8, d_v=8, p_drop=0.0))
src, tgt = torch.randint(4, 500, (3, 7)), torch.randint(4, 500, (3, 5))
with torch.no_grad():
    cached = compile_model(model)(src, tgt)  # through inductor's on-disk cache (the one aiayn chooses)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        fresh = compile_model(model)(src, tgt)  # compiled anew for this process's setting, no cache read
print(bool(cached.isfinite().all()), bool(torch.equal(cached, fresh)))
"""


def test_a_held_capability_gets_a_cache_of_its_own(tmp_path):
    env = {"ATEN_CPU_CAPABILITY": "AVX2"}
    inductor_cache_per_capability(env)
    assert env["TORCHINDUCTOR_CACHE_DIR"].endswith("_avx2")
    chosen = {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    inductor_cache_per_capability(chosen)
    assert chosen["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)  # the user's choice stands
    native = {}
    inductor_cache_per_capability(native)
    assert native == {}  # no setting: inductor's own place


def test_compiling_in_a_held_process_takes_its_cache(tmp_path):
    """``compile_model`` chooses the cache before it loads torch._dynamo, whose import sets
    ``TORCHINDUCTOR_CACHE_DIR`` to inductor's default (and the held setting's own was then skipped)."""
    code = ("import os, torch; from aiayn.train.parallel import compile_model; "
            "compile_model(torch.nn.Linear(2, 2), backend='eager'); print(os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "ATEN_CPU_CAPABILITY": "avx2", "TMPDIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("_avx2"), out.stdout


@pytest.mark.slow
def test_compiled_model_held_to_avx2_after_a_native_run_computes_what_a_fresh_compile_does(tmp_path):
    """Two processes with inductor's default cache (under the same TMPDIR): the first compiles the
    model natively, the second held to AVX2. In each, the model compiled through the cache computes
    what it compiled anew with every cache off computes, bit for bit (the same generated code for the
    process's setting, the same operations in the same order); from the shared cache the second loaded
    the first's graphs and computed NaN."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=str(REPO / "src"))
    for held in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        out = subprocess.run([sys.executable, "-c", COMPILED_FORWARD], env={**env, **held}, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["True", "True"], (held, out.stdout)
