"""The Multi30k BLEU convention: raw references brought to lc.norm.tok form match the shipped ones."""
from __future__ import annotations

import gzip

import pytest

from aiayn.evaluate.multi30k import lc_norm_tok, multi30k_bleu


def _read(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


@pytest.mark.parametrize("lang,min_exact", [("de", 999), ("en", 1000)])
def test_lc_norm_tok_reproduces_the_shipped_references(shared_data, lang, min_exact):
    m = shared_data / "multi30k"
    raw = _read(m / f"raw/test_2016_flickr.{lang}.gz")
    tok = _read(m / f"tok/test_2016_flickr.lc.norm.tok.{lang}.gz")
    ours = lc_norm_tok(raw, lang)
    assert sum(a == b for a, b in zip(ours, tok)) >= min_exact
    assert multi30k_bleu(raw, tok, lang).score > 99.9


def test_lc_norm_tok_golden():
    assert lc_norm_tok(['Ein Mann sagt "Hallo", nicht wahr?'], "de") == \
        ["ein mann sagt &quot; hallo &quot; , nicht wahr ?"]
