"""The WMT14 archives fetched from a local HTTP server on 127.0.0.1 (tests/data/test_fetch.py's),
with small stand-in archives under statmt.org's paths and the pins patched to theirs: good files,
already present, a wrong checksum, a truncated file, a server that stops mid-file, a 404, the
archives whose size or SHA-256 is not published, unpacking (on a full disk, interrupted), and the
fetch stage of scripts/wmt14.sh."""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import logging
import os
import subprocess
import sys
import tarfile

import pytest

from aiayn.data import wmt14
from aiayn.data.fetch import Pinned, fetch
from aiayn.errors import UserError
from tests.data.test_fetch import Server, run_with_file_size_limit
from tests.test_wmt14 import REPO, SCRIPT, stand_in

# members of each stand-in archive, as the real ones name them; a few the scripts never read
MEMBERS = {
    "europarl": [f"training/europarl-v7.{x}-en.{s}" for x in ("cs", "de", "fr") for s in ("en", x)],
    "commoncrawl": [f"commoncrawl.{x}-en.{s}" for x in ("de", "fr", "ru") for s in ("en", x)],
    "news-commentary": [f"training/news-commentary-v9.{x}-en.{s}" for x in ("de", "fr") for s in ("en", x)],
    "un": [f"un/undoc.2000.{x}-en.{s}" for x in ("es", "fr") for s in ("en", x)],
    "giga-fren": ["giga-fren.release2.fixed.en.gz", "giga-fren.release2.fixed.fr.gz"],
    "dev": [f"dev/newstest2013{s}" for s in (".en", ".de", ".fr", "-src.en.sgm", "-ref.de.sgm", "-ref.fr.sgm")],
    "test": [f"test-full/newstest2014-{x}en-{s}" for x in ("de", "fr") for s in ("src.en.sgm", "ref.en.sgm",
                                                                                  f"src.{x}.sgm", f"ref.{x}.sgm")],
}


