"""Downloads against a local HTTP server on 127.0.0.1 that serves Multi30k's files under the
repository's paths, built from ../shared/data/multi30k: whole files, a wrong checksum, a
truncated ``.part`` resumed, a server that stops mid-file, a 404, a server that is not HTTP, a
full disk, a mirror that is a local folder, and the data root lookup."""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from aiayn.data import fetch as fetch_module
from aiayn.data import multi30k
from aiayn.data.fetch import Pinned, fetch, sha256_of
from aiayn.errors import UserError


class Server:
    """Files by URL path, with byte ranges (unless ``ranges`` is false); ``cut`` maps a path to the bytes sent before the
    connection is closed (its Content-Length still says the whole); ``tail`` to bytes sent after the file, with no
    Content-Length; ``trickle``: seconds between pieces of 1,000 bytes (0: all at once)."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.cut, self.tail, self.requests, self.ranges, self.trickle = dict(files), {}, {}, [], True, 0.0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append((self.path, self.headers.get("Range")))
                body = outer.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                asked = self.headers.get("Range") if outer.ranges else None
                start = int(asked[len("bytes="):-1]) if asked else 0
                if start >= len(body) and start:
                    self.send_error(416)
                    return
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                tail = outer.tail.get(self.path)
                if tail is None:
                    self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                sent = body[start:outer.cut.pop(self.path, len(body))] + (tail or b"")
                step = 1000 if outer.trickle else len(sent) or 1
                try:
                    for i in range(0, len(sent), step):
                        self.wfile.write(sent[i:i + step])
                        self.wfile.flush()
                        time.sleep(outer.trickle)
                except OSError:  # the client has gone
                    pass
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _served_bytes(shared: Path, pin: Pinned) -> bytes:
    """A file as the repository serves it: raw/ as stored in ../shared, tok/ (gzipped there) as plain text."""
    local = pin.local.removeprefix("multi30k/")
    stored = shared / local
    return stored.read_bytes() if stored.is_file() else gzip.decompress((shared / (local + ".gz")).read_bytes())


@pytest.fixture(scope="module")
def repo_files(shared_data) -> dict[str, bytes]:
    return {"/" + p.remote: _served_bytes(shared_data / "multi30k", p) for p in multi30k.PINNED}


@pytest.fixture
def server(repo_files):
    s = Server(repo_files)
    yield s
    s.close()


VAL_DE = next(p for p in multi30k.PINNED if p.local == "multi30k/raw/val.de.gz")


def test_pins_match_the_shared_copies(repo_files):
    for p in multi30k.PINNED:
        body = repo_files["/" + p.remote]
        assert (len(body), hashlib.sha256(body).hexdigest()) == (p.size, p.sha256), p.remote


def test_good_file_then_kept(server, tmp_path):
    dest = tmp_path / "val.de.gz"
    assert fetch(server.url + VAL_DE.remote, dest, VAL_DE) == dest
    assert sha256_of(dest) == VAL_DE.sha256 and not (tmp_path / "val.de.gz.part").exists()
    fetch(server.url + VAL_DE.remote, dest, VAL_DE)
    assert len(server.requests) == 1  # present: not fetched again


def test_wrong_checksum_is_one_line_and_leaves_nothing(server, tmp_path):
    path = "/" + VAL_DE.remote
    server.files[path] = server.files[path][:-1] + b"X"
    dest = tmp_path / "val.de.gz"
    with pytest.raises(UserError) as err:
        fetch(server.url + VAL_DE.remote, dest, VAL_DE)
    msg = str(err.value)
    assert "\n" not in msg and "val.de.gz" in msg and VAL_DE.sha256 in msg
    assert hashlib.sha256(server.files[path]).hexdigest() in msg
    assert list(tmp_path.iterdir()) == []


def test_truncated_part_is_resumed(server, tmp_path, repo_files):
    body = repo_files["/" + VAL_DE.remote]
    (tmp_path / "val.de.gz.part").write_bytes(body[:1000])
    dest = fetch(server.url + VAL_DE.remote, tmp_path / "val.de.gz", VAL_DE)
    assert dest.read_bytes() == body
    assert server.requests == [("/" + VAL_DE.remote, "bytes=1000-")]


def test_server_stopping_mid_file_then_resume(server, tmp_path, repo_files):
    server.cut["/" + VAL_DE.remote] = 5000
    dest = tmp_path / "val.de.gz"
    with pytest.raises(UserError, match=r"stopped after 5,000 of 24,681 bytes; run the same command again"):
        fetch(server.url + VAL_DE.remote, dest, VAL_DE)
    assert not dest.exists() and (tmp_path / "val.de.gz.part").stat().st_size == 5000
    fetch(server.url + VAL_DE.remote, dest, VAL_DE)
    assert dest.read_bytes() == repo_files["/" + VAL_DE.remote]
    assert server.requests[-1][1] == "bytes=5000-"


def test_server_without_ranges_sends_the_whole_file_again(server, tmp_path, repo_files):
    server.ranges = False
    (tmp_path / "val.de.gz.part").write_bytes(b"x" * 1000)
    fetch(server.url + VAL_DE.remote, tmp_path / "val.de.gz", VAL_DE)
    assert (tmp_path / "val.de.gz").read_bytes() == repo_files["/" + VAL_DE.remote]


def test_server_with_a_shorter_file_than_the_part(server, tmp_path, repo_files):
    server.files["/" + VAL_DE.remote] = repo_files["/" + VAL_DE.remote][:500]
    (tmp_path / "val.de.gz.part").write_bytes(repo_files["/" + VAL_DE.remote][:1000])
    with pytest.raises(UserError, match=r"val.de.gz: .* serves fewer than 1,000 bytes, expected 24,681 with SHA-256"):
        fetch(server.url + VAL_DE.remote, tmp_path / "val.de.gz", VAL_DE)
    assert list(tmp_path.iterdir()) == []


def test_longer_part_is_started_over(server, tmp_path, repo_files):
    (tmp_path / "val.de.gz.part").write_bytes(b"x" * (VAL_DE.size + 1))
    fetch(server.url + VAL_DE.remote, tmp_path / "val.de.gz", VAL_DE)
    assert server.requests[0][1] is None and (tmp_path / "val.de.gz").read_bytes() == repo_files["/" + VAL_DE.remote]


def test_whole_part_left_is_checked_without_a_request(server, tmp_path, repo_files):
    (tmp_path / "val.de.gz.part").write_bytes(repo_files["/" + VAL_DE.remote])
    fetch(server.url + VAL_DE.remote, tmp_path / "val.de.gz", VAL_DE)
    assert server.requests == [] and (tmp_path / "val.de.gz").is_file()


def _largest_write(monkeypatch) -> list[int]:
    """The most bytes ``fetch`` ever had in a ``.part``, as a one-element list filled as it writes."""
    most, real_open = [0], fetch_module._open_part

    def counting(part, append):
        f = real_open(part, append)
        write = f.write

        def counted(block):
            n = write(block)
            most[0] = max(most[0], f.tell())
            return n
        f.write = counted
        return f
    monkeypatch.setattr(fetch_module, "_open_part", counting)
    return most


def test_a_server_sending_more_than_the_pinned_size_is_stopped_there(server, tmp_path, monkeypatch):
    """A mirror that gives no Content-Length and goes on past the file: no byte past the pinned
    size is written, and what was is removed."""
    server.tail["/" + VAL_DE.remote] = b"x" * (1 << 20)
    most = _largest_write(monkeypatch)
    with pytest.raises(UserError, match=rf"^val.de.gz: {server.url}\S+ sends more than the 24,681 bytes this file "
                                        rf"may have; nothing is kept$"):
        fetch(server.url + VAL_DE.remote, tmp_path / "val.de.gz", VAL_DE)
    assert most[0] == VAL_DE.size and list(tmp_path.iterdir()) == []


def test_a_file_without_a_pinned_size_is_bounded_too(server, tmp_path, monkeypatch, repo_files):
    monkeypatch.setattr(fetch_module, "UNPINNED_MAX", 10_000)
    url = server.url + VAL_DE.remote
    with pytest.raises(UserError, match=r"serves 24,681 bytes, more than the 10,000 a file without a pinned size"):
        fetch(url, tmp_path / "val.de.gz", dataclasses.replace(VAL_DE, size=None))
    server.tail["/" + VAL_DE.remote] = b""  # the same bytes, no Content-Length
    most = _largest_write(monkeypatch)
    with pytest.raises(UserError, match=r"sends more than the 10,000 bytes this file may have"):
        fetch(url, tmp_path / "val.de.gz", dataclasses.replace(VAL_DE, size=None))
    assert most[0] == 10_000 and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(fetch_module, "UNPINNED_MAX", VAL_DE.size)  # exactly the file: taken
    fetch(url, tmp_path / "val.de.gz", dataclasses.replace(VAL_DE, size=None))
    assert (tmp_path / "val.de.gz").read_bytes() == repo_files["/" + VAL_DE.remote]


def test_a_trickling_server_meets_the_deadline_and_the_part_resumes(server, tmp_path, repo_files):
    """Every read comes within the per-read timeout, but the file as a whole does not."""
    server.trickle = 0.05
    dest = tmp_path / "val.de.gz"
    with pytest.raises(UserError, match=r"^val.de.gz: \S+ sent [\d,]+ bytes in 0.2 s, the time this file may take; "
                                        r"run the same command again to resume it \(\S+val.de.gz.part is kept\)$"):
        fetch(server.url + VAL_DE.remote, dest, VAL_DE, deadline_s=0.2)
    kept = (tmp_path / "val.de.gz.part").stat().st_size
    assert 0 < kept < VAL_DE.size and not dest.exists()
    server.trickle = 0.0
    fetch(server.url + VAL_DE.remote, dest, VAL_DE)
    assert dest.read_bytes() == repo_files["/" + VAL_DE.remote] and server.requests[-1][1] == f"bytes={kept}-"


def test_a_part_that_is_a_link_is_refused_not_written_through(server, tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"a file of the user's")
    raw = tmp_path / "multi30k" / "raw"
    raw.mkdir(parents=True)
    part = raw / "val.de.gz.part"
    part.symlink_to(precious)
    with pytest.raises(UserError, match=rf"^{part}: a symbolic link; a download is written only to a file of its own"):
        fetch(server.url + VAL_DE.remote, raw / "val.de.gz", VAL_DE)
    assert precious.read_bytes() == b"a file of the user's" and part.is_symlink() and server.requests == []
    with pytest.raises(UserError, match=rf"^{part}: a symbolic link"):  # one planted after the check: O_NOFOLLOW
        fetch_module._open_part(part, append=True)
    part.unlink()
    os.mkfifo(part)
    with pytest.raises(UserError, match=rf"^{part}: not a regular file"):
        fetch(server.url + VAL_DE.remote, raw / "val.de.gz", VAL_DE)
    with pytest.raises(UserError, match=rf"^{part}: not a regular file"):
        fetch_module._open_part(part, append=False)
    assert precious.read_bytes() == b"a file of the user's"


def test_404_names_the_url(server, tmp_path):
    url = server.url + "data/task1/raw/nope.en.gz"
    with pytest.raises(UserError, match=rf"{url}: HTTP 404"):
        fetch(url, tmp_path / "nope.en.gz", Pinned("nope", "nope", 10, "0" * 64))
    assert list(tmp_path.iterdir()) == []


def test_no_server_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match=r"http://127.0.0.1:9/x: cannot connect .*AIAYN_DATA_URL"):
        fetch("http://127.0.0.1:9/x", tmp_path / "x", Pinned("x", "x", 10, "0" * 64), timeout=2)


def run_with_file_size_limit(code: str, limit: int, *args: str) -> str:
    """What ``code`` prints, run in a new Python process whose files may grow to ``limit`` bytes
    (RLIMIT_FSIZE: a write past it fails as on a full disk, with EFBIG; Python ignores SIGXFSZ)."""
    prelude = f"import resource, sys\nresource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
    proc = subprocess.run([sys.executable, "-c", prelude + code, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


FETCH_ONE = """from pathlib import Path
from aiayn.data.fetch import Pinned, fetch
from aiayn.errors import UserError
try:
    fetch(sys.argv[1], Path(sys.argv[2]), Pinned("", "", int(sys.argv[3]), sys.argv[4]), quiet=True)
