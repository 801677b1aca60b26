"""kernels/loader.py: what happens without a compiler or with a compile error, a damaged or unsafe
cached library, and the library built without -march=native (the portable loops) giving the numbers
of the native one."""
import os
import platform
import shutil

import pytest
import torch

from aiayn.errors import UserError
from aiayn.kernels import loader as kernel_mod
from tests.kernels.reference import log_softmax_topk_matches_pytorch, shared_slot_case
from tests.kernels.test_beam_attention import check_self_attention


@pytest.fixture(autouse=True)
def _load_cleared():
    """Each test's ``load()`` runs as a new process's first would: its cache cleared before and after."""
    kernel_mod.load.cache_clear()
    yield
    kernel_mod.load.cache_clear()


def _load_anew():
    """``load()`` again, as another process would run it (its cache cleared)."""
    kernel_mod.load.cache_clear()
    return kernel_mod.load()


def test_without_a_compiler_load_returns_none(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "kernels"))
    kernel_mod.load.cache_clear()
    with caplog.at_level("INFO", logger="aiayn.kernels.loader"):
        assert kernel_mod.load() is None
    assert "no C compiler" in caplog.text


def test_a_compile_error_is_logged_and_returns_none(monkeypatch, tmp_path, caplog):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(kernel_mod, "SOURCES", (kernel_mod.SOURCES[0], bad))
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "kernels"))
    kernel_mod.load.cache_clear()
    if kernel_mod._compiler() is None:
        pytest.skip("no C compiler")
    with caplog.at_level("WARNING", logger="aiayn.kernels.loader"):
        assert kernel_mod.load() is None
    assert "could not compile beam_attention.c bad.c" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written is left to load


def test_the_portable_build_gives_the_same_numbers(portable):
    # the library without -march=native: attention, log-softmax top-k and int8 passes by the plain loops
    from aiayn.decode.int8 import quantize_rows

    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, anc = shared_slot_case(H=2, K=16, Dv=16, dtype=dtype)
        # beam_attention.c's forward, the same arithmetic in the plain loops: within eq1_bounds of Eq. 1
        check_self_attention(portable.self_attention(q, k, v, anc, 4), q, k, v, anc, 4)
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
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "a"))
    assert _load_anew() is not None and len(built) == 1
    assert _load_anew() is not None and len(built) == 1  # intact: reused
    # another cache holding that library cut short (a full disk, a damaged file), with its checksum
    damaged = tmp_path / "b" / built[0].name
    damaged.parent.mkdir(mode=0o700)
    damaged.write_bytes(good[:4096])
    for p in tmp_path.glob("a/*.sha256"):
        (damaged.parent / p.name).write_bytes(p.read_bytes())
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(damaged.parent))
    k = _load_anew()
    assert k is not None and len(built) == 2 and k.path == damaged and damaged.read_bytes() == good


def test_a_cached_library_others_could_write_is_not_loaded(kernels, monkeypatch, tmp_path):
    built = _counting_build(monkeypatch, kernels.path.read_bytes())
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    assert _load_anew() is not None
    (tmp_path / built[0].name).chmod(0o666)  # anyone could have replaced it since
    k = _load_anew()
    assert k is not None and len(built) == 2 and k.path.stat().st_mode & 0o022 == 0
    tmp_path.chmod(0o777)  # a cache directory shared between users: each gets a private folder in it
    k = _load_anew()
    assert k is not None and len(built) == 3
    assert k.path.parent == tmp_path / f"user-{os.getuid()}" and k.path.parent.stat().st_mode & 0o777 == 0o700


def test_the_march_setting_names_the_build(monkeypatch, tmp_path):
    # AIAYN_KERNELS_MARCH builds for another CPU (x86-64-v3: AVX2 + FMA); it is part of the cached name
    monkeypatch.setenv(kernel_mod.MARCH_ENV, "x86-64-v3")
    assert kernel_mod._march() == "x86-64-v3"
    monkeypatch.setenv(kernel_mod.MARCH_ENV, "")
    assert kernel_mod._march() == "native"
    monkeypatch.setenv(kernel_mod.MARCH_ENV, "native -o /etc/x")
    with pytest.raises(UserError, match="not a compiler target name"):
        kernel_mod._march()


# /proc/cpuinfo's flags of a CPU with AVX2 and FMA but no AVX-512 (a Haswell, a Zen 3)
AVX2_CPU = frozenset("fpu sse sse2 pni ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 abm movbe".split())


def _no_build(cc, out, archs=None):
    raise AssertionError("compiled for a target this CPU cannot run")


