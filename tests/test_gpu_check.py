"""bench/gpu_check.sh's memory stage, at tiny size on the CPU (its cpu-smoke mode): the script runs
bench/gpu_memory.py and records aiayn estimate's peak for the batch it trains."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from aiayn.model.config import get_preset
from aiayn.train.config import TrainConfig
from aiayn.cost.memory import peak_memory

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_memory_stage_records_the_estimate_beside_the_run(tmp_path):
    env = os.environ | {"RESULTS": str(tmp_path / "results"), "WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "cpu-smoke", "memory"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    case, = json.loads((tmp_path / "results" / "gpu_memory.json").read_text())["cases"]
    B, S, T = case["batch"]
    expected = peak_memory(get_preset("tiny", vocab_size=500), TrainConfig(fused_loss="off"), B * S, B * T, "bf16")
    assert case["estimate"] == vars(expected) | {"total": expected.total}
    assert "max_memory_allocated" not in case  # no CUDA here: nothing read
