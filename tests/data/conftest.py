"""Fixtures for the data tests: small real corpora from Multi30k and a prepared data directory."""
from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from aiayn.data.prepare import PrepareConfig, SplitFiles, prepare

N_TRAIN = 2000
SMALL = PrepareConfig(vocab_size=500, num_workers=1)


def read_gz(path: Path, n: int | None = None) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:n] if n is not None else lines


def write_lines(path: Path, lines: list[str], gz: bool = False) -> Path:
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


@pytest.fixture(scope="session")
def multi30k(shared_data) -> Path:
    return shared_data / "multi30k"


@pytest.fixture(scope="session")
def train_lines(multi30k) -> tuple[list[str], list[str]]:
    """The first 2000 English-German pairs of Multi30k train (raw)."""
    return read_gz(multi30k / "raw/train.en.gz", N_TRAIN), read_gz(multi30k / "raw/train.de.gz", N_TRAIN)


@pytest.fixture(scope="session")
def small_train(tmp_path_factory, train_lines) -> SplitFiles:
    d = tmp_path_factory.mktemp("corpus")
    return SplitFiles(write_lines(d / "train.en", train_lines[0]), write_lines(d / "train.de", train_lines[1], gz=True))


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, small_train, multi30k) -> Path:
    """A data directory: 2000 train pairs, full val and test_2016_flickr, shared BPE of 500."""
    out = tmp_path_factory.mktemp("prepared") / "data"
    raw = multi30k / "raw"
    prepare({"train": small_train,
             "valid": SplitFiles(raw / "val.en.gz", raw / "val.de.gz"),
             "test": SplitFiles(raw / "test_2016_flickr.en.gz", raw / "test_2016_flickr.de.gz")},
            out, SMALL)
    return out
