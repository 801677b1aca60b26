"""kernels/split.h and team.c: the kernels' work on PyTorch's own OpenMP threads gives the same bits as on
threads the kernels start themselves, for every kernel that splits its work, and the team is what the
loader picks where PyTorch runs on OpenMP."""
import pytest
import torch

from aiayn.kernels import loader as kernel_mod
from tests.kernels.reference import shared_slot_case


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield lambda n: torch.set_num_threads(n)
    torch.set_num_threads(before)


def _every_kernel(k) -> list[torch.Tensor]:
    """One call of each kernel that splits its work among threads, on fixed inputs."""
    torch.manual_seed(0)  # shared_slot_case draws from the global generator
    g = torch.Generator().manual_seed(0)
    out = []
    q, kk, v, anc = shared_slot_case(Bs=5, H=4, K=16, Dv=16)
    out.append(k.self_attention(q, kk, v, anc, 4))
    logits = torch.randn(24, 301, generator=g)
    out.extend(k.log_softmax_topk(logits, 5, torch.tensor([0, 7])))
    x_q = torch.randint(-127, 128, (13, 70), dtype=torch.int8, generator=g)
    w_q = torch.randint(-127, 128, (83, 70), dtype=torch.int8, generator=g)
    out.append(k.int8_linear(x_q, torch.rand(13, 1, generator=g), k.pack_int8(w_q), torch.rand(83, generator=g),
                             torch.randn(83, generator=g), torch.float32))
    out.extend(k.cross_entropy_forward(logits))
    qs, ks, vs = (torch.randn(3, 7, 4, 32, generator=g).transpose(1, 2) for _ in range(3))  # (B,H,T,d) of (B,T,H*d)
    out.extend(k.seq_attention_forward(qs, ks, vs, None, True))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_the_team_and_own_threads_give_the_same_bits(kernels, threads, n):
    threads(n)
    try:
        kernels.use_team(False)
        own = _every_kernel(kernels)
        if not kernels.use_team(True):
            pytest.skip("PyTorch's parallel backend here is not OpenMP: the kernels start their own threads")
        team = _every_kernel(kernels)
    finally:
        kernels.use_team(True)
    assert len(own) == len(team)
    for a, b in zip(own, team):
        assert torch.equal(a, b)


def test_the_loader_takes_pytorchs_openmp_team(kernels):
    openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    assert (kernel_mod.openmp_team() is not None) == openmp
    assert kernels.team == openmp
