"""TokenBatchSampler (token bounds, coverage, ranks, determinism, resume) and collate."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from aiayn.data.batching import Batch, TokenBatchSampler, TokenBounds, batches, collate
from aiayn.errors import UserError


def random_lens(n=500, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 60, size=n)
    tgt = np.clip(src + rng.integers(-5, 6, size=n), 1, None)
    return src, tgt


def padded(lens, batch):
    return len(batch) * max(lens[i] for i in batch)


def test_golden_cut_without_shuffle():
    # sorted lengths 1..6, bound 8: [1,2] (2*2=4; adding 3 gives 9), [3,4] (2*4=8), [5] (2*6=12 > 8), [6]
    lens = [3, 1, 4, 2, 6, 5]
    s = TokenBatchSampler(lens, lens, TokenBounds(8, 8), shuffle=False)
    assert list(s) == [[1, 3], [0, 2], [5], [4]]
    assert len(s) == 4


@pytest.mark.parametrize("max_src,max_tgt", [(200, 200), (300, 120), (64, 400)])
def test_every_batch_respects_both_bounds(max_src, max_tgt):
    src, tgt = random_lens()
    s = TokenBatchSampler(src, tgt, TokenBounds(max_src, max_tgt), seed=3)
    for b in s:
        assert padded(src, b) <= max_src and padded(tgt, b) <= max_tgt


def test_each_example_once_per_epoch():
    src, tgt = random_lens()
    s = TokenBatchSampler(src, tgt, TokenBounds(250, 250))
    for epoch in (0, 1):
        s.set_epoch(epoch)
        seen = sorted(i for b in s for i in b)
        assert seen == list(range(len(src)))


def test_batches_group_similar_lengths():
    src, tgt = random_lens(n=2000)
    s = TokenBatchSampler(src, tgt, TokenBounds(400, 400))
    sorted_pad = sum(padded(tgt, b) - sum(tgt[i] for i in b) for b in s)
    rng = np.random.default_rng(0)
    perm, random_pad, k = rng.permutation(len(src)), 0, 0
    for b in s:  # the same batch sizes, filled at random
        chunk = perm[k:k + len(b)]
        k += len(b)
        random_pad += padded(tgt, chunk) - sum(tgt[i] for i in chunk)
    assert sorted_pad < 0.2 * random_pad


def test_oversize_example_is_own_batch_or_dropped():
    src = [5, 50, 5, 5]
    tgt = [5, 5, 5, 5]
    keep = TokenBatchSampler(src, tgt, TokenBounds(20, 20), shuffle=False)
    assert keep.n_oversize == 1
    assert sorted(sorted(b) for b in keep) == [[0, 2, 3], [1]]
    drop = TokenBatchSampler(src, tgt, TokenBounds(20, 20, drop_oversize=True), shuffle=False)
    assert sorted(sorted(b) for b in drop) == [[0, 2, 3]]


def test_same_seed_same_batches_other_epoch_other_order():
    src, tgt = random_lens()
    a = list(TokenBatchSampler(src, tgt, TokenBounds(250, 250), seed=7))
    b = list(TokenBatchSampler(src, tgt, TokenBounds(250, 250), seed=7))
    assert a == b
    s = TokenBatchSampler(src, tgt, TokenBounds(250, 250), seed=7)
    s.set_epoch(1)
    assert list(s) != a
    assert list(TokenBatchSampler(src, tgt, TokenBounds(250, 250), seed=8)) != a


def test_four_ranks_disjoint_equal_and_few_dropped():
    src, tgt = random_lens(n=997)
    R = 4
    dropped_sets = []
    for epoch in (0, 1, 2):
        per_rank = []
        for rank in range(R):
            s = TokenBatchSampler(src, tgt, TokenBounds(250, 250), seed=5, num_replicas=R, rank=rank)
            s.set_epoch(epoch)
            per_rank.append([tuple(b) for b in s])
        total = TokenBatchSampler(src, tgt, TokenBounds(250, 250)).n_batches_total
        assert total % R != 0  # so that something is dropped
        assert {len(r) for r in per_rank} == {total // R}
        first = TokenBatchSampler(src, tgt, TokenBounds(250, 250), num_replicas=R, rank=0)
        assert all(len(r) == len(first) for r in per_rank)
        flat = [i for r in per_rank for b in r for i in b]
        assert len(flat) == len(set(flat))  # disjoint
        single = TokenBatchSampler(src, tgt, TokenBounds(250, 250), seed=5)
        single.set_epoch(epoch)
        all_batches = {tuple(b) for b in single}
        used = {b for r in per_rank for b in r}
        assert used <= all_batches
        dropped = all_batches - used
        assert len(dropped) == total % R < R
        dropped_sets.append(dropped)
    assert dropped_sets[0] != dropped_sets[1] or dropped_sets[1] != dropped_sets[2]


@pytest.mark.parametrize("stop", [0, 1, 5])
def test_resume_mid_epoch_gives_the_remaining_batches(stop):
    src, tgt = random_lens()
    full = TokenBatchSampler(src, tgt, TokenBounds(250, 250), seed=2, num_replicas=2, rank=1)
    full.set_epoch(3)
    expected = list(full)
    run = TokenBatchSampler(src, tgt, TokenBounds(250, 250), seed=2, num_replicas=2, rank=1)
    run.set_epoch(3)
    it = iter(run)
    seen = [next(it) for _ in range(stop)]
    state = run.state_dict()
    assert state["epoch"] == 3 and state["batches_done"] == 2 * stop  # both ranks' batches
    resumed = TokenBatchSampler(src, tgt, TokenBounds(250, 250), seed=2, num_replicas=2, rank=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # a training loop re-entering the saved epoch keeps the position
    assert seen + list(resumed) == expected
    assert list(resumed) == expected  # iterating the same epoch again starts over
    resumed.set_epoch(4)
    assert resumed.state_dict()["batches_done"] == 0


def test_resume_rejects_a_different_setup():
    src, tgt = random_lens()
    state = TokenBatchSampler(src, tgt, TokenBounds(250, 250), num_replicas=2).state_dict()
    with pytest.raises(UserError,
                       match=r"train.seed 1 in the run, now 3; resume with the run.s settings \(its config.json\)"):
        TokenBatchSampler(src, tgt, TokenBounds(250, 250), seed=3, num_replicas=4).load_state_dict(state)


def test_collate_golden():
    b = collate([([5, 6], [7]), (np.array([8]), np.array([9, 10, 11]))], indices=[4, 1])
    assert b.src.tolist() == [[5, 6, 3], [8, 3, 0]]
    assert b.tgt_in.tolist() == [[2, 7, 0, 0], [2, 9, 10, 11]]
    assert b.tgt_out.tolist() == [[7, 3, 0, 0], [9, 10, 11, 3]]
    assert (b.n_src_tokens, b.n_tgt_tokens) == (5, 6)
    assert b.src.dtype == torch.long and b.indices.tolist() == [4, 1]
    moved = b.to("cpu")
    assert isinstance(moved, Batch) and len(moved) == 2 and torch.equal(moved.tgt_out, b.tgt_out)


def test_collate_says_whether_the_source_is_padded():
    """``src_padded`` is known on the host when the batch is made: the model then gives the attention no
    key mask (and on a GPU no read of the batch is needed to know)."""
    assert collate([([5, 6], [7]), ([8], [9])]).src_padded
    unpadded = collate([([5, 6], [7]), ([8, 9], [9, 10, 11])])
    assert not unpadded.src_padded and not (unpadded.src == 0).any()
    assert not unpadded.to("cpu").src_padded  # (``to`` keeps it)


def test_collate_other_special_ids():
    b = collate([([5], [6])], pad_id=9, bos_id=8, eos_id=7)
    assert b.src.tolist() == [[5, 7]] and b.tgt_in.tolist() == [[8, 6]] and b.tgt_out.tolist() == [[6, 7]]


def test_batches_over_real_data(prepared):
    from aiayn.data.dataset import DataDir
    data = DataDir(prepared).split("valid")
    s = TokenBatchSampler(data.src_lens + 1, data.tgt_lens + 1, TokenBounds(1024, 1024))
    n = 0
    for b in batches(data, s):
        assert b.src.numel() <= 1024 and b.tgt_out.numel() <= 1024
        i = int(b.indices[0])
        assert b.src[0, : data.src_lens[i]].tolist() == data.src(i).tolist()
        assert b.n_tgt_tokens == int((data.tgt_lens[b.indices.numpy()] + 1).sum())
        n += len(b)
    assert n == len(data)


@pytest.mark.parametrize("make,message", [
    (lambda: TokenBatchSampler([1, 2], [1], TokenBounds(10, 10)), "entries"),
    (lambda: TokenBatchSampler([1, 2], [1, 2], TokenBounds(0, 10)), "positive"),
    (lambda: TokenBatchSampler([1, 2], [1, 2], TokenBounds(10, 10), num_replicas=2, rank=2), "rank"),
])
def test_sampler_argument_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_collate_empty_batch():
    with pytest.raises(ValueError, match="empty"):
        collate([])


def test_set_lengths_cuts_as_a_new_sampler_would():
    src, tgt = random_lens()
    rng = np.random.default_rng(5)
    src2, tgt2 = src + rng.integers(0, 15, len(src)), tgt + rng.integers(0, 15, len(tgt))  # a BPE-dropout epoch
    run = TokenBatchSampler(src, tgt, TokenBounds(250, 250), seed=2, num_replicas=2, rank=1)
    before = len(run)
    run.set_epoch(3)
    run.set_lengths(src2, tgt2)
    fresh = TokenBatchSampler(src2, tgt2, TokenBounds(250, 250), seed=2, num_replicas=2, rank=1)
    fresh.set_epoch(3)
    assert len(run) == len(fresh) > before
    assert list(run) == list(fresh)
    assert all(padded(src2, b) <= 250 and padded(tgt2, b) <= 250 for b in run.epoch_batches())
    assert run.state_dict() == fresh.state_dict()
    with pytest.raises(ValueError, match="499/499 lengths for 500 examples"):
        run.set_lengths(src2[:-1], tgt2[:-1])


def test_cut_in_chunks_equals_one_pass(monkeypatch):
    """TokenBatchSampler walks the sorted lengths in chunks; the batches are those of one pass,
    oversize pairs included (kept alone or dropped)."""
    import aiayn.data.batching as batching
    rng = np.random.default_rng(3)
    src, tgt = rng.integers(1, 40, 1000), rng.integers(1, 40, 1000)
    src[[5, 500]] = 90  # over the bound
    for drop in (False, True):
        whole = TokenBatchSampler(src, tgt, TokenBounds(80, 70, drop_oversize=drop))
        monkeypatch.setattr(batching, "_CUT_CHUNK", 7)
        chunked = TokenBatchSampler(src, tgt, TokenBounds(80, 70, drop_oversize=drop))
        monkeypatch.undo()
        assert chunked._slices == whole._slices and chunked.n_oversize == whole.n_oversize == 2
        assert [b.tolist() for b in chunked.epoch_batches(2)] == [b.tolist() for b in whole.epoch_batches(2)]


@pytest.mark.parametrize("big", [False, True])
def test_compact_lengths_give_the_int64_order(big):
    """The sampler keeps lengths as int16 (int32 past 32,767) and an epoch's order as int32: 8 bytes
    a pair instead of 20. The batches are those of the same rules on int64 keys, written out here."""
    src, tgt = random_lens(3000, seed=4)
    if big:
        src = src.copy()
        src[7] = 40000  # past int16: int32 lengths, an oversize pair on its own
    s = TokenBatchSampler(src, tgt, TokenBounds(50000 if big else 400, 400), seed=9, shuffle=True)
    assert s.src_lens.dtype == (np.int32 if big else np.int16) and s.tgt_lens.dtype == np.int16
    batches_ = s.epoch_batches(1)
    assert all(b.dtype == np.int32 for b in batches_)
    s64, t64 = np.asarray(src, dtype=np.int64), np.asarray(tgt, dtype=np.int64)
    rng = np.random.default_rng([9, 1])
    order = np.lexsort((rng.random(len(s64)), s64, t64, np.maximum(s64, t64)))
    expected = [order[a:b].tolist() for a, b in s._slices]
    expected = [expected[j] for j in rng.permutation(len(expected))]
    assert [b.tolist() for b in batches_] == expected
