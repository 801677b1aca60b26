"""Fixtures for the parsing tests: the NLTK WSJ sample, read once per test run."""
from __future__ import annotations

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
