"""scripts/setup.sh beside a torch the user installed (``AIAYN_TORCH=skip``, docs/gpu.md): pip, run
by the script itself with ``AIAYN_DRY_RUN``, plans no other torch, no triton and no test tools."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "scripts" / "setup.sh"


def plant_distribution(venv: Path, name: str, version: str) -> None:
    """A stand-in for an installed distribution: the dist-info pip reads (METADATA, INSTALLER, RECORD)."""
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    info = Path(purelib) / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/INSTALLER,,\n{info.name}/RECORD,,\n")


def setup_env(venv: Path, **settings: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIAYN_") and k != "VIRTUAL_ENV"}
    return env | {"AIAYN_VENV": str(venv), "PYTHON": sys.executable} | settings


@pytest.mark.slow
def test_skip_keeps_the_venvs_torch_and_installs_no_test_tools(tmp_path):
    venv, plan = tmp_path / "venv", tmp_path / "plan"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)  # no system site-packages
    plant_distribution(venv, "torch", "2.11.0")  # "your CUDA build", of a version the CPU pin is not
    done = subprocess.run(["bash", str(SETUP)], env=setup_env(venv, AIAYN_TORCH="skip", AIAYN_DRY_RUN=str(plan)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (plan / "torch.json").exists()  # no torch install of its own
    planned = {item["metadata"]["name"].lower() for item in json.loads((plan / "aiayn.json").read_text())["install"]}
    assert "aiayn" in planned and "fastapi" in planned  # the default extras of an install to use
    assert planned.isdisjoint({"torch", "triton", "pytest", "playwright"}), sorted(planned)
    # planning installed nothing: the planted torch is still the venv's only torch
    pip_list = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                              check=True, capture_output=True, text=True).stdout
    assert {p["name"]: p["version"] for p in json.loads(pip_list)}.get("torch") == "2.11.0"


def test_an_unknown_torch_choice_is_an_error(tmp_path):
    done = subprocess.run(["bash", str(SETUP)], env=setup_env(tmp_path / "venv", AIAYN_TORCH="cuda"),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "AIAYN_TORCH must be cpu or skip, got 'cuda'" in done.stderr
    assert not (tmp_path / "venv").exists()
