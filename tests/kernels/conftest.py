"""The C kernels (aiayn/kernels/loader.py), built once for the tests of this folder: ``kernels`` with
-march=native, ``portable`` without (the plain C loops)."""
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
