"""NLTK's treebank sample fetched from a local HTTP server on 127.0.0.1 (tests/data/test_fetch.py's)
serving ../shared/data's copy under the NLTK data repository's path: the pin, ``aiayn data
ptb-sample``, a wrong checksum refused, and ``aiayn parse demo``'s lookup (a local copy, else a
download into the cache; a --data-root without it names the command that fills it)."""
from __future__ import annotations

import hashlib

import pytest

from aiayn.cli import main
from aiayn.data import ptb_sample
from aiayn.data.multi30k import cache_root
from aiayn.errors import UserError
from tests.data.test_fetch import Server

PATH = "/" + ptb_sample.PINNED.remote


@pytest.fixture(scope="module")
def zip_bytes(shared_data) -> bytes:
    return (shared_data / ptb_sample.PINNED.local).read_bytes()


@pytest.fixture
def server(zip_bytes):
    s = Server({PATH: zip_bytes})
    yield s
    s.close()


@pytest.fixture
def no_local_sample(monkeypatch, tmp_path):
    """No treebank sample anywhere on this machine but in the cache, which starts empty."""
    monkeypatch.setattr(ptb_sample, "local_roots", lambda: [tmp_path / "nowhere", cache_root()])
    monkeypatch.setenv("AIAYN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_pin_matches_the_shared_copy(zip_bytes):
    assert (len(zip_bytes), hashlib.sha256(zip_bytes).hexdigest()) == (ptb_sample.PINNED.size,
                                                                      ptb_sample.PINNED.sha256)


def test_cli_downloads_it_once(server, zip_bytes, tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["data", "ptb-sample", "--out", str(out), "--base-url", server.url]) == 0
    captured = capsys.readouterr()
    assert (out / "ptb-wsj-nltk-sample" / "treebank.zip").read_bytes() == zip_bytes
    assert f"aiayn parse demo --data-root {out}" in captured.out and "non-commercial use only" in captured.err
    assert main(["data", "ptb-sample", "--out", str(out), "--base-url", server.url]) == 0
    assert len(server.requests) == 1 and capsys.readouterr().err == ""  # there and the pinned size: kept


def test_cli_refuses_a_wrong_checksum(server, zip_bytes, tmp_path, monkeypatch, capsys):
    server.files[PATH] = zip_bytes[:-1] + bytes([zip_bytes[-1] ^ 1])  # the same size, one bit off
    monkeypatch.setenv(ptb_sample.ENV, server.url)
    out = tmp_path / "d"
    assert main(["data", "ptb-sample", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    got = hashlib.sha256(server.files[PATH]).hexdigest()
    assert err == (f"aiayn data: error: treebank.zip: SHA-256 {got}, expected {ptb_sample.PINNED.sha256} "
                   f"(from {server.url}packages/corpora/treebank.zip); the download is removed")
    assert list(out.rglob("*.zip*")) == []


def test_parse_demo_downloads_where_the_sample_is_nowhere(server, no_local_sample, monkeypatch, tmp_path):
    from aiayn.parsing import prepare
    monkeypatch.setenv(ptb_sample.ENV, server.url)
    seen = []

    def stop(treebank, *args, **kwargs):
        seen.append(treebank)
        raise UserError("stop after the data")
    monkeypatch.setattr(prepare, "prepare_parsing", stop)
    assert main(["parse", "demo", "--out", str(tmp_path / "demo")]) == 2
    assert seen == [no_local_sample / "ptb-wsj-nltk-sample" / "treebank.zip"] and len(server.requests) == 1
    assert ptb_sample.find_ptb_sample(None) == seen[0] and len(server.requests) == 1  # now in the cache


def test_parse_demo_data_root_without_it_names_the_command(no_local_sample, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(ptb_sample.ENV, "http://127.0.0.1:9/")  # never reached
    empty = tmp_path / "empty dir"
    assert main(["parse", "demo", "--data-root", str(empty), "--out", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"aiayn parse: error: {empty}/ptb-wsj-nltk-sample/treebank.zip: no treebank there; "
                   f"`aiayn data ptb-sample --out '{empty}'` downloads NLTK's sample there (without --data-root "
                   f"the demo downloads it itself, into the cache), or give --treebank")


def test_lookup_prefers_a_local_copy(shared_data, no_local_sample, monkeypatch, tmp_path):
    monkeypatch.setenv(ptb_sample.ENV, "http://127.0.0.1:9/")  # never reached
    assert ptb_sample.find_ptb_sample(shared_data) == shared_data / "ptb-wsj-nltk-sample" / "treebank.zip"
    monkeypatch.setattr(ptb_sample, "local_roots", lambda: [tmp_path / "nowhere", shared_data, cache_root()])
    assert ptb_sample.find_ptb_sample(None) == shared_data / "ptb-wsj-nltk-sample" / "treebank.zip"
    assert not no_local_sample.exists()
