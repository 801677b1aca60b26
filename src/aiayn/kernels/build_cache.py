"""The folder where the compiled kernels are kept (``loader.load``), handled so that no one else can slip
in a library: the cache directory and this user's folder are opened once (O_DIRECTORY | O_NOFOLLOW) and
checked on the open descriptor (this user's, a real directory, writable by no one else), and every later
step names its files relative to that descriptor (``dir_fd``), never by a path another user could rename.

The compiler never writes into the cache: it writes into a fresh private temporary directory (mkdtemp,
0700), and ``install`` copies the result through the folder's descriptor into a new file (O_CREAT |
O_EXCL | O_NOFOLLOW, its mode set with fchmod), renamed over the library's name, with the SHA-256 of
the bytes it copied recorded beside it the same way. ``load`` opens the library and its record with
O_NOFOLLOW, checks the open files and loads the library through ``/proc/self/fd``, so a symbolic link in
the cache is neither followed nor written through (a rebuild renames a new file over the link). A cache
directory that is a symbolic link, or a folder of this user's that another user owns or could write, or
one on a file system mounted noexec, is refused: ``loader.load`` logs the path and why, and decoding and
training use PyTorch's operations.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)

NOT_BUILT = "not built"
# temporaries of ``install`` ("tmp" + 16 hex digits + ".so" or ".sha256"), and the mkstemp names
# ("tmp" + 8 characters) that earlier versions of this cache used
LEFTOVER = re.compile(r"^tmp[a-z0-9_]+\.(?:so|sha256)$")
LEFTOVER_AGE_S = 600.0  # an ``install`` in another process holds its temporary for a moment only


def cache_dir() -> Path:
    """Where compiled kernels live: $AIAYN_CACHE_DIR, else $XDG_CACHE_HOME/aiayn, else ~/.cache/aiayn."""
    if os.environ.get("AIAYN_CACHE_DIR"):
        return Path(os.environ["AIAYN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aiayn"


def _private(st: os.stat_result) -> bool:
    """Owned by this user and writable by no one else."""
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _open_dir(name: str | Path, shown: Path, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """An open descriptor of the directory ``name`` (relative to ``dir_fd``), never through a symbolic
    link, and its fstat; OSError naming ``shown`` otherwise."""
    if stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode):
        raise OSError(f"{shown} is a symbolic link: the kernel cache must be a real directory "
                      "(set AIAYN_CACHE_DIR to the directory itself)")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except NotADirectoryError:
        raise OSError(f"{shown} is not a directory") from None
    return fd, os.fstat(fd)


class CacheFolder:
    """This user's folder of compiled kernels, open: ``load`` a library, ``install`` a new one,
    ``remove_leftovers`` of builds that were killed. A context manager that closes the descriptor."""

    def __init__(self, fd: int, path: Path):
        self.fd = fd
        self.path = path  # for messages only: every operation goes through ``fd``

    @classmethod
    def open(cls, base: Path) -> "CacheFolder":
        """``base`` (created 0700 if missing) if it is this user's alone; else (a directory shared between
        users, or another user's) this user's folder ``user-UID`` in it, created 0700. OSError, naming
        the path, if ``base`` or that folder is a symbolic link, or the folder is not this user's alone."""
        try:
            os.makedirs(base, mode=0o700)  # the cache private; its parents as the umask makes them
        except FileExistsError:
            pass
        fd, st = _open_dir(base, base)
        if _private(st):
            return cls._executable(fd, base)
        name = f"user-{os.getuid()}"
        mine = base / name
        try:
            try:
                os.mkdir(name, mode=0o700, dir_fd=fd)
            except FileExistsError:
                pass
            sub, st = _open_dir(name, mine, dir_fd=fd)
        except OSError as e:
            if e.filename != name:
                raise
            raise OSError(f"{mine}: {e.strerror}") from None
        finally:
            os.close(fd)
        if not _private(st):
            os.close(sub)
            raise OSError(f"{mine} is not this user's private folder (owner uid {st.st_uid}, "
                          f"mode {stat.filemode(st.st_mode)}): refused")
        return cls._executable(sub, mine)

    @classmethod
    def _executable(cls, fd: int, path: Path) -> "CacheFolder":
        """The folder open as ``fd``, unless its file system is mounted noexec (Docker's /dev/shm, a
        hardened /tmp or home): no library there could be loaded, and each process would build it again."""
        if os.fstatvfs(fd).f_flag & getattr(os, "ST_NOEXEC", 0):
            os.close(fd)
            raise OSError(f"{path} is on a file system mounted noexec, where no library can be loaded; "
                          "set AIAYN_CACHE_DIR to a folder on another")
        return cls(fd, path)

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "CacheFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open_private(self, name: str) -> int:
        """``name`` opened for reading if it is a regular file of this user's that no one else can
        write; FileNotFoundError if there is none, else OSError saying why not."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self.fd)
        except OSError as e:
            if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link
                raise OSError("a symbolic link (not followed)") from None
            raise
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and _private(st):
            return fd
        os.close(fd)
        raise OSError("not a regular file" if not stat.S_ISREG(st.st_mode)
                      else "owned by another user or writable by others")

    def load(self, name: str) -> tuple[ctypes.CDLL | None, str]:
        """(the library ``name``, "") if it and its recorded SHA-256 (``name.sha256``) are regular files
        of this user's alone and its bytes match; else (None, why), ``NOT_BUILT`` if there is none. The
        checks and the dlopen read one open file (no swap in between)."""
        try:
            fd = self._open_private(name)
        except FileNotFoundError:
            return None, NOT_BUILT
        except OSError as e:
            return None, str(e)
        try:
            try:
                with os.fdopen(self._open_private(name + ".sha256"), "rb") as f:
                    want = f.read(128).decode("ascii", "replace").strip()
            except FileNotFoundError:
                return None, "no recorded checksum (a build cut short?)"
            except OSError as e:
                return None, f"its recorded checksum: {e}"
            h = hashlib.sha256()
            with os.fdopen(os.dup(fd), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            if h.hexdigest() != want:
                return None, "damaged (its bytes do not match the checksum recorded when it was built)"
            proc = f"/proc/self/fd/{fd}"
            if not os.path.exists(proc):
                return None, "no /proc/self/fd to load the checked file through"
            try:
                return ctypes.CDLL(proc), ""
            except OSError as e:
                return None, str(e)
        finally:
            os.close(fd)

    def install(self, name: str, built: Path) -> None:
        """Copy the library ``built`` (in a private temporary directory) in as ``name`` (mode 0755), and
        the SHA-256 of the bytes copied as ``name.sha256`` (0644); each renamed over its name at once."""
        h = hashlib.sha256()

        def blocks() -> Iterable[bytes]:
            with open(built, "rb", opener=lambda p, fl: os.open(p, fl | os.O_NOFOLLOW)) as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
                    yield block
        self._replace(name, ".so", 0o755, blocks())
        self._replace(name + ".sha256", ".sha256", 0o644, [(h.hexdigest() + "\n").encode()])

    def _replace(self, name: str, suffix: str, mode: int, blocks: Iterable[bytes]) -> None:
        """Write ``blocks`` to a new file ``tmp*suffix`` of this folder, set its mode, rename it to ``name``."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        while True:
            tmp = f"tmp{secrets.token_hex(8)}{suffix}"
            try:
                fd = os.open(tmp, flags, 0o600, dir_fd=self.fd)
                break
            except FileExistsError:
                continue
        try:
            with os.fdopen(fd, "wb") as f:
                for block in blocks:
                    f.write(block)
                os.fchmod(f.fileno(), mode)  # whatever the umask: writable by its owner only (``load`` checks)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            raise

    def remove_leftovers(self, min_age_s: float = LEFTOVER_AGE_S) -> list[str]:
        """Delete the temporaries that killed builds left here: names as ``LEFTOVER``, regular files of
        this user's, unchanged for ``min_age_s`` seconds (links and anything else are left alone). Returns
        the names deleted."""
        removed = []
        now = time.time()
        for name in os.listdir(self.fd):
            if not LEFTOVER.match(name):
                continue
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and now - st.st_mtime >= min_age_s:
                    os.unlink(name, dir_fd=self.fd)
                    removed.append(name)
            except OSError:
                continue
        if removed:
            log.info("%s: removed %d leftover temporaries of killed builds", self.path, len(removed))
        return removed
