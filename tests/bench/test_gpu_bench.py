"""The GPU benchmarks (bench/gpu_train.py, gpu_translate.py, gpu_memory.py) on the CPU at tiny size: a
system, a profile or a case that fails leaves the other measurements taken and written."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_memory  # noqa: E402
import gpu_train  # noqa: E402

CPU = torch.device("cpu")


def _fails_at_call(n: int):
    """A system whose n-th call (from 1) raises, as an out-of-memory error would."""
    calls = []

    def step(*args):
        calls.append(args)
        if len(calls) == n:
            raise RuntimeError("CUDA out of memory (a stand-in)")
    return step


def test_a_system_failing_in_a_timed_round_leaves_the_others_measured():
    cfg = gpu_train.model_config("tiny", 100)
    batches = gpu_train.synthetic_batches(cfg, 2, 5, 5, CPU)
    steps = {"first": lambda k: None, "bad": _fails_at_call(3), "last": lambda k: None}
    failed = {}
    res = gpu_train.measure(steps, batches, cfg, CPU, n_steps=2, rounds=3, warmup=0, failed=failed)
    assert set(res) == {"first", "last"}
    assert all(len(r["rounds_s"]) == 3 for r in res.values())
    assert failed["bad"].startswith("round 1: RuntimeError: CUDA out of memory")
    assert "bad" not in steps  # dropped, its model freed


def test_timed_rounds_without_a_failed_dict_raises():
    with pytest.raises(RuntimeError):
        gpu_train.timed_rounds({"bad": _fails_at_call(1)}, 2, CPU)


def _run_main(module, monkeypatch, tmp_path, *argv) -> int:
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    return module.main()


def test_a_failed_profile_still_measures_and_writes_the_cases(monkeypatch, tmp_path):
    def profiler_fails(*args):
        raise RuntimeError("CUPTI could not be loaded")
    monkeypatch.setattr(gpu_train, "profile_aiayn", profiler_fails)
    rc = _run_main(gpu_train, monkeypatch, tmp_path, "--sizes", "tiny", "--precisions", "bf16", "--vocab", "100",
                   "--batch", "2", "--len", "6", "--steps", "1", "--rounds", "1", "--warmup", "1",
                   "--systems", "aiayn", "--profile", "--device", "cpu")
    assert rc == 1  # the stage says FAILED ...
    written = json.loads((tmp_path / "gpu_train.json").read_text())
    assert "CUPTI" in written["profile_failed"]
    case, = written["cases"]  # ... and keeps what it measured
    assert case["systems"]["aiayn"]["tgt_tok_s"] > 0


def test_a_memory_case_that_fails_leaves_the_next_measured(monkeypatch, tmp_path):
    build = gpu_memory.build_aiayn
    calls = []

    def first_fails(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")
        return build(*args, **kwargs)
    monkeypatch.setattr(gpu_memory, "build_aiayn", first_fails)
    rc = _run_main(gpu_memory, monkeypatch, tmp_path, "--sizes", "tiny", "--tokens", "60,30", "--len", "6",
                   "--vocab", "100", "--steps", "1", "--device", "cpu")
    assert rc == 1
    first, second = json.loads((tmp_path / "gpu_memory.json").read_text())["cases"]
    assert first["failed"] == "RuntimeError: CUBLAS_STATUS_ALLOC_FAILED"
    assert "failed" not in second and second["tokens"] == 30


def test_beam_search_race_checks_every_system_generated_the_same_tokens(monkeypatch, tmp_path):
    """bench/gpu_translate.py: aiayn and HF ``generate`` each generate batch x --out-len tokens (counted,
    HF's padding not counted); a system that generates fewer is marked, and the run exits nonzero."""
    import gpu_translate
    argv = ("--sizes", "tiny", "--vocab", "100", "--batch", "2", "--src-len", "5", "--out-len", "4",
            "--rounds", "1", "--device", "cpu", "--systems", "aiayn-fp32,hf-fp32")
    assert _run_main(gpu_translate, monkeypatch, tmp_path, *argv) == 0
    case, = json.loads((tmp_path / "gpu_translate.json").read_text())["cases"]
    assert {k: (r["tokens_generated"], r["same_work"]) for k, r in case["systems"].items()} == \
        {"aiayn-fp32": (8, True), "hf-fp32": (8, True)}

    monkeypatch.setattr(gpu_translate, "aiayn_system", lambda *args, **kwargs: lambda: 5)  # stops early
    assert _run_main(gpu_translate, monkeypatch, tmp_path, *argv) == 1
    case, = json.loads((tmp_path / "gpu_translate.json").read_text())["cases"]
    assert not case["systems"]["aiayn-fp32"]["same_work"] and case["systems"]["hf-fp32"]["same_work"]


def test_a_compile_that_falls_back_to_the_plain_model_is_not_reported_as_compiled(monkeypatch, tmp_path):
    """``train.compile`` that fails trains the plain model (a warning); aiayn-compile's numbers would be
    plain aiayn's, so the system is reported failed instead."""
    def failing_compile(net, **options):
        def compiled(*args, **kwargs):
            raise RuntimeError("backend failed in forward")
        return compiled
    monkeypatch.setattr(torch, "compile", failing_compile)
    rc = _run_main(gpu_train, monkeypatch, tmp_path, "--sizes", "tiny", "--precisions", "bf16", "--vocab", "100",
                   "--batch", "2", "--len", "6", "--steps", "1", "--rounds", "1", "--warmup", "1",
                   "--systems", "aiayn,aiayn-compile", "--device", "cpu")
    assert rc == 1
    case, = json.loads((tmp_path / "gpu_train.json").read_text())["cases"]
    assert set(case["systems"]) == {"aiayn"}
    assert "torch.compile failed in the warm-up" in case["failed"]["aiayn-compile"]
