"""kernels/loader.py: what happens without a compiler or with a compile error, a damaged or unsafe
cached library, and the library built without -march=native (the portable loops) giving the numbers
of the native one."""
import os

import pytest
import torch

from aiayn.kernels import loader as kernel_mod
from tests.kernels.reference import log_softmax_topk_matches_pytorch, shared_slot_case, shared_slot_reference


def test_without_a_compiler_load_returns_none(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "kernels"))
    kernel_mod.load.cache_clear()
    try:
        with caplog.at_level("INFO", logger="aiayn.kernels.loader"):
            assert kernel_mod.load() is None
    finally:
        kernel_mod.load.cache_clear()
    assert "no C compiler" in caplog.text


def test_a_compile_error_is_logged_and_returns_none(monkeypatch, tmp_path, caplog):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(kernel_mod, "SOURCES", (kernel_mod.SOURCES[0], bad))
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "kernels"))
    kernel_mod.load.cache_clear()
    try:
        if kernel_mod._compiler() is None:
            pytest.skip("no C compiler")
        with caplog.at_level("WARNING", logger="aiayn.kernels.loader"):
            assert kernel_mod.load() is None
    finally:
        kernel_mod.load.cache_clear()
    assert "could not compile beam_attention.c bad.c" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written is left to load


def test_the_portable_build_gives_the_same_numbers(portable):
    # the library without -march=native: attention, log-softmax top-k and int8 passes by the plain loops
    from aiayn.decode.int8 import quantize_rows

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q, k, v, anc = shared_slot_case(H=2, K=16, Dv=16, dtype=dtype)
        torch.testing.assert_close(portable.self_attention(q, k, v, anc, 4).float(),
                                   shared_slot_reference(q, k, v, anc, 4), atol=tol, rtol=tol)
        log_softmax_topk_matches_pytorch(portable, dtype, 1)
        x = torch.randn(9, 70).to(dtype)
        assert all(torch.equal(a, b) for a, b in zip(portable.quantize_rows(x), quantize_rows(x)))


def _counting_build(monkeypatch, good: bytes) -> list:
    """``_compile`` replaced by a copy of an already built library (no compiler run); the paths
    it was asked to build (in the build's private temporary directory), in order."""
    built = []

    def compile_(cc, out, archs=None):
        built.append(out)
        out.write_bytes(good)
    monkeypatch.setattr(kernel_mod, "_compile", compile_)
    return built


def test_a_damaged_cached_library_is_built_again(kernels, monkeypatch, tmp_path):
    good = kernels.path.read_bytes()
    built = _counting_build(monkeypatch, good)
    try:
        monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "a"))
        kernel_mod.load.cache_clear()
        assert kernel_mod.load() is not None and len(built) == 1
        kernel_mod.load.cache_clear()
        assert kernel_mod.load() is not None and len(built) == 1  # intact: reused
        # another cache holding that library cut short (a full disk, a damaged file), with its checksum
        damaged = tmp_path / "b" / built[0].name
        damaged.parent.mkdir(mode=0o700)
        damaged.write_bytes(good[:4096])
        for p in tmp_path.glob("a/*.sha256"):
            (damaged.parent / p.name).write_bytes(p.read_bytes())
        monkeypatch.setenv("AIAYN_CACHE_DIR", str(damaged.parent))
        kernel_mod.load.cache_clear()
        k = kernel_mod.load()
        assert k is not None and len(built) == 2 and k.path == damaged and damaged.read_bytes() == good
    finally:
        kernel_mod.load.cache_clear()


def test_a_cached_library_others_could_write_is_not_loaded(kernels, monkeypatch, tmp_path):
    built = _counting_build(monkeypatch, kernels.path.read_bytes())
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    try:
        kernel_mod.load.cache_clear()
        assert kernel_mod.load() is not None
        (tmp_path / built[0].name).chmod(0o666)  # anyone could have replaced it since
        kernel_mod.load.cache_clear()
        k = kernel_mod.load()
        assert k is not None and len(built) == 2 and k.path.stat().st_mode & 0o022 == 0
        tmp_path.chmod(0o777)  # a cache directory shared between users: each gets a private folder in it
        kernel_mod.load.cache_clear()
        k = kernel_mod.load()
        assert k is not None and len(built) == 3
        assert k.path.parent == tmp_path / f"user-{os.getuid()}" and k.path.parent.stat().st_mode & 0o777 == 0o700
    finally:
        kernel_mod.load.cache_clear()
