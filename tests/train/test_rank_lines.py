"""Under torchrun (2 processes, gloo on the CPU) a line every rank would write alike, warning or info,
comes once, from the main rank; a line about one rank's own state names its rank and comes from it;
``-v`` lets every rank log (docs/training.md, "What a run shows")."""
from __future__ import annotations

import logging
import os
import subprocess

import pytest

from aiayn.train import runtime as rt
from tests.train.test_training import _torchrun_cmd

NO_DROPOUT = ["--set", "model.p_drop=0.0", "--set", "model.p_drop_attn=0.0", "--set", "model.p_drop_ffn=0.0"]
RDROP = "train.rdrop_alpha without dropout"
KERNELS = "kernel cache refused"
DAMAGED = "resuming from"  # (stdout's "resuming from RUN/... at step" is not in stderr)
RESEGMENTED = "epoch 0 is cut on another segmentation than the checkpoint's ("


def _torchrun(data, out, steps: int, extra: list[str], env: dict, ok: bool = True, verbose: bool = False) -> str:
    """The run's stderr, both ranks' (and the launcher's); it succeeded, or failed where ``ok`` is False."""
    cmd = _torchrun_cmd(data, out, steps, extra)
    if verbose:
        at = cmd.index("aiayn.cli") + 1
        cmd[at:at] = ["-v"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert (res.returncode == 0) == ok, res.stderr[-3000:]
    return res.stderr


@pytest.mark.slow
def test_alike_warnings_of_a_run_and_its_resume_come_once(small_data_dir, tmp_path):
    """R-Drop without dropout and the C kernels' fallback (a kernel cache that is a symbolic link) in a
    run of 4 steps; resumed to 6 with last.pt damaged and epoch 0's BPE-dropout segmentation gone (drawn
    again, with a higher dropout): the fallback to the step checkpoint and the re-cut epoch too. Each
    line once."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "cache")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AIAYN_CACHE_DIR": str(tmp_path / "link")}
    run = tmp_path / "run"
    extra = [*NO_DROPOUT, "--set", "train.rdrop_alpha=1", "--set", "train.bpe_dropout=0.1",
             "--set", "train.save_every_steps=2"]
    first = _torchrun(small_data_dir, run, 4, extra, env)
    assert (first.count(RDROP), first.count(KERNELS), first.count(" model: ")) == (1, 1, 1), first[-3000:]
    (run / "last.pt").write_bytes(b"not a checkpoint")
    (run / "bpe_dropout" / "epoch00000.npz").unlink()
    more = [*extra, "--set", "train.bpe_dropout=0.5"]  # many more pieces: the epoch cut into more batches
    resumed = _torchrun(small_data_dir, run, 6, more, env)
    counts = [resumed.count(s) for s in (RDROP, KERNELS, DAMAGED, RESEGMENTED)]
    assert counts == [1, 1, 1, 1], resumed[-3000:]
    assert "ckpt_step00000004.pt (step 4) instead" in resumed
    assert "epoch00000.npz was not in the run directory: sampled again, SHA-256" in resumed


@pytest.mark.slow
def test_a_non_finite_step_under_ddp_is_said_once_and_by_every_rank_with_v(small_data_dir, tmp_path):
    """A rate that blows the weights up after step 1: under DDP every rank skips the same all-reduced
    step, said once; ``-v`` shows the other rank's line too."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sets = ["--set", "train.lr_scale=1e30", "--set", "train.max_bad_steps=2"]
    said = "step 2: non-finite loss or gradient"
    quiet = _torchrun(small_data_dir, tmp_path / "quiet", 3, sets, env, ok=False)
    assert quiet.count(said) == 2 and quiet.count("(1 in a row)") == 1, quiet[-3000:]  # 1 and 2 in a row
    loud = _torchrun(small_data_dir, tmp_path / "loud", 3, sets, env, ok=False, verbose=True)
    assert loud.count("(1 in a row)") == 2 and loud.count(" model: ") == 2, loud[-3000:]


@pytest.mark.slow
def test_a_non_finite_step_under_local_sgd_is_said_by_its_rank(small_data_dir, tmp_path):
    """Local SGD: each rank's copy skips its own non-finite steps (counted as steps), and says so with
    its rank; the main rank's other lines once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sets = ["--set", "train.lr_scale=1e30", "--set", "train.max_bad_steps=10", "--set", "train.local_sgd_period=2"]
    err = _torchrun(small_data_dir, tmp_path / "run", 3, sets, env)
    for rank in (0, 1):
        assert err.count(f"rank {rank} of 2: step 2: non-finite loss or gradient") == 1, err[-3000:]
    assert err.count(" model: ") == 1, err[-3000:]


def test_the_other_ranks_write_errors_and_their_own_lines():
    """``MainRankLines``: an error and an ``OwnState`` line of any level pass; a warning or an info line
    that every rank would write alike does not. ``OwnState`` names the rank in a distributed run only."""
    lines = rt.MainRankLines()

    def record(level: int, **extra) -> logging.LogRecord:
        r = logging.LogRecord("aiayn.x", level, __file__, 1, "m", (), None)
        r.__dict__.update(extra)
        return r

    assert [lines.filter(record(level)) for level in (logging.INFO, logging.WARNING, logging.ERROR)] == \
        [False, False, True]
    assert lines.filter(record(logging.INFO, **{rt.OWN_STATE: 1}))
    # the first process of another machine: its warnings too (its CPU's kernels, its torch.compile)
    node_first = rt.MainRankLines(node_first=True)
    assert [node_first.filter(record(level)) for level in (logging.INFO, logging.WARNING, logging.ERROR)] == \
        [False, True, True]
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, r: logging.LogRecord) -> None:
            seen.append(r)

    logger = logging.getLogger("aiayn.test_rank_lines")
    logger.addHandler(Keep())
    logger.propagate = False
    for dist in (rt.Dist(1, 2), rt.Dist()):
        rt.OwnState(logger, dist).warning("step %d: skipped", 2)
    assert [r.getMessage() for r in seen] == ["rank 1 of 2: step 2: skipped", "step 2: skipped"]
    assert all(lines.filter(r) for r in seen)
