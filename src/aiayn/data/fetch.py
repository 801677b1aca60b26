"""Downloads that check themselves, for the data sets the commands fetch when they are not found
on this machine (``aiayn.data.multi30k``) and the WMT14 archives (``aiayn.data.wmt14``).

One file at a time: an HTTP(S) GET into ``FILE.part`` beside its destination; a ``.part`` left by
an interrupted run is resumed with a ``Range`` request (started over if the server ignores it);
a write that fails (a full disk) is a one-line ``WriteError`` naming ``FILE.part``, kept to resume;
the whole file's SHA-256 is compared with the pinned one, and only then is ``FILE.part`` renamed
to ``FILE``. A mismatch removes ``FILE.part`` and is a one-line ``UserError`` naming the file and
both checksums, so no half-written or wrong file is ever left under the real name. A file already
under its name is kept (it was checked when it got it) if its size is the pinned one.

Bounds, whatever the server says: no more than the pinned size is written (a server that sends
more is refused, ``FILE.part`` removed), each file has an overall deadline as well as the
per-read timeout (at least ``MIN_RATE`` on average; ``FILE.part`` is kept to resume), and a
``FILE.part`` that is a symbolic link or not a regular file is refused, never written through.

A mirror may be a local folder as well as a URL (``mirror_url``).

Where no published source gives a file's size or SHA-256, the pin leaves it out: the size the
server sends then stands in for it, a published MD5 for the SHA-256 (a weaker check), and a file
with neither checksum is kept unverified; a warning says which, never silence.
"""
from __future__ import annotations

import errno
import hashlib
import http.client
import logging
import os
import socket
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from aiayn import __version__
from aiayn.errors import UserError, WriteError
from aiayn.progress import progress_bar

log = logging.getLogger(__name__)

BLOCK = 1 << 16  # bytes read and hashed at a time
UNPINNED_MAX = 1 << 30  # bytes a file with no pinned size may have (WMT14's dev.tgz and test-full.tgz: a few MB)
MIN_RATE = 1 << 16  # bytes per second a download keeps on average, else it is stopped (resumable)
DEADLINE_BASE_S = 300.0  # seconds every file gets on top of its bytes at ``MIN_RATE``


@dataclass(frozen=True)
class Pinned:
    """One file of a data set: its path below the base URL, its path below the local folder, and
    its size and SHA-256 as the source serves it (None and "" where none is published; ``md5``
    then checks it, where one is)."""

    remote: str
    local: str
    size: int | None
    sha256: str
    md5: str = ""


