"""aiayn/host/process.py: the aiayn command's process settings, applied in their order, errors named."""
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn.host import allocator, denormals, hugepages, onednn_cache
from aiayn.host.process import configure_process


def test_order(monkeypatch):
    calls = []
    monkeypatch.setattr(hugepages, "configure_from_env", lambda: calls.append("hugepages"))
    monkeypatch.setattr(onednn_cache, "configure_from_env", lambda: calls.append("onednn_cache"))
    monkeypatch.setattr(denormals, "configure_from_env", lambda: calls.append("denormals"))
    monkeypatch.setattr(allocator, "configure_from_env", lambda: calls.append("allocator"))
    configure_process()
    # first tensor, first matmul, thread pool, then malloc
    assert calls == ["hugepages", "onednn_cache", "denormals", "allocator"]


@pytest.mark.parametrize("var,value", [("AIAYN_HUGEPAGES", "maybe"), ("AIAYN_DENORMALS", "maybe"),
                                       ("AIAYN_MALLOC", "maybe"), ("AIAYN_ONEDNN_CACHE", "big"),
                                       ("AIAYN_HEAP_TRIM", "sometimes")])
def test_bad_value_is_one_clear_line(var, value, monkeypatch):
    monkeypatch.setenv(var, value)
    r = subprocess.run([sys.executable, "-c", "import sys; from aiayn.cli import main; sys.exit(main(['--help']))"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert var in r.stderr and "Traceback" not in r.stderr


def test_die_with_parent_keeps_the_child_of_an_init_process(monkeypatch):
    """A child whose parent is process 1 (aiayn as a container's entry point) lives on; a child
    whose parent is no longer the one that started it exits."""
    import os

    from aiayn.host.process import die_with_parent
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(os, "getppid", lambda: 1)
    die_with_parent(1)
    assert exits == []
    die_with_parent(4242)  # started by 4242, now a child of 1: 4242 has ended
    assert exits == [1]


def test_a_real_child_ends_with_its_parent(tmp_path):
    """Linux: a child that asked for PR_SET_PDEATHSIG is ended by the kernel when its parent dies."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    import os
    import signal
    import time
    pid_file = tmp_path / "child.pid"
    (tmp_path / "child.py").write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                                       "time.sleep(60)\n")
    parent = ("import functools, os, subprocess, sys, time\n"
              "from aiayn.host.process import die_with_parent\n"
              f"subprocess.Popen([sys.executable, {str(tmp_path / 'child.py')!r}],\n"
              "                 preexec_fn=functools.partial(die_with_parent, os.getpid()))\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        child = int(pid_file.read_text())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    stat = Path(f"/proc/{child}/stat")
    for _ in range(100):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":  # ended, not yet reaped by its new parent
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the child outlived its parent")


@pytest.mark.parametrize("var,value", [("AIAYN_HUGEPAGES", "maybe"), ("AIAYN_DENORMALS", "maybe"),
                                       ("AIAYN_MALLOC", "maybe"), ("AIAYN_ONEDNN_CACHE", "big"),
                                       ("AIAYN_HEAP_TRIM", "sometimes")])
def test_check_settings_refuses_each_bad_value_without_applying(var, value, monkeypatch):
    from aiayn.errors import UserError
    from aiayn.host.process import check_settings

    for name in ("AIAYN_HUGEPAGES", "AIAYN_DENORMALS", "AIAYN_MALLOC", "AIAYN_ONEDNN_CACHE", "AIAYN_HEAP_TRIM"):
        monkeypatch.delenv(name, raising=False)
    check_settings()
    monkeypatch.setenv(var, value)
    with pytest.raises(UserError, match=f"^{var} must be"):
        check_settings()
