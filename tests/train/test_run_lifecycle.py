"""A run directory over a training's life: a refused start leaves it as it was (rundir.Claim), a bad
AIAYN_KERNELS_MARCH is refused before the data is read, and summary.json's ``epochs`` counts the
epochs trained."""
from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.data.batching import TokenBatchSampler, TokenBounds
from aiayn.data.dataset import DataDir
from aiayn.errors import UserError
from aiayn.train import loop, rundir
from tests.train.test_training import FAST, _train_in_process


def _train(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--no-progress", *FAST, "--max-steps", "2", *extra]


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None: a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def test_a_refused_init_from_leaves_no_folder_lock_or_config(small_data_dir, untrained_checkpoint, tmp_path,
                                                            capsys):
    """Another tokenizer than the checkpoint's: the folders --out named, train.lock and config.json are
    not left behind; nor is anything in a folder that was there, empty."""
    out = tmp_path / "runs" / "tuned"
    assert main(_train(small_data_dir, out, "--preset", "tiny", "--init-from", str(untrained_checkpoint))) == 2
    assert "source tokenizer" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    other_shape = ["--preset", "tiny", "--set", "model.d_ff=64", "--init-from", str(untrained_checkpoint)]
    (tmp_path / "empty").mkdir()
    assert main(_train(untrained_checkpoint.parent / "data", tmp_path / "empty", *other_shape)) == 2
    assert "d_ff" in capsys.readouterr().err
    assert list((tmp_path / "empty").iterdir()) == []


def test_a_refused_resume_leaves_the_run_directory_as_it_was(small_data_dir, tiny_checkpoint, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_checkpoint.parent, run)
    (run / rundir.LOCK_NAME).write_text("12345\n")  # the pid of the run's last training, another process
    before = _tree(run)
    assert main(_train(small_data_dir, run, "--preset", "tiny", "--set", "model.d_ff=64")) == 2
    assert "the run was trained with another model" in capsys.readouterr().err
    assert _tree(run) == before


def test_a_start_refused_after_its_outputs_are_open_removes_them(small_data_dir, tmp_path, monkeypatch, capsys):
    """A refusal once config.json, train_log.jsonl and tensorboard/ are made (the last check of a
    start): they go, with train.lock and the folder; in a run directory that had its own, those stay."""
    made = loop.Monitor

    def refused(*args, **kwargs):
        made(*args, **kwargs).end()  # (its outputs made, and closed)
        raise UserError("refused at the last check")
    monkeypatch.setattr(loop, "Monitor", refused)
    out = tmp_path / "run"
    assert main(_train(small_data_dir, out, "--preset", "tiny")) == 2
    assert "refused at the last check" in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()
    for name in ("config.json", "train_log.jsonl", rundir.LOCK_NAME):
        (out / name).write_text(f"an earlier {name}\n")
    assert main(_train(small_data_dir, out, "--preset", "tiny")) == 2
    assert sorted(p.name for p in out.iterdir()) == ["config.json", rundir.LOCK_NAME, "train_log.jsonl"]


TERMINATED_AT_START = """
import sys, time
import aiayn.train.loop as loop
from aiayn import cli
payload = loop.tokenizer_payload

def slow(data):  # the main rank's start, slower than another rank's refusal of the same run
    open(sys.argv[3], "w").close()
    time.sleep(120)
    return payload(data)

loop.tokenizer_payload = slow
sys.exit(cli.main(["train", "--data", sys.argv[1], "--out", sys.argv[2], "--preset", "tiny", "--max-steps", "1",
                   "--no-progress", "--set", "train.threads=1"]))
"""


def test_a_start_terminated_before_its_first_step_leaves_the_run_directory_as_it_was(untrained_checkpoint, tmp_path):
    """torchrun ends the main rank with SIGTERM as soon as another rank has refused a start (another
    rank's tokenizer, its files) and ended first: the main rank's claim is undone all the same, and it
    ends by that SIGTERM, as it would have without a claim to undo."""
    import signal
    import subprocess
    import sys
    import time
    out, started = tmp_path / "runs" / "new", tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", TERMINATED_AT_START, str(untrained_checkpoint.parent / "data"),
                             str(out), str(started)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (out / rundir.LOCK_NAME).exists()  # claimed
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["started"]


def test_a_lock_file_removed_between_its_open_and_its_lock_is_not_the_lock(tmp_path, monkeypatch):
    """A training that opened train.lock just before a refused start removed it must lock the file
    then at the path, not the removed one (or a third training could lock a new file beside it)."""
    path = tmp_path / rundir.LOCK_NAME
    real_open = rundir._open_lock
    opened = []

    def removed_after_open(p):
        fd, made = real_open(p)
        if not opened:
            p.unlink()  # the refused start's removal, between this open and the lock
        opened.append(fd)
        return fd, made
    monkeypatch.setattr(rundir, "_open_lock", removed_after_open)
    with rundir.RunLock(tmp_path) as lock:
        assert len(opened) == 2 and lock.created
        assert os.stat(path).st_ino == os.fstat(opened[1]).st_ino
    with rundir.RunLock(tmp_path) as lock:  # a training's own lock file stays for the next one
        assert not lock.created


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="needs a C compiler")
@pytest.mark.parametrize("march, said", [
    ("bogus", "AIAYN_KERNELS_MARCH=bogus: the compiler refuses it ("),
    ("x86 64", "AIAYN_KERNELS_MARCH='x86 64': not a compiler target name"),
])
def test_a_bad_kernels_target_is_refused_before_the_data_is_read(march, said, small_data_dir, tmp_path, monkeypatch,
                                                                 capsys):
    def read(*args):
        raise AssertionError("the data directory was read")
    monkeypatch.setattr(loop, "DataDir", read)
    monkeypatch.setenv("AIAYN_KERNELS_MARCH", march)
    assert main(_train(small_data_dir, tmp_path / "run", "--preset", "tiny")) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="needs a C compiler")
