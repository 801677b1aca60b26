"""A data-parallel run whose process hangs stops on the others within train.dist_timeout_s, with
an error that says so, instead of PyTorch's 30-minute wait."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from aiayn.config import ConfigError
from aiayn.train.config import TrainConfig
from tests.train.test_training import _free_port

WORKER = textwrap.dedent("""
    import os, sys, time
    import torch
    from aiayn.train import runtime as rt
    rank, folder = int(os.environ["RANK"]), sys.argv[1]
    open(os.path.join(folder, f"ready{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(folder, f"ready{r}")) for r in (0, 1)):
        time.sleep(0.05)  # both imported: the start-up itself is not what times out
    dist = rt.init_distributed("cpu", timeout_s=float(sys.argv[2]))  # (also bounds the start-up: not too short)
    torch.distributed.barrier()
    if rank == 0:
        time.sleep(600)  # hangs (a save on a dead disk, say)
    t0 = time.monotonic()
    try:
        torch.distributed.all_reduce(torch.ones(1))
    except RuntimeError as exc:
        print(f"timed_out={rt.timed_out(exc)} after={time.monotonic() - t0:.1f}", flush=True)
        os._exit(0)
    print("answered", flush=True)
""")


@pytest.mark.slow
def test_a_hanging_rank_is_an_error_on_the_others_within_the_timeout(tmp_path):
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), "20"], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, err = procs[1].communicate(timeout=240)  # imports on a busy machine; PyTorch's default: 30 min
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "timed_out=True" in out, err[-2000:]
    assert float(out.split("after=")[1]) < 60


def test_the_timeout_is_a_positive_number_of_seconds():
    assert TrainConfig().dist_timeout_s == 120.0
    with pytest.raises(ConfigError, match="dist_timeout_s must be > 0"):
        TrainConfig(dist_timeout_s=0)


PEER_WORKER = textwrap.dedent("""
    import os, sys, time
    import torch
    import aiayn.train.loop as loop
    from aiayn import cli
    from aiayn.train import runtime as rt
    rank = int(os.environ["RANK"])

    def train(*args, **kwargs):  # in place of the loop: rank 0 ends between two collectives
        dist = rt.init_distributed("cpu", timeout_s=60)
        if sys.argv[3] == "begun":
            rt.check_alike({"--out": "the same"}, dist)  # (the ranks agree to start)
        torch.distributed.barrier()
        if rank == 0:
            os._exit(1)  # killed (out of memory, SIGKILL)
        time.sleep(1)
        torch.distributed.all_reduce(torch.ones(1))

    loop.train = train
    sys.exit(cli.main(["train", "--data", sys.argv[1], "--out", sys.argv[2], "--preset", "tiny"]))
""")


@pytest.mark.parametrize("when, said", [
    ("begun", "; the last checkpoint is intact and the same command resumes"),
    ("starting", " before the ranks began the run (its own error says why)")])
def test_a_rank_that_ends_is_one_line_on_the_others(tmp_path, when, said):
    """gloo's "Connection closed by peer" on the ranks that remain is the error line of a failed
    rank, not a traceback; a resume is promised only where the ranks had begun the run (before, the
    other rank's error is a refused start: a locked --out, another run's files)."""
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", PEER_WORKER, str(tmp_path), str(tmp_path / "run"), when],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        _, err = procs[1].communicate(timeout=240)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert f"aiayn train: error: {tmp_path / 'run'}: rank 1 of 2 lost its connection to another process" in err, err
    assert err.rstrip().endswith(said), err
    assert "Traceback" not in err and "terminate called" not in err, err  # (gloo's threads at exit: status -6)
    assert procs[1].returncode == 2, err


ORPHAN_WORKER = textwrap.dedent("""
    import os, sys, time
    import aiayn.train.loop as loop
    from aiayn import cli

    def train(*args, **kwargs):  # in place of the loop: a rank that trains on and on
        open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid"), "w").write(str(os.getpid()))
        time.sleep(600)

    loop.train = train
    sys.exit(cli.main(["train", "--data", sys.argv[1], "--out", sys.argv[2], "--preset", "tiny"]))
""")


def test_the_ranks_end_with_a_killed_torchrun(tmp_path):
    """SIGKILL of the launcher (the out-of-memory killer's choice, a scheduler's kill -9) leaves no rank
    training on as an orphan, holding the run's lock against the command that would resume it."""
    import signal
    import time
    script = tmp_path / "worker.py"
    script.write_text(ORPHAN_WORKER)
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 str(script), str(tmp_path), str(tmp_path / "run")],
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    pids, ranks = [tmp_path / f"rank{r}.pid" for r in (0, 1)], []
    try:
        deadline = time.monotonic() + 120
        while not all(p.exists() and p.read_text() for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = [int(p.read_text()) for p in pids]
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks if _alive(pid)]
    finally:
        launcher.kill()
        for pid in ranks:  # (torchrun puts its ranks outside its own process group)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    """Whether the process ``pid`` runs (a zombie awaiting its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
