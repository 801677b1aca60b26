"""DataDir and ParallelData: the manifest is checked, splits read by memory map, order kept."""
from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
import torch

from aiayn.data.dataset import DataDir
from aiayn.data.store import NpyAppender, token_dtype
from aiayn.errors import UserError
from tests.data.conftest import N_TRAIN, read_gz


def test_datadir_api(prepared):
    d = DataDir(prepared)
    assert d.shared_vocab and d.src_tokenizer is d.tgt_tokenizer
    assert d.vocab_size == d.tgt_vocab_size == 500
    assert d.splits == ["test", "train", "valid"]
    m = d.manifest
    assert m["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert m["vocab"]["src"]["sha256"] == d.src_tokenizer.sha256
    assert m["splits"]["train"]["cleaning"]["input"] == N_TRAIN
    assert m["options"]["vocab_size"] == 500


def test_valid_split_is_whole_and_in_order(prepared, multi30k):
    d = DataDir(prepared)
    valid = d.split("valid")
    en, de = read_gz(multi30k / "raw/val.en.gz"), read_gz(multi30k / "raw/val.de.gz")
    assert len(valid) == len(en) == 1014
    for i in (0, 1, 500, 1013, -1):
        src, tgt = valid[i]
        assert src.dtype == np.int64
        assert src.tolist() == d.src_tokenizer.encode(en[i])
        assert valid.tgt(i).tolist() == d.tgt_tokenizer.encode(de[i])
    assert valid.src_lens.tolist() == [len(d.src_tokenizer.encode(s)) for s in en]
    assert int(valid.tgt_lens.sum()) == d.manifest["splits"]["valid"]["tgt"]["tokens"]
    with pytest.raises(IndexError):
        valid[1014]


def test_arrays_are_memory_mapped_and_compact(prepared):
    d = DataDir(prepared)
    train = d.split("train")
    assert isinstance(train._tokens["src"], np.memmap) and train._tokens["src"].dtype == np.uint16
    back = pickle.loads(pickle.dumps(train))
    assert len(back) == len(train) and back[7][1].tolist() == train[7][1].tolist()


def test_missing_split(prepared, tmp_path, small_train):
    from aiayn.data.prepare import prepare
    from tests.data.conftest import SMALL
    prepare({"train": small_train}, tmp_path / "d", SMALL)
    with pytest.raises(UserError, match="no split 'test'"):
        DataDir(tmp_path / "d").split("test")


def _copy(prepared, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(prepared, dst)
    return dst


def _edit_manifest(path, **changes):
    m = json.loads((path / "manifest.json").read_text())
    m.update(changes)
    (path / "manifest.json").write_text(json.dumps(m))


def test_refuses_incomplete_directories(prepared, tmp_path):
    d = _copy(prepared, tmp_path)
    (d / "manifest.json").unlink()
    with pytest.raises(UserError, match="no manifest.json"):
        DataDir(d)
    with pytest.raises(UserError, match="not a directory"):
        DataDir(tmp_path / "nowhere")


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "train.tgt.tokens.npy").write_bytes((d / "train.tgt.tokens.npy").read_bytes()[:-2]), "truncated"),
    (lambda d: (d / "valid.src.offsets.npy").unlink(), "missing"),
    (lambda d: _edit_manifest(d, complete=False), "not marked complete"),
    (lambda d: _edit_manifest(d, version=99), "version"),
    (lambda d: _edit_manifest(d, special_ids={"pad": 1, "unk": 0, "bos": 2, "eos": 3}), "special ids"),
    (lambda d: (d / "manifest.json").write_text('{"format": "aiayn-da'), "unreadable"),
])
def test_refuses_damaged_directories(prepared, tmp_path, damage, message):
    d = _copy(prepared, tmp_path)
    damage(d)
    with pytest.raises(UserError, match=message):
        DataDir(d)


def test_refuses_a_changed_tokenizer(prepared, tmp_path):
    d = _copy(prepared, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["vocab"]["src"]["sha256"] = "0" * 64
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="sha256"):
        DataDir(d)


def test_npy_appender_writes_loadable_npy(tmp_path):
    w = NpyAppender(tmp_path / "a.npy", np.int32)
    w.append(np.array([1, 2, 3]))
    w.append(np.array([], dtype=np.int64))
    w.append([70000])
    w.close()
    arr = np.load(tmp_path / "a.npy", mmap_mode="r")
    assert arr.dtype == np.int32 and arr.tolist() == [1, 2, 3, 70000]


def test_token_dtype():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.int32


