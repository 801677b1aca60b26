"""A run resumes on the number of processes it was trained with; another number is refused with
what to do instead (docs/checkpoints.md says the same)."""
from __future__ import annotations

import pytest

from aiayn.data.batching import TokenBatchSampler
from aiayn.errors import UserError

LENS = [3, 5, 4, 6, 2, 7, 5, 3] * 4


def _sampler(ranks: int, rank: int = 0) -> TokenBatchSampler:
    return TokenBatchSampler(LENS, LENS, 12, 12, seed=1, num_replicas=ranks, rank=rank)


@pytest.mark.parametrize("saved, now", [(2, 1), (1, 2)])
def test_resuming_on_another_number_of_ranks_is_refused_with_the_way_out(saved, now):
    state = _sampler(saved).state_dict()
    with pytest.raises(UserError, match=f"trained by {saved} process\\(es\\), this is {now}; resume it with "
                                        f"{saved} \\(torchrun --nproc_per_node {saved}.*--init-from RUN/last.pt"):
        _sampler(now).load_state_dict(state)
    _sampler(saved, rank=saved - 1).load_state_dict(state)  # the same number resumes