def test_a_named_target_this_cpu_cannot_run_is_not_built(kernels, monkeypatch, tmp_path, caplog):
    """A library built for x86-64-v4 stops at its first AVX-512 instruction (SIGILL) on a CPU without
    AVX-512: on such a CPU (its flags faked) that target is refused with a warning, PyTorch's path runs;
    x86-64-v3 and native are built."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"x86 targets; this is {platform.machine()}")
    monkeypatch.setattr(kernel_mod, "cpu_flags", lambda: AVX2_CPU)
    monkeypatch.setattr(kernel_mod, "_compile", _no_build)
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(kernel_mod.MARCH_ENV, "x86-64-v4")
    kernel_mod.load.cache_clear()
    with caplog.at_level("WARNING", logger="aiayn.kernels.loader"):
        assert kernel_mod.load() is None
    assert caplog.messages == ["AIAYN_KERNELS_MARCH=x86-64-v4: this CPU lacks avx512bw avx512cd avx512dq "
                               "avx512f avx512vl, which code built for that target may use: decoding and "
                               "the training loss use PyTorch's operations"]
    assert not list(tmp_path.iterdir())
    built = _counting_build(monkeypatch, kernels.path.read_bytes())
    for march in ("x86-64-v3", "native"):  # this CPU has all of v3; native is whatever this CPU is
        monkeypatch.setenv(kernel_mod.MARCH_ENV, march)
        assert _load_anew() is not None
    assert len(built) == 2


def test_the_cached_name_follows_the_cpu_the_target_and_the_compiler(kernels, monkeypatch, tmp_path):
    """A home directory shared by machines with other CPUs or compilers: each gets its own build, and the
    same machine reuses its own."""
    built = _counting_build(monkeypatch, kernels.path.read_bytes())
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    real_target = kernel_mod.compiler_target

    def name() -> str:
        k = _load_anew()
        assert k is not None
        return k.path.name
    here = name()
    assert name() == here and len(built) == 1  # reused
    signature = kernel_mod._cpu_signature()
    monkeypatch.setattr(kernel_mod, "_cpu_signature",  # what /proc/cpuinfo says on an AVX2 machine
                        lambda: signature.split("flags")[0] + "flags\t\t: " + " ".join(sorted(AVX2_CPU)))
    other_cpu = name()
    monkeypatch.setattr(kernel_mod, "compiler_target",  # another version of the compiler
                        lambda cc, march: real_target(cc, march) + "#define __VERSION__ \"99.0\"\n")
    other_compiler = name()
    monkeypatch.setenv(kernel_mod.MARCH_ENV, "x86-64-v2" if kernel_mod._march() == "x86-64" else "x86-64")
    other_march = name()
    assert len({here, other_cpu, other_compiler, other_march}) == 4 and len(built) == 4


def test_a_full_disk_is_one_warning_naming_the_cache(kernels, monkeypatch, tmp_path, caplog):
    import errno

    _counting_build(monkeypatch, kernels.path.read_bytes())

    def full(self, name, built):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(kernel_mod.CacheFolder, "install", full)
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    kernel_mod.load.cache_clear()
    with caplog.at_level("WARNING", logger="aiayn.kernels.loader"):
        assert kernel_mod.load() is None
    assert len(caplog.messages) == 1 and f"({tmp_path}: [Errno 28] No space left on device)" in caplog.text


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_target_the_compiler_refuses_is_an_error_not_the_portable_build(monkeypatch, tmp_path):
    """-march=native may fall back to the portable loops; a target the user names (misspelt here) is
    built as named or refused, with the compiler's words."""
    monkeypatch.setenv(kernel_mod.MARCH_ENV, "x86_64-v3")
    with pytest.raises(UserError, match=r"AIAYN_KERNELS_MARCH=x86_64-v3: the compiler refuses it \(.*x86_64-v3"):
        kernel_mod._compile("cc", tmp_path / "k.so")
    assert not (tmp_path / "k.so").exists()


# The C sources compiled for the CPUs aiayn's users have, whatever CPU runs the tests: plain x86-64
# (no AVX2: the portable loops), x86-64-v3 (AVX2 + FMA), x86-64-v4 (AVX-512), and 64-bit Arm with
# Debian's cross compiler (gcc-aarch64-linux-gnu; .ci/run installs it), so a Graviton or an Arm laptop
# is not the first to find a compile error. Only the x86 builds this CPU can run are run
# (test_the_portable_build_gives_the_same_numbers, and the AVX2 and below-AVX passes of .ci/run).
TARGETS = [("cc", "-march=x86-64"), ("cc", "-march=x86-64-v3"), ("cc", "-march=x86-64-v4"),
           ("aarch64-linux-gnu-gcc", "-march=armv8-a"), ("aarch64-linux-gnu-gcc", "-march=armv8.2-a+bf16")]


@pytest.mark.parametrize("cc, march", TARGETS, ids=[m.split("=")[1] for _, m in TARGETS])
def test_the_sources_compile_for_each_target(cc, march, tmp_path):
    import platform
    import shutil
    import subprocess

    if cc == "cc" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"x86 targets on an x86 compiler; this is {platform.machine()}")
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} (Debian: gcc-aarch64-linux-gnu)")
    out = tmp_path / "k.so"
    done = subprocess.run([cc, *kernel_mod._FLAGS, march, "-Werror=implicit-function-declaration",
                           *map(str, kernel_mod.SOURCES), "-o", str(out), "-lm"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.stat().st_size > 0
