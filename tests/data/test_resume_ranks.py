"""A run resumes on any number of processes: the saved data position is a place in the epoch's batch
order, and the rest of the epoch is dealt out to the ranks there are now (docs/checkpoints.md)."""
from __future__ import annotations

import itertools

import pytest

from aiayn.data.batching import TokenBatchSampler, TokenBounds
from aiayn.errors import UserError

LENS = [3, 5, 4, 6, 2, 7, 5, 3] * 4


def _sampler(ranks: int, rank: int = 0) -> TokenBatchSampler:
    return TokenBatchSampler(LENS, LENS, TokenBounds(12, 12), seed=1, num_replicas=ranks, rank=rank)


def _handed(sampler: TokenBatchSampler, k: int | None = None) -> list[list[int]]:
    """The first ``k`` batches (all: None) the sampler hands out."""
    return list(itertools.islice(sampler, k))


@pytest.mark.parametrize("saved, now", [(2, 1), (1, 2), (2, 3), (3, 2), (2, 2)])
@pytest.mark.parametrize("steps", [0, 1, 3])
def test_the_rest_of_the_epoch_is_dealt_out_to_the_ranks_there_are_now(saved, now, steps):
    """``steps`` batches on each of ``saved`` ranks, then the rest on ``now`` ranks: together they are the
    epoch's order (one rank's) with no batch twice, cut only at its end, by fewer than ``now`` batches."""
    order = _handed(_sampler(1))  # the epoch's batch order
    before = [_sampler(saved, r) for r in range(saved)]
    trained = [b for r, s in enumerate(before) for b in _handed(s, steps)]
    state = before[0].state_dict()
    assert state["batches_done"] == steps * saved and state["num_replicas"] == saved
    after = [_sampler(now, r) for r in range(now)]
    for s in after:
        s.load_state_dict(state)
    rest = [_handed(s) for s in after]
    assert len({len(r) for r in rest}) == 1  # every rank as many steps
    for j, batches in enumerate(rest):
        assert batches == order[steps * saved + j::now][:len(batches)]  # rank j: the rest's j-th, j+now-th, ...
    done = sorted(trained + [b for r in rest for b in r])
    remaining = len(order) - steps * saved
    assert done == sorted(order[:len(order) - remaining % now])
    pairs = [i for b in done for i in b]
    assert len(pairs) == len(set(pairs))
    assert after[0].state_dict()["batches_done"] == len(order) - remaining % now
    assert [_handed(s) for s in after] == [_handed(_sampler(now, r)) for r in range(now)]  # then whole again


def test_a_position_saved_per_rank_still_resumes():
    """A state written as this rank's batch index (``position``, ``n_batches`` per rank) resumes there."""
    two = [_sampler(2, r) for r in range(2)]
    for s in two:
        _handed(s, 2)
    state = {k: v for k, v in two[1].state_dict().items() if k not in ("batches_done", "n_batches_total")}
    one = _sampler(1)
    one.load_state_dict({**state, "position": 2})
    assert one.batches_done == 4
    assert _handed(one) == _handed(_sampler(1))[4:]


def test_batches_cut_on_other_bounds_are_refused():
    state = _sampler(2).state_dict()
    other = TokenBatchSampler(LENS, LENS, TokenBounds(20, 20), seed=1, num_replicas=2)
    with pytest.raises(UserError, match=r"cut into other batches .* \(now train.max_src_tokens=20, "
                                        r"train.max_tgt_tokens=20\); resume with the run's \(its config.json\)"):
        other.load_state_dict(state)
