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


def _gpu_check(tmp_path, *args, **env) -> subprocess.CompletedProcess:
    env = os.environ | {"RESULTS": str(tmp_path / "results"), "WORK": str(tmp_path / "work")} | env
    return subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_env_stage_fails_on_a_missing_package_after_an_optional_one(tmp_path):
    """The env stage names every package missing and fails where the demo's are: triton missing first
    does not end the check with a pass before sacremoses is looked at."""
    fake = tmp_path / "fake"
    fake.mkdir()
    for name in ("triton", "sacremoses"):
        (fake / f"{name}.py").write_text(f"raise ImportError('no {name} here')\n")
    done = _gpu_check(tmp_path, "cpu-smoke", "env", PYTHONPATH=str(fake))
    assert done.returncode == 1, done.stdout[-2000:]
    assert "triton MISSING" in done.stdout and "sacremoses MISSING" in done.stdout
    assert "sentencepiece " in done.stdout and "FAILED: stage env" in done.stdout


def _wheel(folder, name: str) -> None:
    """A pure-Python wheel of one module ``name`` (version 1.0)."""
    import zipfile
    info = f"{name}-1.0.dist-info"
    files = {f"{name}/__init__.py": "__version__ = '1.0'\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def test_pack_wheels_go_in_one_by_one(tmp_path):
    """A wheel of the pack this Python cannot take (CTranslate2's for another Python) is named, and the
    pack's other wheels are installed all the same."""
    wheels = tmp_path / "pack" / "wheels"
    wheels.mkdir(parents=True)
    _wheel(wheels, "aiayn_probe")
    (wheels / "ctranslate2-4.8.5-cp27-cp27m-win32.whl").write_bytes(b"")
    done = _gpu_check(tmp_path, "env", PACK=str(tmp_path / "pack"))
    assert (tmp_path / "work" / "site" / "aiayn_probe" / "__init__.py").exists(), done.stdout[-2000:]
    assert "gpu_pack: ctranslate2-4.8.5-cp27-cp27m-win32.whl not installed" in done.stdout


def test_without_a_stage_the_script_prints_its_whole_header(tmp_path):
    done = _gpu_check(tmp_path)
    assert done.returncode == 2
    assert "#   demo       `aiayn demo --minutes M`" in done.stdout  # the last stage ...
    assert done.stdout.rstrip().endswith("there is one, else python3).")  # ... and the paragraph after it
