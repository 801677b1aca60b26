"""Downloads that check themselves, for the data sets the commands fetch when they are not found
on this machine (``aiayn.data.multi30k``) and the WMT14 archives (``aiayn.data.wmt14``).

One file at a time: an HTTP(S) GET into ``FILE.part`` beside its destination; a ``.part`` left by
an interrupted run is resumed with a ``Range`` request (started over if the server ignores it);
the whole file's SHA-256 is compared with the pinned one, and only then is ``FILE.part`` renamed
to ``FILE``. A mismatch removes ``FILE.part`` and is a one-line ``UserError`` naming the file and
both checksums, so no half-written or wrong file is ever left under the real name. A file already
under its name is kept (it was checked when it got it) if its size is the pinned one.

Where no published source gives a file's size or SHA-256, the pin leaves it out: the size the
server sends then stands in for it, a published MD5 for the SHA-256 (a weaker check), and a file
with neither checksum is kept unverified; a warning says which, never silence.
"""
from __future__ import annotations

import hashlib
import http.client
import logging
import os
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from aiayn import __version__
from aiayn.errors import UserError
from aiayn.progress import progress_bar

log = logging.getLogger(__name__)

BLOCK = 1 << 16  # bytes read and hashed at a time


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
        raise UserError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"{url}: cannot connect ({reason}); check the network, or set ${env} to a mirror") from None


def _served_size(resp) -> int | None:
    """The size of the whole file as the response gives it (Content-Range's, else Content-Length)."""
    if resp.status == 206:
        total = (resp.headers.get("Content-Range") or "").rpartition("/")[2]
        return int(total) if total.isdigit() else None
    length = resp.headers.get("Content-Length")
    return int(length) if length and length.isdigit() else None


def _receive(resp, part: Path, start: int, name: str, quiet: bool) -> int:
    """Append the body of ``resp`` to ``part`` (from byte 0 when the server ignored the range);
    returns the bytes now in ``part``. A connection that breaks ends the body early."""
    if start and resp.status != 206:
        start = 0  # a 200 to a Range request: the whole file again
    with open(part, "ab" if start else "wb") as f, \
            progress_bar(total=_served_size(resp), initial=start, unit="B", unit_scale=True, desc=name, quiet=quiet) as bar:
        have = start
        try:
            while block := resp.read(BLOCK):
                f.write(block)
                have += len(block)
                bar.update(len(block))
        except (http.client.HTTPException, socket.timeout, OSError) as exc:
            log.debug("%s: read failed: %r", name, exc)
    return have


def fetch(url: str, dest: Path, sha256: str, size: int | None, *, md5: str = "", quiet: bool = False,
          timeout: float = 30.0, env: str = "AIAYN_DATA_URL") -> Path:
    """``dest`` downloaded from ``url`` and checked against ``sha256`` (``md5`` where no SHA-256 is
    pinned); an existing ``dest`` is kept as it is if it has ``size`` bytes (it was checked when it
    was written). ``size``: the pinned file's bytes (None: the server's word); a server that gives
    another size is a mismatch (the ``.part`` removed); a longer ``.part`` is started over."""
    if dest.is_file():
        kept = dest.stat().st_size
        if size is not None and kept != size:
            raise UserError(f"{dest}: {kept:,} bytes, expected {size:,}: not the pinned file; remove it and run "
                            f"again to download it")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    start = part.stat().st_size if part.is_file() else 0
    if size is not None and start > size:  # not a beginning of the pinned file: start over
        part.unlink()
        start = 0
    have, total = start, size
    if size is None or start < size:
        resp = _open(url, start, timeout, env)
        served = None if resp is None else _served_size(resp)
        if size is not None and (resp is None or served not in (None, size)):  # another file than the pinned one
            if resp is not None:
                resp.close()
            part.unlink(missing_ok=True)
            what = f"fewer than {start:,}" if resp is None else f"{served:,}"
            raise UserError(f"{dest.name}: {url} serves {what} bytes, expected {size:,} with SHA-256 {sha256}; "
                            f"nothing is kept")
        if resp is not None:  # (None with no pinned size: the .part is the whole file; its checksum decides)
            with resp:
                have = _receive(resp, part, start, dest.name, quiet)
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
    """Every one of ``files`` under ``root``, each from ``base_url`` + its remote path (``env``: the
    variable that replaces ``base_url``, named when there is no connection)."""
    base = base_url if base_url.endswith("/") else base_url + "/"
    return [fetch(base + f.remote, root / f.local, f.sha256, f.size, md5=f.md5, quiet=quiet, env=env) for f in files]
