"""kernels/build_cache.py: the kernels' cache against a hostile layout. A cache directory or folder that
is a symbolic link, writable by others or owned by another user is refused; an entry replaced by a
symbolic link is neither loaded, changed nor written through; a checksum that does not match means a
rebuild; the compiler writes outside the cache; leftovers of killed builds are removed."""
import hashlib
import os
import stat
import time

import pytest

from aiayn.kernels import build_cache
from aiayn.kernels import loader as kernel_mod
from aiayn.kernels.build_cache import CacheFolder


@pytest.fixture(scope="module")
def good() -> bytes:
    """The bytes of a real build (in this run's cache, tests/conftest.py)."""
    kernel_mod.load.cache_clear()
    try:
        k = kernel_mod.load()
    finally:
        kernel_mod.load.cache_clear()
    if k is None:
        pytest.skip("no C compiler")
    return k.path.read_bytes()


@pytest.fixture
def built(monkeypatch, good) -> list:
    """``_compile`` replaced by writing ``good`` (no compiler run): (the path it was asked to write, the
    mode of its folder) for each build, in order."""
    calls = []

    def compile_(cc, out, archs=None):
        calls.append((out, stat.S_IMODE(out.parent.stat().st_mode)))
        out.write_bytes(good)
    monkeypatch.setattr(kernel_mod, "_compile", compile_)
    return calls


@pytest.fixture
def load(monkeypatch):
    """``loader.load()`` with the cache directory given, its memo cleared before and after."""
    def load_(base):
        monkeypatch.setenv("AIAYN_CACHE_DIR", str(base))
        kernel_mod.load.cache_clear()
        return kernel_mod.load()
    yield load_
    kernel_mod.load.cache_clear()


def _give_away(monkeypatch, path):
    """Make ``path`` another user's: chown as root, else fstat and lstat report another owner for it."""
    if os.getuid() == 0:
        os.chown(path, 65534, 65534)
        return
    ino = os.lstat(path).st_ino
    for fn in ("fstat", "lstat", "stat"):
        real = getattr(os, fn)

        def fake(*a, _real=real, **kw):
            st = _real(*a, **kw)
            if st.st_ino != ino:
                return st
            fields = list(st)
            fields[stat.ST_UID] = os.getuid() + 1
            return os.stat_result(fields)
        monkeypatch.setattr(os, fn, fake)


def test_the_cache_is_created_private_and_the_compiler_writes_outside_it(built, load, tmp_path):
    base = tmp_path / "deep" / "cache"
    k = load(base)
    assert k is not None and k.path.parent == base and stat.S_IMODE(base.stat().st_mode) == 0o700
    (out, mode), = built
    assert out.parent != base and mode == 0o700 and not out.parent.exists()  # a private temporary, gone
    assert stat.S_IMODE(k.path.stat().st_mode) == 0o755
    record = k.path.with_name(k.path.name + ".sha256")
    assert record.read_text().strip() == hashlib.sha256(k.path.read_bytes()).hexdigest()
    assert sorted(p.name for p in base.iterdir()) == [k.path.name, record.name]  # no temporaries left