except UserError as exc:
    print(type(exc).__name__, exc)
"""


def test_a_full_disk_is_named_as_such_and_the_part_resumes(server, tmp_path, repo_files):
    """A write that fails is not a network stop: one line naming the ``.part`` and the cause; what
    it holds is a beginning of the file, which the next run, with room, resumes."""
    dest = tmp_path / "val.de.gz"
    said = run_with_file_size_limit(FETCH_ONE, 10_000, server.url + VAL_DE.remote, str(dest), str(VAL_DE.size),
                                    VAL_DE.sha256)
    assert said == (f"WriteError {dest}.part: cannot write (File too large); the bytes so far are kept: free some "
                    f"space and run the same command again to resume it, or give another --out (or $AIAYN_CACHE)")
    assert (tmp_path / "val.de.gz.part").stat().st_size == 10_000 and not dest.exists()
    fetch(server.url + VAL_DE.remote, dest, VAL_DE, quiet=True)
    assert dest.read_bytes() == repo_files["/" + VAL_DE.remote] and server.requests[-1][1] == "bytes=10000-"


def test_ctrl_c_mid_download_leaves_only_the_part_and_the_same_command_resumes(server, tmp_path, monkeypatch,
                                                                               capsys, repo_files):
    from aiayn.cli import main
    monkeypatch.setattr(fetch_module, "BLOCK", 1000)
    real_write = fetch_module._write

    def ctrl_c_after_5_blocks(f, block, part):
        real_write(f, block, part)
        if f.tell() >= 5000:
            raise KeyboardInterrupt
    monkeypatch.setattr(fetch_module, "_write", ctrl_c_after_5_blocks)
    out = tmp_path / "d"
    argv = ["data", "multi30k", "--base-url", server.url, "--out", str(out)]
    assert main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "aiayn data: interrupted; the same command resumes the download (what arrived is kept in FILE.part)")
    raw = out / "multi30k" / "raw"
    assert [p.name for p in raw.iterdir()] == ["train.en.gz.part"]  # nothing under a name a later run takes as whole
    assert (raw / "train.en.gz.part").read_bytes() == repo_files["/data/task1/raw/train.en.gz"][:5000]
    monkeypatch.setattr(fetch_module, "_write", real_write)
    assert main(argv) == 0
    assert ("/data/task1/raw/train.en.gz", "bytes=5000-") in server.requests
    assert (raw / "train.en.gz").read_bytes() == repo_files["/data/task1/raw/train.en.gz"]


class Canned:
    """A server on 127.0.0.1 that answers every connection with ``answer``, whatever it is asked."""

    def __init__(self, answer: bytes):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/"
        threading.Thread(target=self._serve, args=(answer,), daemon=True).start()

    def _serve(self, answer: bytes) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                conn.recv(65536)
                conn.sendall(answer)


@pytest.mark.parametrize("answer, said", [
    (b"SSH-2.0-OpenSSH_9.6\r\n", r"not an HTTP answer \(BadStatusLine: SSH-2.0-OpenSSH_9.6\); is it the mirror's "
                                 r"address\? \(\$AIAYN_DATA_URL\)"),
    (b"HTTP/1.1 302 Found\r\nLocation: /again\r\nContent-Length: 0\r\n\r\n",
     r"HTTP 302 The HTTP server returned a redirect error that would lead to an infinite loop. The last 30x"),
])
def test_a_server_that_is_not_a_mirror_is_one_line(tmp_path, answer, said):
    canned = Canned(answer)
    try:
        with pytest.raises(UserError, match=rf"^{canned.url}x: {said}") as err:
            fetch(canned.url + "x", tmp_path / "x", Pinned("x", "x", 10, "0" * 64), timeout=5)
    finally:
        canned.sock.close()
    assert "\n" not in str(err.value) and list(tmp_path.iterdir()) == []


def test_a_range_answered_from_byte_0_starts_over(tmp_path, repo_files):
    """A 206 whose Content-Range begins at 0, not where the ``.part`` ends: the whole file again."""
    body = repo_files["/" + VAL_DE.remote]
    canned = Canned(b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-%d/%d\r\nContent-Length: %d\r\n\r\n"
                    % (len(body) - 1, len(body), len(body)) + body)
    (tmp_path / "val.de.gz.part").write_bytes(b"x" * 1000)
    try:
        fetch(canned.url + VAL_DE.remote, tmp_path / "val.de.gz", VAL_DE, quiet=True)
    finally:
        canned.sock.close()
    assert (tmp_path / "val.de.gz").read_bytes() == body


def test_a_mirror_may_be_a_local_folder(repo_files, tmp_path, capsys):
    """``--base-url`` (or the variable) naming a folder laid out as the repository; a ``.part``
    there is started over (a file: URL has no ranges)."""
    from aiayn.cli import main
    mirror = tmp_path / "mirror"
    for path, body in repo_files.items():
        (mirror / path[1:]).parent.mkdir(parents=True, exist_ok=True)
        (mirror / path[1:]).write_bytes(body)
    out = tmp_path / "d"
    (out / "multi30k" / "raw").mkdir(parents=True)
    (out / "multi30k" / "raw" / "val.de.gz.part").write_bytes(b"x" * 1000)
    assert main(["data", "multi30k", "--base-url", str(mirror), "--out", str(out)]) == 0
    assert f"--data-root {out}" in capsys.readouterr().out
    assert multi30k.multi30k_files(out, "en", "de", given=True)["raw.valid.de"].read_bytes() == \
        repo_files["/" + VAL_DE.remote]
    assert not list(out.rglob("*.part"))


def test_a_file_missing_from_a_local_mirror_names_it_not_the_network(tmp_path):
    """A local folder given as the mirror that lacks a file (not laid out as the repository): the
    error names the path looked for, not a connection and the network."""
    url = fetch_module.mirror_url(str(tmp_path / "mirror")) + VAL_DE.remote
    with pytest.raises(UserError) as err:
        fetch(url, tmp_path / "val.de.gz", VAL_DE, quiet=True)
    text = str(err.value)
    assert text.startswith(f"{tmp_path / 'mirror' / VAL_DE.remote}: no such file in the mirror folder")
    assert "network" not in text and "connect" not in text


def _local_mirror(repo_files: dict[str, bytes], folder: Path) -> Path:
    """A folder laid out as the repository, holding its files."""
    for path, body in repo_files.items():
        (folder / path[1:]).parent.mkdir(parents=True, exist_ok=True)
        (folder / path[1:]).write_bytes(body)
    return folder


def test_a_file_url_without_slashes_is_a_url(repo_files, tmp_path, capsys):
    """``--base-url file:/abs/path`` (a file URL in its short form) is that folder, not a folder named
    "file:" below the current one."""
    from aiayn.cli import main
    mirror = _local_mirror(repo_files, tmp_path / "mirror")
    assert fetch_module.mirror_url(f"file:{mirror}") == f"file:{mirror}/"
    out = tmp_path / "d"
    assert main(["data", "multi30k", "--base-url", f"file:{mirror}", "--out", str(out), "--quiet"]) == 0
    assert multi30k.multi30k_files(out, "en", "de", given=True)["raw.valid.de"].read_bytes() == \
        repo_files["/" + VAL_DE.remote]


def test_a_folder_where_a_file_goes_is_refused_before_the_download(repo_files, tmp_path, capsys):
    """A folder at a file's name (the download could not take it) stops with one line naming it, before
    any byte is fetched: no ``.part`` is left, the folder is as it was."""
    from aiayn.cli import main
    mirror = _local_mirror(repo_files, tmp_path / "mirror")
    out = tmp_path / "d"
    in_the_way = out / "multi30k" / "raw" / "train.en.gz"
    in_the_way.mkdir(parents=True)
    assert main(["data", "multi30k", "--base-url", str(mirror), "--out", str(out), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"aiayn data: error: {in_the_way}: exists and is not a file; remove it (or give another --out, or "
        f"$AIAYN_CACHE) and run again")
    assert [p.name for p in in_the_way.parent.iterdir()] == ["train.en.gz"] and in_the_way.is_dir()


@pytest.mark.parametrize("dataset", ["multi30k", "ptb-sample", "wmt14"])
def test_an_empty_base_url_is_refused_not_read_as_no_mirror(dataset, tmp_path, monkeypatch, capsys):
    """``--base-url "$MIRROR"`` with the variable unset: refused, not a download from the data set's site."""
    from aiayn.cli import main
    from aiayn.data import ptb_sample, wmt14
    fetched = []
    for module in (multi30k, ptb_sample, wmt14):
        monkeypatch.setattr(module, "fetch_all", lambda base, *args, **kwargs: fetched.append(base) or [])
    for env in ("AIAYN_DATA_URL", "AIAYN_NLTK_DATA_URL", "AIAYN_WMT14_URL"):
        monkeypatch.delenv(env, raising=False)
    with pytest.raises(SystemExit) as stopped:  # argparse's error: usage, then the line
        main(["data", dataset, "--base-url", "", "--out", str(tmp_path / "d")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"aiayn data {dataset}: error: argument --base-url: empty; give a mirror's URL or folder, or leave "
        f"--base-url out")
    assert fetched == []


@pytest.fixture
def no_local_data(monkeypatch, tmp_path):
    """No Multi30k anywhere on this machine but in the cache, which starts empty."""
    monkeypatch.setattr(multi30k, "local_roots", lambda: [tmp_path / "nowhere", multi30k.cache_root()])
    monkeypatch.setenv("AIAYN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_lookup_downloads_into_the_cache_once(server, no_local_data, monkeypatch, capsys):
    monkeypatch.setenv("AIAYN_DATA_URL", server.url)
    files = multi30k.find_multi30k(None, "en", "de")
    assert files["tok.test.de"] == no_local_data / "multi30k/tok/test_2016_flickr.lc.norm.tok.de"
    assert files["raw.train.en"] == no_local_data / "multi30k/raw/train.en.gz"
    assert len(server.requests) == 12
    assert "non-commercial research" in capsys.readouterr().err
    assert multi30k.find_multi30k(None, "de", "en") == {**files}  # the cache now holds them: no request
    assert len(server.requests) == 12 and capsys.readouterr().err == ""
    # the tokenized references read the same as ../shared's gzipped ones
    assert multi30k.read_text(files["tok.valid.de"])[:3] == multi30k.read_text(
        multi30k.multi30k_files(Path(multi30k.default_data_root()), "en", "de")["tok.valid.de"])[:3]


def test_lookup_prefers_data_root_then_local_copies(shared_data, no_local_data, tmp_path, monkeypatch):
    monkeypatch.setenv("AIAYN_DATA_URL", "http://127.0.0.1:9/")  # never reached
    assert multi30k.find_multi30k(shared_data, "en", "de")["raw.train.en"] == shared_data / "multi30k/raw/train.en.gz"
    with pytest.raises(UserError, match=r"not found under .*empty/multi30k.*leave it out to use or download"):
        multi30k.find_multi30k(tmp_path / "empty", "en", "de")
    partial = tmp_path / "partial" / "multi30k"  # a copy lacking one tokenized file: named in both its forms
    shutil.copytree(shared_data / "multi30k", partial)
    (partial / "tok" / "val.lc.norm.tok.de.gz").unlink()
    with pytest.raises(UserError, match=r"not found under .*partial/multi30k: .*/tok/val.lc.norm.tok.de\[.gz\]; "
                                        r"--data-root names the folder that holds multi30k/"):
        multi30k.find_multi30k(tmp_path / "partial", "en", "de")
    monkeypatch.setattr(multi30k, "local_roots", lambda: [tmp_path / "nowhere", shared_data, multi30k.cache_root()])
    assert multi30k.find_multi30k(None, "en", "de")["tok.test.de"].parent == shared_data / "multi30k/tok"


def test_cli_data_multi30k_and_a_corrupt_mirror(server, tmp_path, monkeypatch, capsys):
    from aiayn.cli import main
    monkeypatch.setenv("AIAYN_DATA_URL", server.url)
    path = "/data/task1/tok/train.lc.norm.tok.de"
    pin = next(p for p in multi30k.PINNED if "/" + p.remote == path)
    good = server.files[path]
    server.files[path] = good[:100]  # another file: its size says so before any byte is kept
    assert main(["data", "multi30k", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"aiayn data: error: train.lc.norm.tok.de: {server.url + pin.remote} serves 100 bytes, "
                   f"expected 2,150,008 with SHA-256 {pin.sha256}; nothing is kept")
    assert not list((tmp_path / "d").rglob("*.part"))
    server.files[path] = good
    assert main(["data", "multi30k", "--out", str(tmp_path / "d")]) == 0
    assert f"--data-root {tmp_path / 'd'}" in capsys.readouterr().out
    assert len(list((tmp_path / "d" / "multi30k").rglob("*"))) == 14  # raw/, tok/ and the 12 files


def test_demo_downloads_where_multi30k_is_nowhere(server, no_local_data, monkeypatch, tmp_path):
    """``aiayn demo`` goes through the same lookup: here it downloads, then prepares from the cache."""
    from aiayn.cli import main
    from aiayn.demo import stages
    monkeypatch.setenv("AIAYN_DATA_URL", server.url)
    seen = {}

    def stop(cfg, files, *args):
        seen.update(files)
        raise UserError("stop after the data")
    monkeypatch.setattr(stages, "stage_prepare", stop)
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 2
    assert seen["raw.train.en"] == no_local_data / "multi30k/raw/train.en.gz" and len(server.requests) == 12


def test_progress_bar_on_a_terminal(server, tmp_path, monkeypatch):
    import io
    import sys

    from aiayn import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setattr(progress, "QUIET", False)
    fetch(server.url + VAL_DE.remote, tmp_path / "val.de.gz", VAL_DE)
    assert "val.de.gz:" in sys.stderr.getvalue() and "B/s" in sys.stderr.getvalue()


@pytest.mark.slow
def test_demo_runs_to_the_end_from_a_mirror_alone(server, no_local_data, monkeypatch, tmp_path, capsys):
    """No Multi30k on the machine, a local server standing in for the data set's repository: the
    demo downloads, trains, translates and plots; a corrupted file is one line naming it and the
    checksum expected, and leaves nothing behind."""
    import json

    from aiayn.cli import main
    monkeypatch.setenv("AIAYN_DATA_URL", server.url)
    path = "/" + VAL_DE.remote
    good = server.files[path]
    server.files[path] = good[:-1] + bytes([good[-1] ^ 1])  # the same size, one bit off
    out = tmp_path / "demo"
    recipe = tmp_path / "smoke.json"
    recipe.write_text(json.dumps({
        "preset": "multi30k",
        "model": {"n_layers": 1, "d_model": 64, "d_ff": 128, "n_heads": 2, "d_k": 32, "d_v": 32},
        "train": {"warmup_steps": 10, "max_src_tokens": 1024, "max_tgt_tokens": 1024, "save_every_steps": 10,
                  "save_every_min": 0, "validate_every_steps": 0, "threads": 1}}))
    argv = ["demo", "--out", str(out), "--recipe", str(recipe), "--train-lines", "1000", "--eval-lines", "20",
            "--max-steps", "20", "--processes", "1", "--alphas", "0.6", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the download notice, then the error
    assert err[-1].startswith("aiayn demo: error: val.de.gz") and VAL_DE.sha256 in err[-1], err
    assert not any("Traceback" in line for line in err)
    assert not list(no_local_data.rglob("*.part")) and not list(no_local_data.rglob("val.de.gz"))
    server.files[path] = good
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3:] == [f"model: {out / 'model.pt'}", f"translations: {out / 'test_2016.hyp'}",
                          f"plots: {out / 'plots'}"]
    assert len((out / "test_2016.hyp").read_text(encoding="utf-8").splitlines()) == 20
    assert list((out / "plots").glob("*.png")) and (no_local_data / "multi30k" / "raw" / "val.de.gz").is_file()
