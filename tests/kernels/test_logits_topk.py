"""logits_topk.c: the end of a beam step, log-softmax and each row's k best, against PyTorch's
log_softmax and topk."""
import math

import pytest
import torch

from tests.arith import U32
from tests.kernels.reference import log_softmax_tolerance, log_softmax_topk_matches_pytorch

# this CPU's build, and the AVX2 + FMA one (8 wide) on any x86 CPU that can run it
BUILDS = ["kernels", "x86_64_v3"]


def test_hand_computed_log_softmax_topk(kernels):
    # z = log(1, 2, 3, 4): p = (0.1, 0.2, 0.3, 0.4); token 3 banned, so the 2 best are 2 then 1
    z = torch.tensor([[0.0, math.log(2), math.log(3), math.log(4)]])
    values, ids = kernels.log_softmax_topk(z, 2, torch.tensor([3]))
    assert ids.tolist() == [[2, 1]]
    want = torch.tensor([[math.log(0.3), math.log(0.2)]], dtype=torch.float64)
    # the kernel's arithmetic (log_softmax_tolerance, rtol as there), plus float32's rounding of the logits
    # log(2..4): it moves z_v and, through the log-sum, log s by u log 4 each
    tol = log_softmax_tolerance(4) + 2 * U32 * math.log(4)
    torch.testing.assert_close(values.double(), want, atol=tol, rtol=2 * U32)


@pytest.mark.parametrize("build", BUILDS)
def test_log_softmax_topk_ties_and_too_few_tokens(build, request):
    kernels = request.getfixturevalue(build)
    values, ids = kernels.log_softmax_topk(torch.zeros(2, 40), 3, torch.tensor([0]))
    assert ids.tolist() == [[1, 2, 3]] * 2  # equal values: the lower ids first (blocks equal to the k-th skipped)
    want = torch.full((2, 3), -math.log(40), dtype=torch.float64)
    torch.testing.assert_close(values.double(), want, atol=log_softmax_tolerance(40), rtol=2 * U32)  # exact logits
    values, ids = kernels.log_softmax_topk(torch.tensor([[1.0, 2.0, 3.0]]), 2, torch.tensor([0, 2]))
    assert ids[0, 0] == 1 and values[0, 1] == float("-inf")  # one token allowed for k = 2
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.log_softmax_topk(torch.zeros(4, 10)[:, ::2], 2, torch.tensor([0]))
    with pytest.raises(ValueError, match="k = 11 for 10 tokens"):
        kernels.log_softmax_topk(torch.zeros(4, 10), 11, torch.tensor([0]))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_log_softmax_topk_is_pytorchs(build, dtype, threads, request):
    log_softmax_topk_matches_pytorch(request.getfixturevalue(build), dtype, threads)


@pytest.mark.parametrize("build", BUILDS)
def test_the_best_token_in_any_lane_of_a_block_is_found(build, request):
    # a block of 16 is compared with the k-th best as one vector (AVX-512) or two (AVX2): the one token
    # above it may be at any lane of either, or in the tail
    kernels = request.getfixturevalue(build)
    V = 16 * 5 + 7
    for v in range(V):
        z = torch.zeros(1, V)
        z[0, v] = 1.0
        _, ids = kernels.log_softmax_topk(z, 2, torch.tensor([], dtype=torch.int64))
        assert ids.tolist() == [[v, 0 if v else 1]]
