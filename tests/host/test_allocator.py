"""The allocator setting removes the page faults of re-allocating large buffers."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aiayn.host import allocator
from aiayn.errors import UserError
from aiayn.host.hugepages import TORCH_ENV as TORCH_HUGEPAGES_ENV

# Allocate and free a 64 MB tensor 20 times, touching it, then 20 times more, and print the minor
# page faults of the last 20. The first rounds settle the heap: torch allocates with
# posix_memalign, and glibc before 2.38 serves an aligned request only from a free block larger than
# it by the alignment, so the exact hole a freed 64 MB block leaves (a small allocation above it
# keeps it from the heap top) is not reused until freed neighbours merge with it: the heap grows by
# up to about 8 blocks, how many depends on where small allocations land, then stays.
_PROBE = """
import resource, sys, torch
from aiayn.host.allocator import reuse_freed_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
for _ in range(20):
    torch.ones(1 << 24).sum()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(1 << 24).sum()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


def _faults(mode: str) -> int:
    # 4 kB pages, whatever an in-process `aiayn` command of another test set (aiayn/host/hugepages.py):
    # a huge page faults in 2 MB at once, which would hide the faults counted here
    # and nothing else another test left in the environment: only the variables a process needs
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")}
    env.pop(TORCH_HUGEPAGES_ENV, None)
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True, env=env)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_reuse_removes_page_faults_of_large_buffers():
    system, reuse = _faults("system"), _faults("reuse")
    assert system > 20 * (1 << 26) // 4096 // 2  # each 64 MB buffer faults its pages in again
    assert reuse < (1 << 26) // 4096 // 4  # settled: not one buffer's pages in 20 re-allocations


def test_env_choice(monkeypatch):
    monkeypatch.setenv(allocator.ENV, "system")
    assert allocator.configure_from_env() is False
    monkeypatch.setenv(allocator.ENV, "jemalloc")
    with pytest.raises(UserError, match="AIAYN_MALLOC"):
        allocator.configure_from_env()


# Under reuse, free 16 x 32 MB buffers that each sit below a small live tensor (holes the heap
# keeps), then trim: the holes' pages go back to the kernel. Prints RssAnon in MB before and after.
_TRIM_PROBE = """
import sys, torch
from aiayn.host.allocator import release_free_memory, reuse_freed_memory
assert reuse_freed_memory()
def anon():
    return int(open("/proc/self/status").read().split("RssAnon:")[1].split()[0]) // 1024
big, small = [], []
for i in range(16):
    big.append(torch.ones(1 << 23))  # 32 MB, touched
    small.append(torch.ones(16))  # keeps the heap top above the hole
del big
before = anon()
assert release_free_memory()
print(before, anon())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_release_free_memory_returns_the_heaps_holes():
    # and nothing else another test left in the environment: only the variables a process needs
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")}
    env.pop(TORCH_HUGEPAGES_ENV, None)
    out = subprocess.run([sys.executable, "-c", _TRIM_PROBE], capture_output=True, text=True, check=True, env=env)
    before, after = map(int, out.stdout.split())
    assert before - after > 400  # of the 512 MB freed, nearly all handed back
