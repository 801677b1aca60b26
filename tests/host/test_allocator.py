"""The allocator setting removes the page faults of re-allocating large buffers."""
from __future__ import annotations

import os
import subprocess
import sys
import types

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


# Under reuse, the same 64 MB block allocated and freed again and again: once the heap has settled
# (see _PROBE), it keeps its size and HeapGrowth makes no trim (a trim hands back the free top, which
# the next block takes again: no growth). Then growth as a large corpus makes it: blocks of ever
# larger sizes (96 to 384 MB), each with a small live tensor above it, so that each freed block is
# a hole the next cannot use and the heap grows at each: nearly every look trims (the first may fit
# in what settling left free). (``by`` 0: glibc's sizes, not the threshold.) Prints each phase's trims.
_GROWTH_PROBE = """
import torch
from aiayn.host.allocator import HeapGrowth, heap_bytes, reuse_freed_memory
assert reuse_freed_memory() and heap_bytes() is not None
heap, keep = HeapGrowth(by=0.0, when="grown"), []
def trims(numels, hole):
    made = 0
    for numel in numels:
        block = torch.ones(numel)
        if hole:
            keep.append(torch.ones(16))  # above the block: its free space is a hole, not the heap top
        del block
        made += heap.look()
    return made
print(trims([1 << 24] * 20, False), trims([1 << 24] * 20, False),
      trims([(1 << 24) * (2 + i) // 2 for i in range(1, 11)], True))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallinfo2")
def test_heap_growth_trims_while_the_heap_grows_and_not_once_it_keeps_its_size():
    """Trimming a heap that reuses its holes hands back pages the next step faults in again."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")}
    out = subprocess.run([sys.executable, "-c", _GROWTH_PROBE], capture_output=True, text=True, check=True, env=env)
    settling, settled, growing = map(int, out.stdout.split())
    assert settling >= 1  # the first call and every growth while the heap settles
    assert settled == 0
    assert growing >= 8


def test_heap_growth_trims_every_time_where_the_heap_cannot_be_read(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "heap_bytes", lambda: None)
    monkeypatch.setattr(allocator, "release_free_memory", lambda: calls.append(1) or True)
    heap = allocator.HeapGrowth(when="grown")
    assert [heap.look() for _ in range(3)] == [True, True, True] and len(calls) == 3


def _trims(monkeypatch, sizes: list[int], looks: int | None = None, **kw) -> list[bool]:
    """What ``looks`` looks (default one a size) made, the heap reading ``sizes`` in turn."""
    it = iter(sizes)
    monkeypatch.setattr(allocator, "heap_bytes", lambda: next(it))
    monkeypatch.setattr(allocator, "release_free_memory", lambda: True)
    heap = allocator.HeapGrowth(**kw)
    return [heap.look() for _ in range(len(sizes) if looks is None else looks)]


def test_heap_growth_compares_with_the_size_at_the_last_trim(monkeypatch):
    """A trim hands back the heap's free top, which the next step takes again: the size read after
    it is smaller, and its return to the former size is no growth."""
    assert _trims(monkeypatch, [100, 60, 100, 101, 90], by=0.0, when="grown") == [True, False, False, True, False]


def test_heap_growth_trims_once_the_heap_has_grown_by_a_quarter(monkeypatch):
    """By default: 100 trimmed; 120 and 125 are within a quarter of it; 126 is not (trimmed, the new
    mark); 157 within a quarter of 126 (157.5); 158 beyond."""
    assert allocator.HEAP_GROWTH == 0.25
    assert _trims(monkeypatch, [100, 120, 125, 126, 157, 158], when="grown") == \
        [True, False, False, True, False, True]


def test_heap_growth_looks_at_every_nth_call(monkeypatch):
    """Its caller's steps counted: with ``every`` 3 the 3rd and 6th look read the heap (100, then 200:
    grown, both trimmed); ``every`` 0 never reads it."""
    assert _trims(monkeypatch, [100, 200], 6, every=3, when="grown") == [False, False, True, False, False, True]
    assert _trims(monkeypatch, [], 4, every=0, when="always") == [False] * 4


def test_heap_trim_choice_is_read_at_the_first_look_not_when_made(monkeypatch):
    """A decoding worker makes its HeapGrowth at import, before the environment is settled."""
    monkeypatch.delenv(allocator.TRIM_ENV, raising=False)
    heap = allocator.HeapGrowth()
    monkeypatch.setenv(allocator.TRIM_ENV, "never")
    monkeypatch.setattr(allocator, "release_free_memory", lambda: True)
    assert heap.look() is False and heap.when == "never"


@pytest.mark.parametrize("when, made", [("always", [True] * 4), ("never", [False] * 4)])
def test_heap_trim_choice_always_or_never(when, made, monkeypatch):
    monkeypatch.setenv(allocator.TRIM_ENV, when)
    assert _trims(monkeypatch, [100, 100, 100, 200]) == made


def test_heap_trim_choice_is_checked_at_start(monkeypatch):
    monkeypatch.setenv(allocator.TRIM_ENV, "sometimes")
    with pytest.raises(UserError, match="AIAYN_HEAP_TRIM must be one of grown, always, never, got 'sometimes'"):
        allocator.configure_from_env()


@pytest.mark.parametrize("when, made", [("grown", [0]), ("always", [0]), ("never", [])])
def test_a_trim_at_a_fixed_point_is_made_unless_never(when, made, monkeypatch):
    """Training after each validation (``release_host_memory``) and ``aiayn translate`` every
    CHUNK_LINES lines trim outside the looks; AIAYN_HEAP_TRIM=never makes no trim at all."""
    import torch

    from aiayn.train.loop import _Run
    calls = []
    monkeypatch.setenv(allocator.TRIM_ENV, when)
    glibc = allocator._glibc  # malloc_trim counted, however the caller reaches it
    monkeypatch.setattr(allocator, "_glibc", lambda name: calls.append if name == "malloc_trim" else glibc(name))
    _Run.release_host_memory(types.SimpleNamespace(device=torch.device("cpu")))
    assert calls == made
    calls.clear()
    assert allocator.trim_unless_never() is bool(made)
    assert calls == made


def test_training_from_python_refuses_a_bad_heap_trim_before_its_first_step(copy_data_dir, tmp_path, monkeypatch):
    """``aiayn.train.loop.train`` (without the command's start-up check) reads AIAYN_HEAP_TRIM when it
    starts, not at its first look at the heap, TRIM_EVERY_STEPS steps into the run."""
    from dataclasses import replace

    from aiayn.train.config import run_config_from_preset
    from aiayn.train.loop import train
    cfg = run_config_from_preset("tiny")
    cfg = replace(cfg, train=replace(cfg.train, max_steps=1, precision="fp32", threads=1, save_every_min=0))
    monkeypatch.setenv(allocator.TRIM_ENV, "sometimes")
    with pytest.raises(UserError, match="AIAYN_HEAP_TRIM must be one of grown, always, never, got 'sometimes'"):
        train(copy_data_dir, tmp_path / "run", cfg, progress=False)
    assert not list((tmp_path / "run").glob("*.pt"))
