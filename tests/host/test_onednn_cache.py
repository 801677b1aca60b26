"""aiayn/host/onednn_cache.py: oneDNN keeps the generated code of every product shape when the setting is on."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aiayn.host import onednn_cache
from aiayn.errors import UserError

# bfloat16 products of 24 row counts, twice over, with oneDNN reporting each primitive it creates;
# prints how many were created afresh (cache misses) in the second round. argv[1]: AIAYN_ONEDNN_CACHE.
_PROBE = """
import os, sys
os.environ["AIAYN_ONEDNN_CACHE"] = sys.argv[1]
from aiayn.host.process import configure_process
configure_process()
import torch
torch.set_num_threads(1)
w = torch.randn(64, 32, dtype=torch.bfloat16)
for round in (1, 2):
    print("round", round, flush=True)
    for m in range(8, 8 + 24):
        torch.randn(m, 64, dtype=torch.bfloat16) @ w
"""


def _misses_in_second_round(setting: str) -> int | None:
    env = {k: v for k, v in os.environ.items() if k not in (onednn_cache.ONEDNN_ENV, onednn_cache.ENV)}
    env["ONEDNN_VERBOSE"] = "all"  # ("create" alone reports nothing in this oneDNN)
    if setting == "tiny":  # what the default cache does to a run with more shapes than it holds
        env[onednn_cache.ONEDNN_ENV], setting = "8", "0"
    out = subprocess.run([sys.executable, "-c", _PROBE, setting], capture_output=True, text=True, check=True,
                         env=env).stdout
    if "create:cache_" not in out:
        return None  # this CPU's bfloat16 products do not go through oneDNN
    return out.split("round 2")[1].count("create:cache_miss")


def test_every_shape_stays_cached():
    tiny = _misses_in_second_round("tiny")
    if tiny is None:
        pytest.skip("bfloat16 matmuls do not run on oneDNN on this CPU")
    assert tiny == 24  # a cache of 8 entries cycled through 24 shapes: every one generated again
    assert _misses_in_second_round(str(onednn_cache.DEFAULT_CAPACITY)) == 0


def test_setting_respects_the_user(monkeypatch):
    monkeypatch.delenv(onednn_cache.ONEDNN_ENV, raising=False)
    monkeypatch.delenv(onednn_cache.ENV, raising=False)
    assert onednn_cache.configure_from_env() == onednn_cache.DEFAULT_CAPACITY
    assert os.environ[onednn_cache.ONEDNN_ENV] == "16384"
    monkeypatch.setenv(onednn_cache.ONEDNN_ENV, "300")  # the user's own value is kept
    assert onednn_cache.configure_from_env() == 300
    monkeypatch.delenv(onednn_cache.ONEDNN_ENV)
    monkeypatch.setenv(onednn_cache.ENV, "0")  # 0: oneDNN's default, nothing set
    assert onednn_cache.configure_from_env() == 0 and onednn_cache.ONEDNN_ENV not in os.environ
    monkeypatch.setenv(onednn_cache.ENV, "lots")
    with pytest.raises(UserError, match="AIAYN_ONEDNN_CACHE"):
        onednn_cache.configure_from_env()


@pytest.mark.parametrize("value", ["\u00b2", "\u0663", str(2 ** 31)])
def test_a_value_int_cannot_take_or_onednn_cannot_hold_is_one_clear_error(value, monkeypatch):
    """str.isdigit accepts superscripts and other scripts' digits, which int() refuses; oneDNN reads
    the capacity into a C int."""
    monkeypatch.setenv(onednn_cache.ENV, value)
    monkeypatch.delenv(onednn_cache.ONEDNN_ENV, raising=False)
    with pytest.raises(UserError, match="AIAYN_ONEDNN_CACHE must be a number of cache entries from 0"):
        onednn_cache.configure_from_env()
