"""The C kernels (aiayn/kernels/loader.py), built once for the tests of this folder: ``kernels`` with
-march=native, ``portable`` without (the plain C loops), ``x86_64_v3`` for AVX2 + FMA (the 8-wide
paths, which an AVX-512 machine's native build does not take)."""
import platform

import pytest

from aiayn.kernels import loader as kernel_mod


@pytest.fixture(scope="session")
def portable(tmp_path_factory):
    """The library compiled without -march=native: the plain C loops (no AVX-512 intrinsics)."""
    import ctypes

    cc = kernel_mod._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    path = tmp_path_factory.mktemp("portable") / "portable.so"
    assert kernel_mod._compile(cc, path, archs=([],)) is None
    return kernel_mod.Kernels(ctypes.CDLL(str(path)), path)


# /proc/cpuinfo's names for what x86-64-v3 adds to x86-64-v2: the compiler may use any of them, not only
# the kernels' AVX2 and FMA (v2's SSE4.2 and POPCNT come with every CPU that has these)
X86_64_V3_FLAGS = {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}


@pytest.fixture(scope="session")
def x86_64_v3(tmp_path_factory):
    """The library compiled for x86-64-v3 (AVX2 + FMA, no AVX-512), whatever -march ``kernels`` takes;
    skipped where this CPU cannot run it (not x86, or without those instructions) or there is no
    compiler."""
    import ctypes

    flags = set()
    if platform.machine() in ("x86_64", "AMD64"):
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    if not X86_64_V3_FLAGS <= flags:
        pytest.skip("x86-64-v3 build: this CPU cannot run it")
    cc = kernel_mod._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    path = tmp_path_factory.mktemp("x86-64-v3") / "x86-64-v3.so"
    assert kernel_mod._compile(cc, path, archs=(["-march=x86-64-v3"],)) is None
    return kernel_mod.Kernels(ctypes.CDLL(str(path)), path)


@pytest.fixture(scope="session")
def kernels(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("AIAYN_CACHE_DIR", str(tmp_path_factory.mktemp("kernels")))
    kernel_mod.load.cache_clear()
    k = kernel_mod.load()
    mp.undo()
    kernel_mod.load.cache_clear()
    if k is None:
        pytest.skip("no C compiler on this machine: decoding uses PyTorch's attention (tested elsewhere)")
    return k