def test_bpe_dropout_data_follows_its_segmentation(prepared, tmp_path):
    from aiayn.data.dataset import BpeDropoutData, Segmentation
    d = DataDir(prepared)
    train = d.split("train")
    tok = d.src_tokenizer
    data = BpeDropoutData(train, tok, tok, 0.1, num_threads=2)
    assert all(np.array_equal(data[i][s], train[i][s]) for i in range(50) for s in (0, 1))  # stored until use()
    plain = BpeDropoutData(train, tok, tok, 0.0).sample()
    assert all(np.array_equal(plain.get("tgt", i), train.tgt(i)) for i in range(len(train)))
    seg = data.sample()
    data.use(seg)
    assert len(data) == len(seg) == len(train)
    changed = 0
    for i in range(len(train)):
        for side, lens in (("src", data.src_lens), ("tgt", data.tgt_lens)):
            stored, got = getattr(train, side)(i), getattr(data, side)(i)
            assert got.dtype == np.int64 and len(got) == lens[i]
            if (stored == 1).any():  # <unk> does not survive decoding: the stored ids are kept
                assert np.array_equal(got, stored)
                continue
            assert tok.decode(got) == tok.decode(stored)
            changed += not np.array_equal(got, stored)
    assert changed > len(train)  # most of the 2 x 2,000 sides lose a merge at p = 0.1
    assert data.tgt_lens.sum() > 1.1 * train.tgt_lens.sum()
    assert np.array_equal(data.tgt(7), data.tgt(7))  # one segmentation until the next use()
    other = data.sample()
    assert any(not np.array_equal(other.get("src", i), seg.get("src", i)) for i in range(20))
    seg.save(tmp_path / "e" / "epoch00000.npz")
    back = Segmentation.load(tmp_path / "e" / "epoch00000.npz")
    assert all(np.array_equal(back.get(s, i), seg.get(s, i)) for s in ("src", "tgt") for i in range(len(seg)))
    (tmp_path / "bad.npz").write_bytes(b"not npz")
    with pytest.raises(UserError, match="bad.npz: unreadable BPE-dropout segmentation"):
        Segmentation.load(tmp_path / "bad.npz")
    whole = (tmp_path / "e" / "epoch00000.npz").read_bytes()
    for name, damaged in (("empty.npz", b""), ("cut.npz", whole[: len(whole) // 2])):  # outside damage
        (tmp_path / name).write_bytes(damaged)
        with pytest.raises(UserError, match=f"{name}: unreadable BPE-dropout segmentation"):
            Segmentation.load(tmp_path / name)
    with pytest.raises(UserError, match="a segmentation of 2 pairs for a split of 2000"):
        data.use(Segmentation({s: (np.arange(3), np.array([0, 1, 3])) for s in ("src", "tgt")}))


def test_bpe_dropout_on_the_source_side_only(prepared):
    from aiayn.data.dataset import BpeDropoutData
    d = DataDir(prepared)
    train = d.split("train")
    data = BpeDropoutData(train, d.src_tokenizer, d.tgt_tokenizer, 0.1, sides=("src",))
    seg = data.sample()
    assert np.array_equal(seg.lens("tgt"), train.tgt_lens)
    assert all(np.array_equal(seg.get("tgt", i), train.tgt(i)) for i in range(len(train)))
    assert seg.lens("src").sum() > 1.1 * train.src_lens.sum()
    with pytest.raises(ValueError, match="sides must be among src, tgt"):
        BpeDropoutData(train, d.src_tokenizer, d.tgt_tokenizer, 0.1, sides=("source",))


def test_rows_collate_as_the_pairs_do(prepared):
    """The training stream's collation (``rows`` gathered at once, ``collate_rows``) against the
    pair-by-pair ``collate``: the same Batch, field by field, for batches of many lengths, of one
    length, of one row, with negative and repeated indices."""
    from aiayn.data.batching import collate, collate_rows
    train = DataDir(prepared).split("train")
    rng = np.random.default_rng(0)
    n = len(train)
    same_len = np.flatnonzero(train.src_lens == np.bincount(train.src_lens).argmax())[:7]
    cases = [rng.integers(0, n, 64), rng.integers(-n, n, 9), [5], [n - 1, 0, n - 1], same_len]
    for pad, bos, eos in ((0, 2, 3), (9, 8, 7)):
        for idx in cases:
            a = collate([train[i] for i in idx], pad, bos, eos, indices=idx)
            b = collate_rows(train.rows("src", idx), train.rows("tgt", idx), pad, bos, eos, indices=idx)
            for f in ("src", "tgt_in", "tgt_out", "indices"):
                assert torch.equal(getattr(a, f), getattr(b, f)), (f, list(idx))
            assert (a.n_src_tokens, a.n_tgt_tokens, a.src_padded) == (b.n_src_tokens, b.n_tgt_tokens, b.src_padded)
            assert type(b.n_src_tokens) is int and type(b.src_padded) is bool
    assert collate_rows(train.rows("src", same_len), train.rows("tgt", same_len)).src_padded is False
    with pytest.raises(IndexError, match=f"index {n} out of range"):
        train.rows("src", [0, n])
    with pytest.raises(ValueError, match="empty batch"):
        collate_rows(train.rows("src", []), train.rows("tgt", []))
