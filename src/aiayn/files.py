"""Files and folders written atomically: a kill at any moment leaves the old one or the new one,
never a torn one (data directories, checkpoints, exports, run summaries all go through here).

A file is written to ``.NAME.aiayn-tmp-XXXXXXXX`` beside it, a folder built in
``.NAME.aiayn-tmp-XXXXXXXX`` beside it, then renamed into place (XXXXXXXX: tempfile's random
token). Every temporary is locked (``flock``) by its writer from the moment it is made until it
is renamed into place or deleted, so the kernel says which writer is still at work: what a killed
writer leaves behind (those names, and the ``.NAME.aiayn-old-XXXXXXXX`` of a folder being replaced)
is unlocked, and the next write of the same NAME deletes it at once (``remove_leftovers``), however
young, while a temporary of a concurrent writer is left alone. Only names that carry aiayn's mark
and that output's name are touched, never a name a person chose such as ``.bashrc.old-20240101``. A folder is replaced only if it is empty or, when asked, one the same
command wrote (``OutputDir``): no command deletes what aiayn did not write.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Collection, Iterable

from aiayn.errors import UserError

log = logging.getLogger(__name__)

# the temporaries of atomic_write and OutputDir (".NAME.aiayn-tmp-XXXXXXXX") and of a folder
# being replaced (".NAME.aiayn-old-XXXXXXXX"); XXXXXXXX is tempfile's 8 random characters
TMP_MARK, OLD_MARK = ".aiayn-tmp-", ".aiayn-old-"
_TOKEN = r"[a-z0-9_]{8}"
LEFTOVER = re.compile(rf"^\..+(?:{re.escape(TMP_MARK)}|{re.escape(OLD_MARK)}){_TOKEN}$")  # any output's
_TEMPORARY_TRIES = 100  # times a writer makes its temporary again when a remover took it before it was locked


def temporary_prefix(path: str | Path, mark: str = TMP_MARK) -> str:
    """The start of the name of a temporary of ``path`` (tempfile adds the random token)."""
    return f".{Path(path).name}{mark}"


def leftovers_of(name: str) -> re.Pattern:
    """The names of the temporaries of the output ``name`` (``LEFTOVER``, for that name alone)."""
    return re.compile(rf"^\.{re.escape(name)}(?:{re.escape(TMP_MARK)}|{re.escape(OLD_MARK)}){_TOKEN}$")


def current_umask() -> int:
    """The process's umask: from /proc/self/status on Linux (no window in which another thread
    would create files under a changed one), else by setting it and setting it back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def locked_temporary(path: str | Path, mark: str = TMP_MARK, *, folder: bool) -> tuple[Path, int]:
    """A new temporary of ``path`` beside it (a file, or with ``folder`` a folder), made and locked
    (an exclusive ``flock``, which the kernel drops when the writer ends, however it ends): its
    path and the descriptor that holds the lock. ``remove_leftovers`` in another process deletes
    any temporary it finds unlocked; one it took in the moment between making and locking is made
    anew, so a writer never works in a temporary that is gone."""
    path = Path(path)
    for _ in range(_TEMPORARY_TRIES):
        if folder:
            tmp = tempfile.mkdtemp(prefix=temporary_prefix(path, mark), dir=path.parent)
            try:
                fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue
        else:
            fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(path, mark), dir=path.parent)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            st, held = os.stat(tmp, follow_symlinks=False), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
                return Path(tmp), fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OSError(errno.EAGAIN, "temporaries deleted as soon as made", str(path))


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write`` on a temporary file in the same directory, fsync, then rename over ``path``.

    A kill at any moment leaves either the old file or the new one, never a torn file. The file
    gets the permissions ``open`` would give it (0666 less the umask), not the temporary's 0600.
    The temporary is locked until renamed (``locked_temporary``).
    """
    path = Path(path)
    remove_leftovers(path.parent, path.name)
    tmp, fd = locked_temporary(path, folder=False)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # before the lock goes with the descriptor
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """Make the renames in ``folder`` durable (fsync of the folder), where the system allows it."""
    try:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """JSON through ``atomic_write``: a reader never sees half a file."""
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def remove_leftovers(folder: str | Path, name: str) -> list[Path]:
    """Delete what interrupted atomic writes of the output ``name`` left in ``folder``: entries
    named as ``leftovers_of(name)`` (files or folders, never links), owned by this user and not
    locked by a writer still at work (every writer holds a ``flock`` on its temporary from the
    moment it is made, ``locked_temporary``; a killed one holds none). Returns what it deleted."""
    removed: list[Path] = []
    ours = leftovers_of(name)
    try:
        entries = [e for e in os.scandir(folder) if ours.match(e.name)]
    except OSError:
        return removed
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        is_dir = stat.S_ISDIR(st.st_mode)
        if not (is_dir or stat.S_ISREG(st.st_mode)) or st.st_uid != os.geteuid():
            continue
        try:
            fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if is_dir else 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            now, held = os.stat(e.path, follow_symlinks=False), os.fstat(fd)
            if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
                continue
            if is_dir:
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                os.unlink(e.path)
            removed.append(Path(e.path))
        except OSError:  # locked: a writer is still at work on it (or it is gone already)
            continue
        finally:
            os.close(fd)
    if removed:
        log.info("%s: removed %d unfinished file(s) of earlier writes: %s", folder, len(removed),
                 ", ".join(p.name for p in removed))
    return removed


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def exchange(a: str | Path, b: str | Path) -> bool:
    """Swap the entries ``a`` and ``b`` in one step (Linux's ``renameat2(RENAME_EXCHANGE)``): no
    moment without either. False where the system or the file system cannot."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(new: str | Path, out: str | Path) -> None:
    """Put the folder ``new`` at ``out``; an existing ``out`` is swapped out in one step where the
    system allows it (else moved aside just before), then deleted."""
    new, out = Path(new), Path(out)
    if not os.path.lexists(out):
        os.rename(new, out)
    elif exchange(new, out):
        shutil.rmtree(new, ignore_errors=True)  # the old one, now at the temporary's name
    else:
        old, fd = locked_temporary(out, OLD_MARK, folder=True)
        try:
            os.replace(out, old / "d")
            os.replace(new, out)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            os.close(fd)
    _sync_folder(out.parent)


def check_output_folder(path: str | Path) -> None:
    """Refuse (a UserError), before any work, an output file whose folder is not there or cannot be
    written: the file is written at the end, and the work done by then would be lost."""
    folder = Path(path).parent
    if not folder.is_dir():
        raise UserError(f"{path}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{path}: its folder {folder} is not writable")


def check_output_file(path: str | Path, overwrite: bool = False) -> None:
    """Refuse (a UserError) an output file that exists, unless ``overwrite``: the writer then
    replaces it in one step (``atomic_write``). Anything but a regular file there is refused, and
    so is a folder that is not there or not writable (``check_output_folder``)."""
    path = Path(path)
    if not os.path.lexists(path):
        check_output_folder(path)
        return
    if path.is_symlink() or not path.is_file():
        raise UserError(f"{path}: exists and is not a regular file; choose another --out")
    if not overwrite:
        raise UserError(f"{path}: already exists (pass --overwrite to replace it)")


def check_ancestors(path: str | Path) -> None:
    """Refuse (a UserError), before any work, a ``path`` to create below something that is not a
    folder: its nearest existing ancestor must be one (``--out FILE/sub`` fails here, not after the work)."""
    path = Path(path)
    for parent in path.absolute().parents:
        if os.path.lexists(parent):
            if not parent.is_dir():
                raise UserError(f"{path}: {parent} is not a folder; choose another path")
            return


def check_output_path(path: str | Path, option: str = "--out") -> None:
    """Refuse (a UserError), before the work, an output file ``path`` that is a folder or lies below
    something that is not one (``check_ancestors``); the writer (``write_output``) makes missing folders."""
    if os.path.isdir(path):
        raise UserError(f"{option} {path}: a folder; name a file to write")
    check_ancestors(path)


def refuse_inputs_inside(out: str | Path, inputs: Iterable[str | Path | None], option: str = "--out") -> None:
    """Refuse (a UserError) a folder ``out`` that holds one of the command's ``inputs`` (at any depth,
    links resolved): the command replaces or empties ``out``, which would delete what it reads."""
    try:
        there = Path(out).resolve()
    except OSError:
        return
    for given in inputs:
        if given is None:
            continue
        try:
            path = Path(given).resolve()
        except OSError:
            continue
        if path == there or there in path.parents:
            raise UserError(f"{option} {out}: holds the input {given}, which writing there would delete; "
                            f"choose another {option} or move the input")


def refuse_input_as_output(out: str | Path | None, inputs: Iterable[str | Path | None], option: str = "--out") -> None:
    """Refuse (a UserError) an output file that is one of the command's ``inputs``: the same file
    by inode (``os.path.samefile``), so another path or a link to it counts. Writing it would
    replace what the command reads. Inputs that are None or not there are passed over."""
    if out is None or not os.path.exists(out):
        return
    for given in inputs:
        if given is None:
            continue
        try:
            same = os.path.samefile(out, given)
        except OSError:
            continue
        if same:
            raise UserError(f"{option} {out}: the same file as the input {given}; choose another {option}")


def write_output(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """An output file a person named, written whole: through ``atomic_write`` (a kill leaves the
    old file or the new one; a link there is replaced, not written through), or straight into a
    path that names no regular file (``/dev/stdout``, a FIFO). A failure is a UserError naming
    the file."""
    path = Path(path)
    try:
        if os.path.exists(path) and not os.path.isfile(path):
            if os.path.isdir(path):
                raise UserError(f"{path}: a folder; name a file to write")
            with open(path, "wb") as f:
                write(f)
            return
        atomic_write(path, write)
    except OSError as exc:
        raise UserError(f"{path}: cannot write ({exc.strerror})") from None


def write_text_output(path: str | Path, text: str) -> None:
    """UTF-8 ``text`` to the output file ``path`` (``write_output``)."""
    write_output(path, lambda f: f.write(text.encode("utf-8")))


UNPACK_RATIO = 10  # bytes an archive may give per byte of its own (text compresses 3 to 5 times)
UNPACK_SLACK = 64 << 20  # bytes every archive may give besides (a small archive of small files)


class UnpackBound:
    """What one archive may give when its members are extracted or read whole: ``UNPACK_RATIO``
    times its own size and ``UNPACK_SLACK`` more, counted from the sizes the members declare,
    before any is read (tarfile and zipfile give no more than a member declares). A member past
    it is a UserError naming the archive and the member: a decompression bomb fills no disk and
    no memory."""

    def __init__(self, archive: str | Path):
        self.archive = Path(archive)
        self.left = UNPACK_RATIO * self.archive.stat().st_size + UNPACK_SLACK

    def take(self, member: str, size: int) -> None:
        """Count ``size`` bytes of ``member`` against the bound; refuse them past it."""
        if size > self.left:
            raise UserError(f"{self.archive}: {member} unpacks to more than the {self.left:,} bytes this archive "
                            f"may still give ({UNPACK_RATIO} times its size and {UNPACK_SLACK >> 20} MiB in all); "
                            f"is it the archive it should be?")
        self.left -= size


def _holds_cwd(path: Path) -> bool:
    try:
        here, there = Path.cwd().resolve(), path.resolve()
    except OSError:
        return False
    return here == there or there in here.parents


def _check_writable(out: Path) -> None:
    """Refuse (a UserError), before the work, an output folder ``out`` whose temporary cannot be made
    beside it: its parent, or where that is still to be made, the nearest folder above that exists,
    must be writable."""
    folder = next((p for p in out.absolute().parents if os.path.lexists(p)), None)
    if folder is not None and not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{out}: its folder {folder} is not writable; choose another --out")


class OutputDir:
    """A folder a command writes whole: built in a temporary folder beside ``out`` (the context's
    value) and put in place in one step once complete; removed on error, so a failed command
    leaves ``out`` as it was.

    An existing ``out`` must be empty, or, with ``overwrite``, ``what`` the same command wrote
    (``ours(out)``); anything else is refused, even with ``overwrite``: aiayn never deletes a
    folder it did not write. ``finish(tmp)`` (for subclasses) checks or completes the folder
    before it is put in place."""

    def __init__(self, out: str | Path, *, overwrite: bool = False, ours: Callable[[Path], bool], what: str):
        self.out, self.overwrite, self.ours, self.what = Path(out), overwrite, ours, what
        self.tmp: Path | None = None
        self._lock: int | None = None

    def check(self) -> None:
        """Refuse an ``out`` this command may not replace (a UserError saying why); call it early,
        before the work, as well (``__enter__`` and the final rename check again)."""
        out = self.out
        if not os.path.lexists(out):
            check_ancestors(out)
            _check_writable(out)
            return
        if out.is_symlink() or not out.is_dir():
            raise UserError(f"{out}: exists and is not a folder; choose another --out")
        if _holds_cwd(out):
            raise UserError(f"{out}: holds the current directory; choose another --out")
        if any(out.iterdir()):
            if not self.ours(out):
                raise UserError(f"{out}: not empty and not {self.what} (aiayn replaces only what it wrote); "
                                f"choose another --out")
            if not self.overwrite:
                raise UserError(f"{out}: already exists and holds {self.what} (pass --overwrite to replace it)")
        _check_writable(out)

    def finish(self, tmp: Path) -> None:
        """Called on success, before ``tmp`` is put in place."""

    def __enter__(self) -> Path:
        self.check()
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            remove_leftovers(self.out.parent, self.out.name)
            self.tmp, self._lock = locked_temporary(self.out, folder=True)  # in use: ``remove_leftovers`` leaves it alone
        except OSError as exc:  # what the access check cannot see (a file system that refuses even root)
            raise UserError(f"{self.out}: cannot write its folder {self.out.parent} ({exc.strerror or exc}); "
                            f"choose another --out") from None
        os.chmod(self.tmp, 0o777 & ~current_umask())  # mkdtemp's 0700 is for the temporary only
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        assert self.tmp is not None and self._lock is not None
        try:
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return False
            try:
                self.finish(self.tmp)
                self.check()  # again: something may have appeared there meanwhile
                replace_dir(self.tmp, self.out)
            except BaseException:
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise
        finally:
            os.close(self._lock)
            self._lock = None
        return False


def claim_folder(out: str | Path, names: Collection[str], *, overwrite: bool = False, what: str) -> Path:
    """The folder ``out`` of a command that fills it step by step and resumes there (the demos):
    created when absent; when it holds only ``names`` (and aiayn's temporaries, ``LEFTOVER``) it
    is this command's, resumed, or with ``overwrite`` started afresh (swapped for an empty folder
    in one step, the old one then deleted). Anything else is refused: a UserError naming what
    the command did not write."""
    out = Path(out)
    check_ancestors(out)
    if os.path.lexists(out):
        if out.is_symlink() or not out.is_dir():
            raise UserError(f"{out}: exists and is not a folder; choose another --out")
        foreign = sorted(p.name for p in out.iterdir() if p.name not in names and not LEFTOVER.match(p.name))
        if foreign:
            raise UserError(f"{out}: holds files that {what} did not write ({', '.join(foreign[:5])}"
                            f"{', ...' if len(foreign) > 5 else ''}); choose another --out")
        if overwrite and any(out.iterdir()):
            if _holds_cwd(out):
                raise UserError(f"{out}: holds the current directory; choose another --out")
            fresh, fd = locked_temporary(out, folder=True)
            try:
                os.chmod(fresh, 0o777 & ~current_umask())
                replace_dir(fresh, out)
            finally:
                os.close(fd)
            log.info("%s: started afresh (--overwrite); the earlier run's files are deleted", out)
    out.mkdir(parents=True, exist_ok=True)
    return out
