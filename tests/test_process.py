"""aiayn/process.py: the aiayn command's process settings, applied in their order, errors named."""
import subprocess
import sys

import pytest

from aiayn import allocator, denormals, hugepages, onednn_cache
from aiayn.process import configure_process


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
                                       ("AIAYN_MALLOC", "maybe"), ("AIAYN_ONEDNN_CACHE", "big")])
def test_bad_value_is_one_clear_line(var, value, monkeypatch):
    monkeypatch.setenv(var, value)
    r = subprocess.run([sys.executable, "-c", "import sys; from aiayn.cli import main; sys.exit(main(['--help']))"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert var in r.stderr and "Traceback" not in r.stderr
