"""logits_topk.c: the end of a beam step, log-softmax and each row's k best, against PyTorch's
log_softmax and topk."""
import math

import pytest
import torch

from tests.kernels.reference import log_softmax_topk_matches_pytorch


def test_hand_computed_log_softmax_topk(kernels):
    # z = log(1, 2, 3, 4): p = (0.1, 0.2, 0.3, 0.4); token 3 banned, so the 2 best are 2 then 1
    z = torch.tensor([[0.0, math.log(2), math.log(3), math.log(4)]])
    values, ids = kernels.log_softmax_topk(z, 2, torch.tensor([3]))
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(values, torch.tensor([[math.log(0.3), math.log(0.2)]]), atol=1e-6, rtol=0)


def test_log_softmax_topk_ties_and_too_few_tokens(kernels):
    values, ids = kernels.log_softmax_topk(torch.zeros(2, 40), 3, torch.tensor([0]))
    assert ids.tolist() == [[1, 2, 3]] * 2  # equal values: the lower ids first
    torch.testing.assert_close(values, torch.full((2, 3), -math.log(40)), atol=1e-6, rtol=0)
    values, ids = kernels.log_softmax_topk(torch.tensor([[1.0, 2.0, 3.0]]), 2, torch.tensor([0, 2]))
    assert ids[0, 0] == 1 and values[0, 1] == float("-inf")  # one token allowed for k = 2
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.log_softmax_topk(torch.zeros(4, 10)[:, ::2], 2, torch.tensor([0]))
    with pytest.raises(ValueError, match="k = 11 for 10 tokens"):
        kernels.log_softmax_topk(torch.zeros(4, 10), 11, torch.tensor([0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_log_softmax_topk_is_pytorchs(kernels, dtype, threads):
    log_softmax_topk_matches_pytorch(kernels, dtype, threads)
