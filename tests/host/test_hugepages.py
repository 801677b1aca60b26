"""The huge-pages setting: PyTorch's large CPU blocks are mapped with transparent huge pages."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aiayn.host import hugepages
from aiayn.errors import UserError

# Turn the setting on (or not), touch a 64 MB tensor, print the setting and how much of the
# process is in anonymous huge pages (kB). "on": the library call; "command": the aiayn
# command's start-up (cli.main), which must do it before the first tensor; "off": neither.
_PROBE = """
import contextlib, io, os, sys
from aiayn import cli
from aiayn.host import hugepages
if sys.argv[1] == "on":
    assert hugepages.use_huge_pages()
elif sys.argv[1] == "command":
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        cli.main(["--help"])
import torch
x = torch.ones(1 << 24)
print(os.environ.get("THP_MEM_ALLOC_ENABLE"),
      next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")))
"""


def _probe(mode: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k not in (hugepages.TORCH_ENV, hugepages.ENV)}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True, env=env)
    setting, huge_kb = out.stdout.split()
    return setting, int(huge_kb)


@pytest.mark.skipif(not hugepages.kernel_allows_huge_pages(), reason="kernel has transparent huge pages off")
def test_large_tensors_get_huge_pages():
    if hugepages.kernel_mode() == "madvise":  # ("always" gives huge pages to every large mapping)
        assert _probe("off")[1] < 8 * 1024  # 4 kB pages: the 64 MB tensor is not in huge pages
    assert _probe("on")[1] >= 32 * 1024  # most of it is (the kernel may fall back for a few 2 MB ranges)


@pytest.mark.skipif(not hugepages.kernel_allows_huge_pages(), reason="kernel has transparent huge pages off")
def test_the_command_turns_it_on_before_the_first_tensor():
    setting, huge_kb = _probe("command")
    assert setting == "1" and huge_kb >= 32 * 1024


def test_kernel_mode_parsing(tmp_path):
    f = tmp_path / "enabled"
    for text, allowed in (("always [madvise] never\n", True), ("[always] madvise never\n", True),
                          ("always madvise [never]\n", False)):
        f.write_text(text)
        assert hugepages.kernel_allows_huge_pages(f) is allowed
    assert hugepages.kernel_mode(f) == "never"
    assert hugepages.kernel_allows_huge_pages(tmp_path / "missing") is False


def test_env_choice(monkeypatch):
    monkeypatch.delenv(hugepages.TORCH_ENV, raising=False)
    monkeypatch.setenv(hugepages.ENV, "off")
    assert hugepages.configure_from_env() is False
    assert hugepages.TORCH_ENV not in os.environ
    monkeypatch.setenv(hugepages.ENV, "yes")
    with pytest.raises(UserError, match="AIAYN_HUGEPAGES"):
        hugepages.configure_from_env()


def test_a_users_own_setting_is_kept(monkeypatch):
    monkeypatch.setattr(hugepages, "kernel_allows_huge_pages", lambda: True)
    monkeypatch.setenv(hugepages.TORCH_ENV, "0")
    monkeypatch.delenv(hugepages.ENV, raising=False)
    assert hugepages.configure_from_env() is False
    monkeypatch.delenv(hugepages.TORCH_ENV)
    assert hugepages.configure_from_env() is True
    assert os.environ[hugepages.TORCH_ENV] == "1"