def test_a_symlinked_cache_dir_is_refused(built, load, tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    link = tmp_path / "cache"
    link.symlink_to(elsewhere)
    with pytest.raises(OSError, match="symbolic link") as e:
        CacheFolder.open(link)
    assert str(link) in str(e.value)
    with caplog.at_level("WARNING", logger="aiayn.kernels.loader"):
        assert load(link) is None
    assert f"kernel cache refused ({link} is a symbolic link" in caplog.text
    assert not built and not list(elsewhere.iterdir())


def test_a_symlinked_user_folder_is_refused(built, load, tmp_path):
    base = tmp_path / "shared"
    base.mkdir()
    base.chmod(0o777)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (base / f"user-{os.getuid()}").symlink_to(elsewhere)
    with pytest.raises(OSError, match=f"{base / f'user-{os.getuid()}'} is a symbolic link"):
        CacheFolder.open(base)
    assert load(base) is None and not built and not list(elsewhere.iterdir())


@pytest.mark.parametrize("what", ["library", "record"])
def test_an_entry_replaced_by_a_symlink_is_not_followed(built, load, tmp_path, what):
    base = tmp_path / "cache"
    k = load(base)
    entry = k.path if what == "library" else k.path.with_name(k.path.name + ".sha256")
    # another file that would pass every check if the link were followed: this user's, the right bytes
    target = tmp_path / "target"
    target.write_bytes(entry.read_bytes())
    target.chmod(0o600)
    os.utime(target, (1e9, 1e9))
    before = target.stat()
    entry.unlink()
    entry.symlink_to(target)
    with CacheFolder.open(base) as cache:
        assert cache.load(k.path.name) == (None, "a symbolic link (not followed)" if what == "library"
                                           else "its recorded checksum: a symbolic link (not followed)")
    k = load(base)
    assert k is not None and len(built) == 2  # built again, not loaded through the link
    assert not entry.is_symlink() and entry.stat().st_ino != target.stat().st_ino  # replaced, not written through
    after = target.stat()  # neither chmodded nor written
    assert (stat.S_IMODE(after.st_mode), after.st_mtime_ns, after.st_size) == (0o600, before.st_mtime_ns, before.st_size)


@pytest.mark.parametrize("mode", [0o770, 0o707])
def test_a_shared_cache_dir_gets_a_user_folder_that_others_may_not_write(built, load, tmp_path, mode):
    base = tmp_path / "shared"
    base.mkdir()
    base.chmod(mode)  # writable by the group or by anyone: each user gets a private folder in it
    k = load(base)
    mine = base / f"user-{os.getuid()}"
    assert k is not None and k.path.parent == mine and stat.S_IMODE(mine.stat().st_mode) == 0o700
    mine.chmod(mode)  # anyone could have put files in it since
    with pytest.raises(OSError, match=f"{mine} is not this user's private folder"):
        CacheFolder.open(base)
    assert load(base) is None and len(built) == 1


def test_a_cache_dir_owned_by_another_user(built, load, tmp_path, monkeypatch, caplog):
    base = tmp_path / "theirs"
    base.mkdir()
    base.chmod(0o755)  # writable by its owner alone, but not this user's
    _give_away(monkeypatch, base)
    k = load(base)  # this user's private folder in it
    mine = base / f"user-{os.getuid()}"
    assert k is not None and k.path.parent == mine
    _give_away(monkeypatch, mine)  # a folder of that name that another user made: refused
    with caplog.at_level("WARNING", logger="aiayn.kernels.loader"):
        assert load(base) is None
    assert f"{mine} is not this user's private folder" in caplog.text and len(built) == 1


def test_a_cache_on_a_noexec_file_system_is_refused_before_building(built, load, tmp_path, monkeypatch, caplog):
    """No library on a file system mounted noexec (Docker's /dev/shm, a hardened /tmp) can be loaded:
    one warning naming the folder, no build (else every process would compile and fail again)."""
    real = os.fstatvfs

    def noexec(fd):
        st = real(fd)
        return os.statvfs_result((*st[:8], st.f_flag | os.ST_NOEXEC, *st[9:]))
    monkeypatch.setattr(os, "fstatvfs", noexec)
    base = tmp_path / "cache"
    with caplog.at_level("WARNING", logger="aiayn.kernels.loader"):
        assert load(base) is None
    assert len(caplog.messages) == 1 and f"{base} is on a file system mounted noexec" in caplog.text
    assert not built


def test_a_checksum_that_does_not_match_means_a_rebuild(built, load, tmp_path, caplog):
    base = tmp_path / "cache"
    k = load(base)
    record = k.path.with_name(k.path.name + ".sha256")
    record.write_text("0" * 64 + "\n")
    with CacheFolder.open(base) as cache:
        lib, why = cache.load(k.path.name)
    assert lib is None and why.startswith("damaged")
    with caplog.at_level("WARNING", logger="aiayn.kernels.loader"):
        assert load(base) is not None and len(built) == 2
    assert "building it again" in caplog.text
    assert record.read_text().strip() == hashlib.sha256(k.path.read_bytes()).hexdigest()


def test_leftovers_of_killed_builds_are_removed(tmp_path, monkeypatch):
    base = tmp_path / "cache"
    with CacheFolder.open(base):
        pass
    old = time.time() - build_cache.LEFTOVER_AGE_S - 60

    def make(name, kind="file", age=old):
        p = base / name
        if kind == "file":
            p.write_bytes(b"half a library")
        elif kind == "dir":
            p.mkdir()
        else:
            p.symlink_to(tmp_path / "target")
        os.utime(p, (age, age), follow_symlinks=False)
        return p
    (tmp_path / "target").write_bytes(b"kept")
    gone = [make("tmp0123456789abcdef.so"), make("tmpab_c9xyz.so"), make("tmpab_c9xyz.sha256")]
    kept = [make("tmpfedcba9876543210.so", age=time.time()),  # a build at work
            make("tmpdir.so", "dir"), make("tmplink.so", "link"), make("aiayn-kernels-0123.so"),
            make("tmptheirs.so")]
    _give_away(monkeypatch, kept[-1])
    with CacheFolder.open(base) as cache:
        assert sorted(cache.remove_leftovers()) == sorted(p.name for p in gone)
    assert not any(os.path.lexists(p) for p in gone) and all(os.path.lexists(p) for p in kept)
    assert (tmp_path / "target").read_bytes() == b"kept"
