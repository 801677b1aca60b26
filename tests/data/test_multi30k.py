"""End to end on all of Multi30k: En->De, shared BPE of 8000 (the setting aiayn demo uses)."""
from __future__ import annotations

import pytest

from aiayn.data.batching import TokenBatchSampler, TokenBounds, batches
from aiayn.data.dataset import DataDir
from aiayn.data.prepare import PrepareConfig, SplitFiles, prepare
from tests.data.conftest import read_gz


@pytest.fixture(scope="module")
def full(tmp_path_factory, multi30k) -> DataDir:
    raw = multi30k / "raw"
    out = tmp_path_factory.mktemp("m30k") / "data"
    prepare({"train": SplitFiles(raw / "train.en.gz", raw / "train.de.gz"),
             "valid": SplitFiles(raw / "val.en.gz", raw / "val.de.gz"),
             "test": SplitFiles(raw / "test_2016_flickr.en.gz", raw / "test_2016_flickr.de.gz")},
            out, PrepareConfig(vocab_size=8000))
    return DataDir(out)


def test_full_multi30k_manifest(full):
    m = full.manifest
    assert full.vocab_size == 8000 and full.shared_vocab
    # the default ratio bound 3.0 removes exactly the two pairs whose German side is "@@"
    assert m["splits"]["train"]["cleaning"] == {"input": 29000, "empty": 0, "too_long": 0,
                                                "bad_ratio": 2, "kept": 28998}
    assert [m["splits"][s]["pairs"] for s in ("valid", "test")] == [1014, 1000]
    for split in ("train", "valid", "test"):
        for side in ("src", "tgt"):
            entry = m["splits"][split][side]
            assert entry["unk"] < 0.002 * entry["tokens"]
            assert entry["length"]["max"] < 100


def test_full_multi30k_test_set_round_trip(full, multi30k):
    test = full.split("test")
    de = read_gz(multi30k / "raw/test_2016_flickr.de.gz")
    same = sum(full.tgt_tokenizer.decode(test.tgt(i)) == de[i] for i in range(len(de)))
    assert same >= 0.98 * len(de)


def test_full_multi30k_padding_at_4096_tokens(full):
    train = full.split("train")
    sampler = TokenBatchSampler(train.src_lens + 1, train.tgt_lens + 1, TokenBounds(4096, 4096))
    slots = {"src": 0, "tgt": 0}
    real = {"src": 0, "tgt": 0}
    for b in batches(train, sampler):
        slots["src"] += b.src.numel()
        slots["tgt"] += b.tgt_out.numel()
        real["src"] += b.n_src_tokens
        real["tgt"] += b.n_tgt_tokens
    assert real["src"] == int((train.src_lens + 1).sum())
    assert 1 - real["src"] / slots["src"] < 0.08 and 1 - real["tgt"] / slots["tgt"] < 0.05