def digest_of(path: Path, algorithm: str = "sha256") -> str:
    """The hex digest of the file ``path`` by ``algorithm`` (a ``hashlib`` name)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def sha256_of(path: Path) -> str:
    return digest_of(path, "sha256")


def mirror_url(base: str) -> str:
    """``base`` as a URL ending in "/": a URL as it is (``file:/path`` too, a file URL without "//"),
    a local folder (no "scheme://") as its file: URL."""
    if "://" not in base and not base.startswith("file:"):
        base = Path(base).expanduser().absolute().as_uri()
    return base if base.endswith("/") else base + "/"


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _open(url: str, start: int, timeout: float, env: str):
    """The response to a GET of ``url`` from byte ``start``; None when the server's file ends
    before ``start`` (HTTP 416: it is not the file a ``.part`` that long began). ``env``: the
    variable that names a mirror, for the error when there is no connection."""
    headers = {"User-Agent": f"aiayn/{__version__}"}
    if start:
        headers["Range"] = f"bytes={start}-"
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and start:
            return None
        raise UserError(f"{url}: HTTP {exc.code} {_one_line(exc.reason)}") from None
    except http.client.HTTPException as exc:  # a server that does not speak HTTP there (another port's)
        raise UserError(f"{url}: not an HTTP answer ({type(exc).__name__}: {_one_line(exc)[:200]}); is it the "
                        f"mirror's address? (${env})") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if url.startswith("file:"):  # a local folder as the mirror: no network involved
            path = urllib.request.url2pathname(urllib.parse.urlsplit(url).path)
            if isinstance(reason, FileNotFoundError):
                raise UserError(f"{path}: no such file in the mirror folder (it holds the files under the "
                                f"paths of the data set's repository)") from None
            raise UserError(f"{path}: cannot read ({_one_line(getattr(reason, 'strerror', None) or reason)})") from None
        raise UserError(f"{url}: cannot connect ({_one_line(reason)}); check the network, or set ${env} to a mirror") from None


def _served_size(resp) -> int | None:
    """The size of the whole file as the response gives it (Content-Range's, else Content-Length)."""
    if resp.status == 206:
        total = (resp.headers.get("Content-Range") or "").rpartition("/")[2]
        return int(total) if total.isdigit() else None
    length = resp.headers.get("Content-Length")
    return int(length) if length and length.isdigit() else None


def _part_size(part: Path) -> int:
    """The bytes in ``part`` (0 when there is none); a link or anything but a regular file there
    is a UserError: a download is written only to a file of its own, never through a link."""
    try:
        st = os.lstat(part)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise UserError(f"{part}: {what}; a download is written only to a file of its own (remove it and run again)")
    return st.st_size


def _open_part(part: Path, append: bool):
    """``part`` opened to append (else truncated), never through a link (``O_NOFOLLOW``) and only
    if it is a regular file (``O_NONBLOCK``: a FIFO planted there does not hang the open);
    unbuffered, so a failed write fails in ``_write`` and no bytes wait in memory."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(part, flags, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            _part_size(part)  # names what is there
        raise UserError(f"{part}: cannot write ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        _part_size(part)
        raise UserError(f"{part}: not a regular file; remove it and run again")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab" if append else "wb", buffering=0)


def _write(f, block: bytes, part: Path) -> None:
    """All of ``block`` appended to ``part`` (``f``); a write that fails (a full disk, a file-size
    limit) is a WriteError: what ``part`` holds is a beginning of the file, kept to resume."""
    view = memoryview(block)
    try:
        while view:
            view = view[f.write(view):]
    except OSError as exc:
        raise WriteError(f"{part}: cannot write ({exc.strerror or exc}); the bytes so far are kept: free some "
                         f"space and run the same command again to resume it, or give another --out "
                         f"(or $AIAYN_CACHE)") from None


def _deadline_s(nbytes: int) -> float:
    """Seconds a download of ``nbytes`` may take in all: ``DEADLINE_BASE_S`` and ``MIN_RATE``'s time."""
    return DEADLINE_BASE_S + nbytes / MIN_RATE


def _receive(resp, part: Path, start: int, name: str, quiet: bool, limit: int, deadline_s: float) -> int:
    """Append the body of ``resp`` to ``part`` (from byte 0 when the server ignored the range, or
    answered it from byte 0); returns the bytes now in ``part``. A connection that breaks ends the
    body early; a write that fails is a WriteError (``_write``). At most ``limit`` bytes are ever
    in ``part``: a body that goes on past them is a UserError (``part`` removed); so is one that
    takes more than ``deadline_s`` seconds (checked after each read; ``part`` kept, to resume)."""
    if start and (resp.status != 206 or (resp.headers.get("Content-Range") or "").startswith("bytes 0-")):
        start = 0  # a 200 to a Range request, or a 206 from byte 0: the whole file again
    read = getattr(resp, "read1", resp.read)  # one receive a call: a trickle cannot hold a read past the deadline
    end = time.monotonic() + deadline_s
    more, late = b"", False
    with _open_part(part, append=bool(start)) as f, \
            progress_bar(total=_served_size(resp), initial=start, unit="B", unit_scale=True, desc=name, quiet=quiet) as bar:
        have = start
        try:
            while have < limit and not (late := time.monotonic() > end) and (block := read(min(BLOCK, limit - have))):
                _write(f, block, part)
                have += len(block)
                bar.update(len(block))
            more = have >= limit and read(1)
        except (http.client.HTTPException, socket.timeout, OSError) as exc:
            log.debug("%s: read failed: %r", name, exc)
    if more:
        part.unlink(missing_ok=True)
        raise UserError(f"{name}: {resp.url} sends more than the {limit:,} bytes this file may have; "
                        f"nothing is kept")
    if late:
        raise UserError(f"{name}: {resp.url} sent {have - start:,} bytes in {deadline_s:g} s, the time this "
                        f"file may take; run the same command again to resume it ({part} is kept)")
    return have


def fetch(url: str, dest: Path, pinned: Pinned, *, quiet: bool = False, timeout: float = 30.0,
          deadline_s: float | None = None, env: str = "AIAYN_DATA_URL") -> Path:
    """``dest`` downloaded from ``url`` and checked against ``pinned.sha256`` (``pinned.md5`` where
    no SHA-256 is pinned; ``pinned``'s own paths are not read: ``url`` and ``dest`` are the full
    ones); an existing ``dest`` is kept as it is if it has ``pinned.size`` bytes (it was checked
    when it was written), and a folder there is refused before any byte is fetched. ``pinned.size``:
    the file's bytes (None: the server's word, up to ``UNPINNED_MAX``); a server that gives another
    size is a mismatch (the ``.part`` removed), one that sends more is refused; a longer ``.part`` is
    started over. ``timeout``: seconds per read; ``deadline_s``: for the whole download (default:
    ``DEADLINE_BASE_S`` and ``MIN_RATE``'s time)."""
    sha256, size, md5 = pinned.sha256, pinned.size, pinned.md5
    if dest.is_dir() or (os.path.lexists(dest) and not dest.is_file() and not dest.is_symlink()):
        # (the download could not take its name; a dangling link is replaced)
        raise UserError(f"{dest}: exists and is not a file; remove it (or give another --out, or $AIAYN_CACHE) "
                        f"and run again")
    if dest.is_file():
        kept = dest.stat().st_size
        if size is not None and kept != size:
            raise UserError(f"{dest}: {kept:,} bytes, expected {size:,}: not the pinned file; remove it and run "
                            f"again to download it")
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # below a file, no permission, a read-only disk
        raise UserError(f"{dest.parent}: cannot make the download's folder ({exc.strerror}); give another "
                        f"--out (or $AIAYN_CACHE)") from None
    part = dest.with_name(dest.name + ".part")
    start = _part_size(part)
    limit = size if size is not None else UNPINNED_MAX
    if start > limit:  # not a beginning of the pinned file: start over
        part.unlink()
        start = 0
    have, total = start, size
    if size is None or start < size:
        resp = _open(url, start, timeout, env)
        served = None if resp is None else _served_size(resp)
        if resp is not None and size is None and served is not None and served > limit:
            resp.close()
            raise UserError(f"{dest.name}: {url} serves {served:,} bytes, more than the {limit:,} a file without "
                            f"a pinned size may have; nothing is kept")
        if size is not None and (resp is None or served not in (None, size)):  # another file than the pinned one
            if resp is not None:
                resp.close()
            part.unlink(missing_ok=True)
            what = f"fewer than {start:,}" if resp is None else f"{served:,}"
            raise UserError(f"{dest.name}: {url} serves {what} bytes, expected {size:,} with SHA-256 {sha256}; "
                            f"nothing is kept")
        if resp is not None:  # (None with no pinned size: the .part is the whole file; its checksum decides)
            with resp:
                deadline = deadline_s if deadline_s is not None else _deadline_s(limit - start)
                have = _receive(resp, part, start, dest.name, quiet, limit, deadline)
            total = size if size is not None else served
    if total is not None and have < total:
        raise UserError(f"{url}: the download stopped after {have:,} of {total:,} bytes; run the same command "
                        f"again to resume it ({part} is kept)")
    _check(part, dest.name, url, sha256, md5)
    os.replace(part, dest)
    return dest


def _check(part: Path, name: str, url: str, sha256: str, md5: str) -> None:
    """``part`` against its pinned SHA-256, else its MD5; a mismatch removes it and is an error.
    A file checked by MD5 alone, or by nothing (none published), is kept with a warning saying so."""
    if not (sha256 or md5):
        log.warning("%s: no checksum is published for it; kept UNVERIFIED (from %s)", name, url)
        return
    algorithm, label, expected = ("sha256", "SHA-256", sha256) if sha256 else ("md5", "MD5", md5)
    actual = digest_of(part, algorithm)
    if actual != expected:
        part.unlink()
        raise UserError(f"{name}: {label} {actual}, expected {expected} (from {url}); the download is removed")
    if not sha256:
        log.warning("%s: checked by its MD5 only (no SHA-256 is published for it)", name)


def fetch_all(base_url: str, files: list[Pinned], root: Path, *, quiet: bool = False,
              env: str = "AIAYN_DATA_URL") -> list[Path]:
    """Every one of ``files`` under ``root``, each from ``base_url`` (a URL or a local folder,
    ``mirror_url``) + its remote path (``env``: the variable that replaces ``base_url``, named when
    there is no connection)."""
    base = mirror_url(base_url)
    return [fetch(base + f.remote, root / f.local, f, quiet=quiet, env=env) for f in files]
