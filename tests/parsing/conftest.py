"""Fixtures for the parsing tests: the NLTK WSJ sample, read once per test run."""
from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from aiayn.parsing.ptb import read_treebank


@pytest.fixture(scope="session")
def treebank_zip(shared_data):
    return shared_data / "ptb-wsj-nltk-sample" / "treebank.zip"


@pytest.fixture(scope="session")
def sample_trees(treebank_zip):
    return read_treebank(treebank_zip)


@pytest.fixture(scope="session")
def evalb_dir(shared_data):
    return shared_data / "evalb"


def four_wsj_files(treebank_zip: Path, folder: Path) -> Path:
    """``folder``, made, holding four files of the sample: wsj_0001 and 0002 (train), 0160 (dev)
    and 0180 (test) of the WSJ split."""
    folder.mkdir()
    with zipfile.ZipFile(treebank_zip) as zf:
        for n in ("0001", "0002", "0160", "0180"):
            (folder / f"wsj_{n}.mrg").write_bytes(zf.read(f"treebank/combined/wsj_{n}.mrg"))
    return folder
