"""A rank's process ends at once when its command is done: gloo's threads outlive the process group
after a DistributedDataParallel used it, and the interpreter's exit with them alive can abort a rank
that succeeded (SIGABRT), which torchrun reports as a failed run."""
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from aiayn import cli
from aiayn.train import runtime as rt


class _Left(Exception):
    """``os._exit`` called (with its status)."""


def _exit_recorded(monkeypatch) -> list[int]:
    codes: list[int] = []

    def fake_exit(rc):
        codes.append(rc)
        raise _Left(rc)
    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    return codes


def test_a_process_that_joined_a_group_ends_with_the_commands_status(monkeypatch, capsys, tmp_path):
    codes = _exit_recorded(monkeypatch)
    monkeypatch.setattr(rt, "JOINED", True)
    flushed = []
    monkeypatch.setattr(logging, "shutdown", lambda: flushed.append(True))
    with pytest.raises(_Left):
        cli.main(["upgrade-checkpoint", str(tmp_path / "absent.pt")])  # an error: status 2
    assert codes == [2] and flushed == [True]
    assert "absent.pt" in capsys.readouterr().err  # said before the process ends


def test_a_process_that_joined_no_group_returns(monkeypatch, tmp_path):
    codes = _exit_recorded(monkeypatch)
    monkeypatch.setattr(rt, "JOINED", False)
    assert cli.main(["upgrade-checkpoint", str(tmp_path / "absent.pt")]) == 2
    assert codes == []


def _defect(argv):
    raise ZeroDivisionError("a defect")


def test_a_joined_process_with_a_traceback_ends_at_once_with_status_1(monkeypatch, capsys):
    """torchrun names the rank that failed first: one that went through Python's exit after its
    traceback ended after the peer it left waiting, and the peer was named."""
    codes = _exit_recorded(monkeypatch)
    monkeypatch.setattr(rt, "JOINED", True)
    monkeypatch.setattr(cli, "_main", _defect)
    with pytest.raises(_Left):
        cli.main([])
    assert codes == [1]
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: a defect" in err


def test_a_traceback_of_a_process_alone_is_raised(monkeypatch):
    codes = _exit_recorded(monkeypatch)
    monkeypatch.setattr(rt, "JOINED", False)
    monkeypatch.setattr(cli, "_main", _defect)
    with pytest.raises(ZeroDivisionError):
        cli.main([])
    assert codes == []


@pytest.mark.parametrize("rank, said", [("0", True), ("1", False)])
def test_ctrl_c_before_the_command_is_said_by_the_main_rank_alone(monkeypatch, capsys, rank, said):
    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(cli, "_main", interrupted)
    assert cli.main([]) == 130
    assert ("aiayn: interrupted" in capsys.readouterr().err) is said


RANK = textwrap.dedent("""
    import gc, os, sys
    import torch, torch.distributed as tdist
    from aiayn.train import runtime as rt
    rt.init_distributed("cpu", timeout_s=60)
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    gc.collect()
    rt.leave_process_group()
    gc.collect()
    print("threads", len(os.listdir("/proc/self/task")), "joined", rt.JOINED)
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_gloo_threads_outlive_a_group_that_ddp_used(tmp_path):
    """Why ranks end through ``os._exit``: the threads are there after ``destroy_process_group``. If a
    PyTorch release frees them, this fails, and ``aiayn.cli._leave`` can go."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln.split() for ln in res.stdout.splitlines() if ln.startswith("threads ")]
    assert len(lines) == 2 and all(ln[3] == "True" for ln in lines), res.stdout
    assert all(int(ln[1]) > 1 for ln in lines), res.stdout