def _archive(name: str, members: list[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w" if name == "giga-fren" else "w:gz") as tar:
        for i, member in enumerate(members):
            body = f"line {i} of {member}\n".encode() + b"".join(  # some kilobytes that gzip cannot shrink away
                hashlib.sha256(f"{member} {k}".encode()).hexdigest().encode() + b"\n" for k in range(100))
            if member.endswith(".gz"):
                body = gzip.compress(body, mtime=0)
            info = tarfile.TarInfo(member)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()


@pytest.fixture(scope="module")
def bodies() -> dict[str, bytes]:
    return {name: _archive(name, members) for name, members in MEMBERS.items()}


@pytest.fixture
def pins(bodies, monkeypatch) -> dict[str, Pinned]:
    """The table with each archive's pin made the stand-in's: size and SHA-256, but for dev.tgz
    (SHA-256 only) and test-full.tgz (MD5 only), as published."""
    table = {}
    for name, a in wmt14.ARCHIVES.items():
        body = bodies[name]
        size = None if a.pinned.size is None else len(body)
        sha = hashlib.sha256(body).hexdigest() if a.pinned.sha256 else ""
        md5 = hashlib.md5(body).hexdigest() if a.pinned.md5 else ""
        table[name] = dataclasses.replace(a, pinned=dataclasses.replace(a.pinned, size=size, sha256=sha, md5=md5))
    monkeypatch.setattr(wmt14, "ARCHIVES", table)
    return {name: a.pinned for name, a in table.items()}


@pytest.fixture
def server(bodies, monkeypatch):
    s = Server({"/" + a.pinned.remote: bodies[name] for name, a in wmt14.ARCHIVES.items()})
    monkeypatch.setenv(wmt14.ENV, s.url)
    yield s
    s.close()


def test_the_table_pins_statmt_files_as_published():
    for pair, n in (("en-de", 5), ("en-fr", 7)):
        assert len(wmt14.archives(pair)) == n
    for name, a in wmt14.ARCHIVES.items():
        p = a.pinned
        assert p.local == "wmt14/" + p.remote.rsplit("/", 1)[1] and p.remote.startswith(("wmt10/", "wmt13/", "wmt14/"))
        assert len(p.sha256 or p.md5) == (64 if p.sha256 else 32) and (p.size is None) == (name in ("dev", "test"))
    with pytest.raises(UserError, match="one of en-de, en-fr"):
        wmt14.archives("de-en")


def test_good_files_then_present_ones_skipped(server, pins, bodies, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    paths = wmt14.download_wmt14(tmp_path, "en-de", quiet=True)
    assert [p.name for p in paths] == ["training-parallel-europarl-v7.tgz", "training-parallel-commoncrawl.tgz",
                                       "training-parallel-nc-v9.tgz", "dev.tgz", "test-full.tgz"]
    assert paths[0].read_bytes() == bodies["europarl"] and not list(tmp_path.rglob("*.part"))
    assert "test-full.tgz: checked by its MD5 only" in caplog.text
    assert "and dev.tgz, test-full.tgz (size not published)" in caplog.text
    assert len(server.requests) == 5
    caplog.clear()
    wmt14.download_wmt14(tmp_path, "en-de", quiet=True)
    assert len(server.requests) == 5 and "wmt14/dev.tgz: present, skipped" in caplog.text


def test_wrong_checksum_is_one_line_naming_the_file_and_leaves_nothing(server, pins, tmp_path):
    path = "/" + pins["news-commentary"].remote
    server.files[path] = server.files[path][:-1] + b"X"  # same size, other bytes
    with pytest.raises(UserError) as err:
        wmt14.download_wmt14(tmp_path, "en-de", quiet=True)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("training-parallel-nc-v9.tgz: SHA-256 ")
    assert pins["news-commentary"].sha256 in msg and msg.endswith("the download is removed")
    assert sorted(p.name for p in (tmp_path / "wmt14").iterdir()) == [
        "training-parallel-commoncrawl.tgz", "training-parallel-europarl-v7.tgz"]  # the two before it, checked


def test_wrong_md5_where_only_an_md5_is_published(server, pins, tmp_path):
    path = "/" + pins["test"].remote
    server.files[path] = b"another test-full.tgz"
    with pytest.raises(UserError, match=rf"^test-full.tgz: MD5 [0-9a-f]{{32}}, expected {pins['test'].md5} "):
        wmt14.download_wmt14(tmp_path, "en-de", quiet=True)
    assert not (tmp_path / "wmt14" / "test-full.tgz").exists() and not list(tmp_path.rglob("*.part"))


def test_truncated_file_served_is_refused_before_a_byte_is_kept(server, pins, tmp_path):
    path = "/" + pins["europarl"].remote
    server.files[path] = server.files[path][:1000]
    with pytest.raises(UserError, match=rf"training-parallel-europarl-v7.tgz: .* serves 1,000 bytes, expected "
                                        rf"{pins['europarl'].size:,} with SHA-256 {pins['europarl'].sha256}"):
        wmt14.download_wmt14(tmp_path, "en-de", quiet=True)
    assert list((tmp_path / "wmt14").iterdir()) == []


def test_truncated_file_already_there_is_named(server, pins, bodies, tmp_path):
    (tmp_path / "wmt14").mkdir()
    (tmp_path / "wmt14" / "training-parallel-europarl-v7.tgz").write_bytes(bodies["europarl"][:1000])
    with pytest.raises(UserError, match=r"training-parallel-europarl-v7.tgz: 1,000 bytes, expected .*remove it"):
        wmt14.download_wmt14(tmp_path, "en-de", quiet=True)
    assert server.requests == []


@pytest.mark.parametrize("name", ["commoncrawl", "dev"])  # a pinned size, and none (the server's word)
def test_server_stopping_mid_file_then_resume(server, pins, bodies, tmp_path, name):
    pin = pins[name]
    server.cut["/" + pin.remote] = 700
    dest = tmp_path / pin.local
    with pytest.raises(UserError, match=rf"stopped after 700 of {len(bodies[name]):,} bytes; run the same command"):
        fetch(server.url + pin.remote, dest, pin, quiet=True)
    assert dest.with_name(dest.name + ".part").stat().st_size == 700 and not dest.exists()
    fetch(server.url + pin.remote, dest, pin, quiet=True)
    assert dest.read_bytes() == bodies[name] and server.requests[-1] == ("/" + pin.remote, "bytes=700-")


def test_whole_part_of_an_unpublished_size_is_checked(server, pins, bodies, tmp_path):
    """A ``.part`` holding all of dev.tgz: the server answers its range with 416, the SHA-256 decides."""
    pin = pins["dev"]
    dest = tmp_path / pin.local
    dest.parent.mkdir()
    dest.with_name("dev.tgz.part").write_bytes(bodies["dev"])
    fetch(server.url + pin.remote, dest, dataclasses.replace(pin, size=None), quiet=True)
    assert dest.read_bytes() == bodies["dev"]


def test_404_names_the_url_and_a_missing_server_the_variable(server, pins, tmp_path):
    del server.files["/" + pins["un"].remote]
    with pytest.raises(UserError, match=rf"{server.url}wmt13/training-parallel-un.tgz: HTTP 404"):
        wmt14.download_wmt14(tmp_path, "en-fr", quiet=True)
    assert not (tmp_path / "wmt14" / "training-parallel-un.tgz").exists()
    with pytest.raises(UserError, match=r"cannot connect .*set \$AIAYN_WMT14_URL to a mirror"):
        wmt14.download_wmt14(tmp_path / "b", "en-de", base_url="http://127.0.0.1:9/", quiet=True)


def test_a_file_with_no_published_checksum_is_kept_and_said_unverified(server, pins, bodies, tmp_path, caplog):
    pin = pins["dev"]
    unpinned = dataclasses.replace(pin, size=None, sha256="", md5="")
    fetch(server.url + pin.remote, tmp_path / "dev.tgz", unpinned, quiet=True)
    assert (tmp_path / "dev.tgz").read_bytes() == bodies["dev"]
    assert "dev.tgz: no checksum is published for it; kept UNVERIFIED" in caplog.text


def test_cli_fetches_and_unpacks_what_the_script_reads(server, pins, tmp_path, capsys):
    from aiayn.cli import main
    out = tmp_path / "raw"
    assert main(["data", "wmt14", "--pair", "en-fr", "--out", str(out), "--unpack"]) == 0
    assert f"unpacked in {out / 'wmt14'}" in capsys.readouterr().out
    got = sorted(str(p.relative_to(out / "wmt14")) for p in (out / "wmt14").rglob("*")
                 if p.is_file() and not p.name.endswith((".tgz", ".tar")) and not p.name.startswith("."))
    assert got == sorted(["commoncrawl.fr-en.en", "commoncrawl.fr-en.fr", "dev/newstest2013-ref.fr.sgm",
                          "dev/newstest2013-src.en.sgm", "dev/newstest2013.en", "dev/newstest2013.fr",
                          "giga-fren.release2.fixed.en.gz", "giga-fren.release2.fixed.fr.gz",
                          "test-full/newstest2014-fren-ref.fr.sgm", "test-full/newstest2014-fren-src.en.sgm",
                          "training/europarl-v7.fr-en.en", "training/europarl-v7.fr-en.fr",
                          "training/news-commentary-v9.fr-en.en", "training/news-commentary-v9.fr-en.fr",
                          "un/undoc.2000.fr-en.en", "un/undoc.2000.fr-en.fr"])
    assert (out / "wmt14" / "un" / "undoc.2000.fr-en.fr").read_text().startswith("line 3 of un/undoc.2000.fr-en.fr")
    assert main(["data", "wmt14", "--pair", "en-fr", "--out", str(out), "--unpack"]) == 0
    assert len(server.requests) == 7  # all there and unpacked: nothing fetched or extracted again


def test_unpack_names_a_member_the_archive_lacks(server, pins, bodies, tmp_path, monkeypatch):
    monkeypatch.setitem(MEMBERS, "dev", ["dev/newstest2013.en"])
    server.files["/" + pins["dev"].remote] = body = _archive("dev", MEMBERS["dev"])
    monkeypatch.setitem(wmt14.ARCHIVES, "dev", dataclasses.replace(
        wmt14.ARCHIVES["dev"], pinned=dataclasses.replace(pins["dev"], sha256=hashlib.sha256(body).hexdigest())))
    wmt14.download_wmt14(tmp_path, "en-de", quiet=True)
    with pytest.raises(UserError, match=r"dev.tgz: holds no newstest2013-ref.de.sgm, newstest2013-src.en.sgm, "
                                        r"newstest2013.de; is it the WMT14 archive\?"):
        wmt14.unpack(tmp_path, "en-de")


UNPACK_ONE = """from pathlib import Path
from aiayn.data import wmt14
from aiayn.errors import UserError
try:
    wmt14.unpack(Path(sys.argv[1]), "en-de")
except UserError as exc:
    print(type(exc).__name__, exc)
"""


def _europarl_alone(root, bodies):
    archive = root / wmt14.ARCHIVES["europarl"].pinned.local
    archive.parent.mkdir(parents=True)
    archive.write_bytes(bodies["europarl"])
    return archive


def _unpacked(root) -> list[str]:
    return sorted(str(p.relative_to(root / "wmt14")) for p in (root / "wmt14").rglob("*")
                  if p.is_file() and not p.name.endswith(".tgz") and not p.name.startswith("."))


def test_unpack_on_a_full_disk_names_the_file_and_keeps_the_archive(tmp_path, bodies):
    """A member that does not fit is a write error (not "download the archive anew"); no file is
    left under its name, where scripts/wmt14.sh would take it as whole; with room, the same
    command unpacks it."""
    archive = _europarl_alone(tmp_path, bodies)
    member = tmp_path / "wmt14" / "training" / "europarl-v7.de-en.en"  # the first the script reads
    said = run_with_file_size_limit(UNPACK_ONE, 4000, str(tmp_path))
    assert said == (f"WriteError {member}: cannot write (File too large); free some space and run the same command "
                    f"again (the archive {archive.name} is kept)")
    assert archive.read_bytes() == bodies["europarl"] and _unpacked(tmp_path) == []
    with pytest.raises(UserError, match="training-parallel-commoncrawl.tgz: not there"):  # europarl done, then the next
        wmt14.unpack(tmp_path, "en-de")
    assert _unpacked(tmp_path) == ["training/europarl-v7.de-en.de", "training/europarl-v7.de-en.en"]


def test_unpack_interrupted_mid_member_leaves_no_file_under_its_name(tmp_path, bodies, monkeypatch):
    _europarl_alone(tmp_path, bodies)
    real = tarfile.copyfileobj

    def half_then_ctrl_c(src, dst, length=None, *args, **kwargs):
        real(src, dst, length // 2, *args, **kwargs)
        raise KeyboardInterrupt
    monkeypatch.setattr(tarfile, "copyfileobj", half_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        wmt14.unpack(tmp_path, "en-de")
    assert _unpacked(tmp_path) == []


def test_unpack_refuses_an_archive_that_unpacks_to_far_more_than_it_holds(tmp_path, monkeypatch):
    """A member that would fill the disk (here 4 MiB of zeros, gzipped to 4 KB): one line naming
    the archive and the member, before a byte of it is written."""
    import aiayn.files
    monkeypatch.setattr(aiayn.files, "UNPACK_SLACK", 0)  # the bound is then 10 times the archive's size
    archive = tmp_path / wmt14.ARCHIVES["europarl"].pinned.local
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        for member, size in (("training/europarl-v7.de-en.en", 1000), ("training/europarl-v7.de-en.de", 4 << 20)):
            info = tarfile.TarInfo(member)
            info.size = size
            tar.addfile(info, io.BytesIO(bytes(size)))
    with pytest.raises(UserError, match=rf"^{archive}: training/europarl-v7.de-en.de unpacks to more than the "
                                        rf"{10 * archive.stat().st_size - 1000:,} bytes this archive may still give"):
        wmt14.unpack(tmp_path, "en-de")
    assert (tmp_path / "wmt14" / "training" / "europarl-v7.de-en.en").stat().st_size == 1000
    assert not (tmp_path / "wmt14" / "training" / "europarl-v7.de-en.de").exists()


def _script(*args: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO / "src"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=REPO)


def test_script_fetch_stage_skipped_when_the_files_are_there(tmp_path, shared_data):
    raw = tmp_path / "raw"
    stand_in(raw, shared_data / "wmt14-newstest", "de")
    proc = _script("--raw", str(raw), "--work", str(tmp_path / "w"), "--stages", "fetch",
                   AIAYN_WMT14_URL="http://127.0.0.1:9/")  # never reached
    assert proc.returncode == 0 and f"fetch: {raw} holds every file the clean stage reads: skipped" in proc.stderr


def test_script_fetch_stage_runs_aiayn_data_wmt14(tmp_path):
    proc = _script("--work", str(tmp_path / "w"), "--pair", "enfr", "--stages", "fetch",
                   AIAYN_WMT14_URL="http://127.0.0.1:9/")
    assert proc.returncode == 2, proc.stderr
    assert f"fetch: the WMT14 en-fr archives -> {tmp_path / 'w' / 'raw' / 'wmt14'}" in proc.stderr
    assert ("aiayn data: error: http://127.0.0.1:9/wmt13/training-parallel-europarl-v7.tgz: cannot connect"
            in proc.stderr.splitlines()[-1])
