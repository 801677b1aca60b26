"""How a training's processes are started (torchrun's environment, docs/training.md "Data parallel"):
an environment torchrun would not give is refused in one line before anything is written; a rank
whose others never come stops within train.dist_timeout_s in one line; more processes than the
machine's GPUs, or than its cores, are said."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from aiayn.cli import main
from aiayn.errors import UserError
from aiayn.train import runtime as rt
from tests.train.test_training import _free_port

LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def launch_env(monkeypatch):
    """Set torchrun's variables (None: unset), the others unset."""
    for name in LAUNCH:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
    return set_env


@pytest.mark.parametrize("env, said", [
    ({"RANK": "1"}, "RANK=1 is set without WORLD_SIZE"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set without RANK"),
    ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two': not a whole number"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 is negative"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "29500"}, "MASTER_ADDR is not set"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not set"),
], ids=["rank-alone", "no-rank", "not-a-number", "rank-too-high", "local-rank", "no-addr", "no-port"])
def test_an_environment_torchrun_would_not_give_is_refused(launch_env, env, said):
    launch_env(**env)
    with pytest.raises(UserError, match=said) as exc:
        rt.init_distributed("cpu", timeout_s=5)
    assert "torchrun" in str(exc.value) and "\n" not in str(exc.value)


def test_one_process_without_torchrun_or_with_rank_0(launch_env):
    assert rt.init_distributed("cpu") == rt.Dist()
    launch_env(RANK="0", LOCAL_RANK="0")
    assert rt.init_distributed("cpu") == rt.Dist()
    launch_env(RANK="0", WORLD_SIZE="1")
    assert rt.init_distributed("cpu") == rt.Dist()


def test_a_half_environment_is_refused_before_the_run_directory_is_made(launch_env, monkeypatch, untrained_checkpoint,
                                                                       tmp_path, capsys):
    """``RANK=1 aiayn train ...`` trained alone, as if the main rank, with its info lines held back as another
    rank's: refused, and nothing written."""
    monkeypatch.setattr("aiayn.cli._quiet_other_rank", lambda: None)  # (its logging filters would outlive the test)
    launch_env(RANK="1")
    out = tmp_path / "run"
    argv = ["train", "--data", str(untrained_checkpoint.parent / "data"), "--out", str(out), "--preset", "tiny",
            "--max-steps", "1", "--no-progress", "--set", "train.threads=1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "RANK=1 is set without WORLD_SIZE" in err and err.count("\n") == 1, err
    assert not out.exists()


def test_more_processes_than_gpus_is_one_line(monkeypatch):
    """torchrun --nproc_per_node 4 on a machine of 2 GPUs: ranks 2 and 3 have no GPU of their own."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for spec in ("auto", "cuda"):
        with pytest.raises(UserError, match=r"LOCAL_RANK=3: this machine has 2 GPUs: start at most 2 processes on it "
                                            r"\(torchrun --nproc_per_node 2\)"):
            rt.resolve_device(spec, rt.Dist(rank=3, world_size=4, local_rank=3))


@pytest.mark.parametrize("processes, threads, cores, said", [
    (2, 1, 2, False), (3, 1, 2, True), (2, 2, 2, True), (1, 4, 2, False), (2, 1, 4, False)])
def test_more_threads_than_cores_is_said(processes, threads, cores, said):
    """The machine's processes times each one's threads, against its cores (one process alone: torch's own
    choice of threads, not said)."""
    line = rt.crowded_cores(processes, threads, cores)
    assert (line is not None) == said
    if said:
        assert line.startswith(f"{processes} processes of {threads} thread(s) each on this machine's {cores} CPU cores")


WAITING_ALONE = """
import sys
from aiayn import cli
sys.exit(cli.main(["train", "--data", sys.argv[1], "--out", sys.argv[2], "--preset", "tiny", "--max-steps", "1",
                   "--no-progress", "--set", "train.threads=1", "--set", "train.dist_timeout_s=3"]))
"""


def test_a_rank_whose_others_never_start_is_one_line_within_the_timeout(untrained_checkpoint, tmp_path):
    """Rank 0 of 2 waits for a rank 1 that never starts (its node down, its data missing), and a rank 1
    for a rank 0 that never starts: each stops after train.dist_timeout_s with the line of a timed-out
    collective, not a traceback of PyTorch's store; the run directory is not made."""
    data = untrained_checkpoint.parent / "data"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    procs = {rank: subprocess.Popen([sys.executable, "-c", WAITING_ALONE, str(data), str(tmp_path / f"run{rank}")],
                                    env={**env, "RANK": str(rank), "MASTER_PORT": str(_free_port())},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)}
    for rank, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=240)
        finally:
            proc.kill()
        assert (f"aiayn train: error: {tmp_path / f'run{rank}'}: rank {rank} of 2 waited train.dist_timeout_s = 3 s "
                f"for the other processes: one of them failed or hangs") in err, err[-3000:]
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("aiayn train: error"), err[-3000:]
        assert proc.returncode == 2
        assert not (tmp_path / f"run{rank}").exists()


def test_how_the_processes_train_is_said_at_the_start(caplog):
    """The start's line names the way the ranks train together, which summary.json's ``parallel`` records;
    a local SGD period in one process has nothing to average, and says so."""
    from aiayn.train import parallel
    from aiayn.train.config import TrainConfig
    cpu = torch.device("cpu")
    ranks = rt.Place(rt.Dist(rank=0, world_size=2), cpu, "fp32")
    ddp, lsgd = parallel.for_run(TrainConfig(), ranks), parallel.for_run(TrainConfig(local_sgd_period=8), ranks)
    assert (ddp.name, ddp.describe()) == ("ddp", "2 processes, their gradients all-reduced at every step (DDP)")
    assert (lsgd.name, lsgd.describe()) == ("local_sgd", "2 processes, each its own copy of the model and its own "
                                                         "Adam, the copies averaged every 8 steps (local SGD)")
    alone = rt.Place(rt.Dist(), cpu, "fp32")
    with caplog.at_level("WARNING"):
        one = parallel.for_run(TrainConfig(), alone)
        assert not caplog.records
        assert parallel.for_run(TrainConfig(local_sgd_period=8), alone).name == "one_process"
    assert (one.name, one.describe()) == ("one_process", "1 process")
    assert [r.getMessage() for r in caplog.records] == [
        "train.local_sgd_period=8 has no effect in one process: local SGD averages the copies of several "
        "(torchrun --nproc_per_node G)"]


def test_the_summary_names_the_processes_and_how_they_train(untrained_checkpoint, tmp_path, caplog):
    import json
    argv = ["train", "--data", str(untrained_checkpoint.parent / "data"), "--out", str(tmp_path / "run"), "--preset",
            "tiny", "--max-steps", "0", "--no-progress", "--set", "train.threads=1", "--set", "train.precision=fp32"]
    with caplog.at_level("INFO"):
        assert main(argv) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["devices"], summary["parallel"]) == (1, "one_process")
    assert any(r.getMessage().endswith("precision fp32, 1 process") for r in caplog.records)


@pytest.mark.parametrize("exc, said", [
    (torch.distributed.DistStoreError("wait timeout after 5000ms, keys: /default_pg/0//cpu//0/1"), True),  # torchrun's
    (torch.distributed.DistStoreError("Timed out after 6 seconds waiting for clients. 1/2 clients joined."), True),
    (torch.distributed.DistNetworkError("The client socket has timed out after 5000ms while trying to connect to "
                                        "(127.0.0.1, 29612)."), True),
    (torch.distributed.DistNetworkError("The server socket has failed to listen on any local network address. "
                                        "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE"), False),
    (RuntimeError("wait timeout after 5000ms"), False),  # (not PyTorch's store)
])
def test_the_start_ups_waits_that_time_out_are_known(exc, said):
    """The store's errors of a start-up that waited train.dist_timeout_s for the other ranks: the rank
    waiting for the others at torchrun's start, the main rank's store without torchrun, a rank
    connecting to it; not a port another training holds."""
    assert rt.timed_out(exc) == said