def test_the_kernels_targets_a_compiler_knows_pass_the_early_check(monkeypatch):
    from aiayn.kernels.loader import check_target
    for march in ("", "native", *(("x86-64",) if platform.machine() in ("x86_64", "AMD64") else ())):
        monkeypatch.setenv("AIAYN_KERNELS_MARCH", march)
        check_target()


def test_summary_epochs_count_the_epochs_trained(small_data_dir, tmp_path, capsys):
    """A quarter of the first epoch, all of it, then a quarter of the second, resumed each time:
    ``epochs`` is the epochs completed plus the share of the current one's batches (not the epoch's
    index, 0 until the second epoch's first step)."""
    train = DataDir(small_data_dir).split("train")
    per_epoch = len(TokenBatchSampler(train.src_lens + 1, train.tgt_lens + 1, TokenBounds(4000, 4000), shuffle=True))
    assert per_epoch % 4 == 0  # (the shares below are exact)
    big = ("train.max_src_tokens=4000", "train.max_tgt_tokens=4000")
    run = tmp_path / "run"
    for steps, epochs in ((per_epoch // 4, 0.25), (per_epoch, 1.0), (per_epoch + per_epoch // 4, 1.25)):
        s = _train_in_process(small_data_dir, run, steps, *big)
        assert (s["steps"], s["epochs"]) == (steps, epochs)
        assert f"trained {steps} steps ({epochs:.2f} epochs, " in capsys.readouterr().out
    assert json.loads((run / "summary.json").read_text())["epochs"] == 1.25


def test_a_finished_run_trained_on_and_stopped_leaves_no_summary_of_its_earlier_end(small_data_dir, tmp_path,
                                                                                   monkeypatch):
    """summary.json describes the run's end; a run that trains on past it and is stopped (Ctrl-C here,
    after its checkpoint of step 4) has no summary until it ends, rather than the earlier one."""
    run = tmp_path / "run"
    assert _train_in_process(small_data_dir, run, 2)["steps"] == 2
    save = loop._Run.save

    def stopped(self, valid, step_file=True):
        save(self, valid, step_file)
        if self.state.step == 4:
            raise KeyboardInterrupt
    monkeypatch.setattr(loop._Run, "save", stopped)
    argv = ["train", "--data", str(small_data_dir), "--out", str(run), "--preset", "tiny", "--no-progress", *FAST,
            "--max-steps", "6", "--set", "train.save_every_steps=2"]
    assert main(argv) == 130
    assert not (run / "summary.json").exists()
    monkeypatch.setattr(loop._Run, "save", save)
    assert main(argv) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
