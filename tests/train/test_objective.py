"""Golden values for Eq. 3 and the label-smoothed loss of §5.4."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from aiayn.train import objective
from aiayn.train.objective import (label_smoothed_loss, label_smoothed_loss_reference, make_optimizer,
                                    noam_lr, rdrop_kl, rdrop_kl_reference, smoothed_targets)
from tests.arith import EXP_REL_ERR, U32, Rounded, gamma, loss_sums, smoothed_loss_gradients, within
from tests.grad_rounding import gradient_bound, same_gradients


@pytest.mark.parametrize("step,expected", [
    (1, 1.746928107421711e-07),      # 512^-0.5 * 1 * 4000^-1.5
    (4000, 6.987712429686843e-04),   # 512^-0.5 * 4000^-0.5 (the peak)
    (8000, 4.941058844013093e-04),   # 512^-0.5 * 8000^-0.5
    (100000, 1.397542485937369e-04),  # 512^-0.5 * 100000^-0.5
])
def test_noam_golden(step, expected):
    assert noam_lr(step, 512, 4000) == pytest.approx(expected, rel=1e-12)


def test_noam_scale_and_warmup_shape():
    assert noam_lr(10, 256, 1000, scale=2.0) == pytest.approx(2 * noam_lr(10, 256, 1000))
    assert noam_lr(999, 512, 1000) < noam_lr(1000, 512, 1000) > noam_lr(1001, 512, 1000)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("weight_decay,expected", [
    # Adam's first step (§5.3), p = 1, g = 0.5, lr = 0.01, betas (0.9, 0.98): m = 0.05, v = 0.005,
    # m_hat = 0.05 / 0.1 = 0.5, v_hat = 0.005 / 0.02 = 0.25, step = 0.01 * 0.5 / sqrt(0.25) = 0.01
    (0.0, 0.99),
    # decoupled decay first: 1 * (1 - 0.01 * 0.1) = 0.999, then the same step: 0.989
    (0.1, 0.989),
])
def test_optimizer_first_step_hand_computed(weight_decay, expected, fused):
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = make_optimizer([p], lr=0.01, betas=(0.9, 0.98), eps=1e-9, weight_decay=weight_decay, fused=fused)
    p.grad = torch.tensor([0.5, 0.5])
    opt.step()
    # the second entry: -2 * (1 - 0.01 * λ) - 0.01
    want = torch.tensor([expected, -2 * (1 - 0.01 * weight_decay) - 0.01], dtype=torch.float64)
    # float32: the step lr m̂ / (sqrt(v̂) + eps) = 0.01 through about 12 operations and 5 rounded constants
    # (γ_17 of it), the decay p (1 - lr λ) (γ_4 of |p|), their difference (u of the result)
    within(p, want, gamma(17) * 0.01 + gamma(4) * torch.tensor([1.0, 2.0], dtype=torch.float64) + U32 * want.abs())
    assert isinstance(opt, torch.optim.AdamW if weight_decay else torch.optim.Adam)


def test_weight_decay_is_checked():
    from aiayn.config import ConfigError
    from aiayn.train.config import TrainConfig
    assert TrainConfig(weight_decay=0.05).weight_decay == 0.05
    with pytest.raises(ConfigError, match="weight_decay"):
        TrainConfig(weight_decay=-0.01)


@pytest.mark.parametrize("field, value", [("warmup_steps", 0), ("max_src_tokens", 0), ("max_tgt_tokens", -1)])
def test_schedule_and_batch_sizes_are_checked(field, value):
    """A value Eq. 3 or the batch sampler cannot use is a ConfigError naming the field, not a
    ZeroDivisionError or a sampler's ValueError at the first step."""
    from aiayn.config import ConfigError
    from aiayn.train.config import TrainConfig
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{field: value})


def test_label_smoothed_loss_hand_computed():
    # V = 4 (pad = 0), eps = 0.1: gold gets 0.9, the two other non-pad classes 0.05 each.
    # logits [0,1,2,3]: log Z = log(1 + e + e^2 + e^3) = 3.440189698561196
    # log p = [-3.44019, -2.44019, -1.44019, -0.44019]; target 3:
    # loss = 0.9 * 0.44019 + 0.05 * (2.44019 + 1.44019) = 0.590189698561196
    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]]])
    target = torch.tensor([[3, 0]])  # the second position is padding: no loss
    sums = label_smoothed_loss(logits, target, eps_ls=0.1, pad_id=0)
    (loss, nll), _ = loss_sums(logits.view(-1, 4), target.view(-1), 0.1, 0)
    # the float32 forward's rounding (``loss_sums``, tests/arith.py); 1.01: the float64 bound's and the golden values' own
    within(sums.loss, torch.tensor(0.590189698561196, dtype=torch.float64), 1.01 * loss.e.view(()))
    within(sums.nll, torch.tensor(0.440189698561196, dtype=torch.float64), 1.01 * nll.e.view(()))
    assert sums.n_tokens.item() == 1


def test_loss_equals_cross_entropy_against_the_smoothed_distribution():
    V = 7
    logits = torch.randn(2, 5, V, dtype=torch.float64)
    target = torch.tensor([[1, 4, 6, 0, 0], [2, 2, 3, 5, 0]])
    q = smoothed_targets(target.view(-1), V, 0.2, 0)
    want = -(q * torch.log_softmax(logits.view(-1, V), -1)).sum()
    got = label_smoothed_loss(logits, target, 0.2, 0).loss
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    # the distribution: rows sum to 1 (0 for padding), pad column gets nothing
    assert torch.allclose(q.sum(-1), (target.view(-1) != 0).double())
    assert torch.all(q[:, 0] == 0)


def test_no_smoothing_is_plain_nll():
    logits = torch.randn(1, 3, 6)
    target = torch.tensor([[1, 2, 5]])
    sums = label_smoothed_loss(logits, target, 0.0, 0)
    want = torch.nn.functional.cross_entropy(logits.view(-1, 6), target.view(-1), reduction="sum")
    (fused, _), (ref, _) = loss_sums(logits.view(-1, 6), target.view(-1), 0.0, 0)  # pad 0: no target is padding
    # cross_entropy = -sum log_softmax gathered, the reference's arithmetic; each path's float32 rounding
    # (``loss_sums``, tests/arith.py); 1.01: float64's own rounding
    within(sums.loss, want.double(), 1.01 * (fused.e + ref.e).view(()))


@pytest.mark.parametrize("eps_ls", [0.0, 0.1, 0.3])
def test_fused_loss_matches_autograd_reference_in_float64(eps_ls, monkeypatch):
    # Both sums and their gradients, with padding rows, and blocks that do not divide N.
    monkeypatch.setattr(objective, "_BLOCK_ELEMENTS", 3 * 11)  # 3 rows per block
    V = 11
    target = torch.tensor([[1, 4, 10, 0, 0], [2, 2, 3, 5, 0], [7, 8, 9, 6, 1]])
    base = torch.randn(3, 5, V, dtype=torch.float64)
    g_loss, g_nll = 0.7, -0.3  # arbitrary weights so both backward paths are checked
    grads = []
    for fn in (label_smoothed_loss, label_smoothed_loss_reference):
        logits = base.clone().requires_grad_(True)
        sums = fn(logits, target, eps_ls, 0)
        (g_loss * sums.loss + g_nll * sums.nll).backward()
        grads.append((sums.loss.item(), sums.nll.item(), int(sums.n_tokens), logits.grad))
    (l1, n1, k1, g1), (l2, n2, k2, g2) = grads
    assert l1 == pytest.approx(l2, rel=1e-12) and n1 == pytest.approx(n2, rel=1e-12) and k1 == k2 == 12
    assert torch.allclose(g1, g2, rtol=1e-10, atol=1e-12)
    assert torch.all(g1[target == 0] == 0)  # padding positions get no gradient


def test_fused_loss_gradient_is_softmax_minus_q():
    # d loss / d z = p - q on a kept row: hand-check on V = 4, target 3, eps 0.1
    # (q = [0, 0.05, 0.05, 0.9]; p = softmax([0, 1, 2, 3]) = [0.0320586, 0.0871443, 0.2368828, 0.6439143]).
    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0]]], requires_grad=True)
    label_smoothed_loss(logits, torch.tensor([[3]]), 0.1, 0).loss.backward()
    want = torch.tensor([0.0320586, 0.0371443, 0.1868828, -0.2560857], dtype=torch.float64)
    # within float32's running error of the backward (``smoothed_loss_gradients``) and the 7 decimals written
    fused, _ = smoothed_loss_gradients(logits.detach().view(1, 4), torch.tensor([3]), 0.1, 0)
    within(logits.grad.view(-1), want, fused.e.view(-1) + 0.5e-7)


def test_fused_loss_bf16_logits_close_to_reference():
    torch.manual_seed(0)
    V = 300
    target = torch.randint(1, V, (4, 9))
    target[0, 5:] = 0
    base = (3 * torch.randn(4, 9, V)).bfloat16()
    out = []
    for fn in (label_smoothed_loss, label_smoothed_loss_reference):
        logits = base.clone().requires_grad_(True)
        sums = fn(logits, target, 0.1, 0)
        sums.loss.backward()
        out.append((sums.loss.float(), logits.grad))
    assert out[0][1].dtype == torch.bfloat16
    (f_loss, _), (r_loss, _) = loss_sums(base.view(-1, V), target.view(-1), 0.1, 0)
    within(out[0][0], out[1][0].double(), 1.01 * (f_loss.e + r_loss.e).view(()))  # each path's float32 rounding
    fused, ref = smoothed_loss_gradients(base.view(-1, V), target.view(-1), 0.1, 0)
    assert torch.allclose(fused.v, ref.v, rtol=1e-9, atol=1e-12)  # both p - q (two float64 evaluations)
    # each path's float32 arithmetic and its rounding to bfloat16 (Rounded); 1.01: float64's own rounding
    within(out[0][1].view(-1, V), out[1][1].view(-1, V).double(), 1.01 * (fused.e + ref.e))


def test_linear_decay_to_zero_golden():
    # d_model 256, warmup 1000, scale 1.5, max_steps 1000, decay over the last 40% (steps 600..1000)
    peak = 1.5 * 256 ** -0.5 * 1000 ** -0.5  # Eq. 3 at step 1000 = 2.9646e-3
    from aiayn.train.objective import learning_rate
    assert learning_rate(500, 256, 1000, 1.5, 1000, 0.4) == pytest.approx(noam_lr(500, 256, 1000, 1.5), rel=1e-12)
    assert learning_rate(600, 256, 1000, 1.5, 1000, 0.4) == pytest.approx(noam_lr(600, 256, 1000, 1.5), rel=1e-12)
    # step 800: Eq. 3 = 1.5 * 256^-0.5 * 800 * 1000^-1.5 = 2.3717e-3, ramp (1000-800)/400 = 0.5
    assert learning_rate(800, 256, 1000, 1.5, 1000, 0.4) == pytest.approx(0.5 * 2.3717082451262845e-03, rel=1e-9)
    assert learning_rate(1000, 256, 1000, 1.5, 1000, 0.4) == 0.0
    assert learning_rate(1000, 256, 1000, 1.5, 1000, 0.0) == pytest.approx(peak, rel=1e-12)  # off: Eq. 3


def test_linear_decay_measured_in_wall_time_golden():
    # The same schedule as above with progress p = max(step / max_steps, time_frac):
    # d_model 256, warmup 1000, scale 1.5, max_steps 1000, decay over the last 40%.
    from aiayn.train.objective import learning_rate
    eq3_200 = 1.5 * 256 ** -0.5 * 200 * 1000 ** -1.5  # 5.9293e-4 (step 200, still warming up)
    # step 200 is 20% of the steps; 80% of the time budget is gone: ramp (1 - 0.8) / 0.4 = 0.5
    assert learning_rate(200, 256, 1000, 1.5, 1000, 0.4, time_frac=0.8) == pytest.approx(0.5 * eq3_200, rel=1e-9)
    assert learning_rate(200, 256, 1000, 1.5, 1000, 0.4, time_frac=0.6) == pytest.approx(eq3_200, rel=1e-12)
    assert learning_rate(200, 256, 1000, 1.5, 1000, 0.4, time_frac=1.0) == 0.0
    assert learning_rate(200, 256, 1000, 1.5, 1000, 0.4, time_frac=1.3) == 0.0  # past the budget: never negative
    # steps further along than time: the step ramp rules (step 800: 0.5, as above)
    assert learning_rate(800, 256, 1000, 1.5, 1000, 0.4, time_frac=0.1) == pytest.approx(0.5 * 2.3717082451262845e-03, rel=1e-9)
    assert learning_rate(200, 256, 1000, 1.5, 1000, 0.0, time_frac=0.9) == pytest.approx(eq3_200, rel=1e-12)  # ramp off


def test_linear_decay_measured_in_epochs_golden():
    # train.max_epochs: the ramp's progress is max(step / max_steps, epochs / max_epochs).
    # d_model 256, warmup 1000, scale 1.5, max_steps 100,000, max_epochs 2, decay over the last 40%.
    from aiayn.train.objective import Schedule
    schedule = Schedule(256, 1000, 1.5, 100_000, 0.4, by_budget=False, whole_by_time=False, max_time_min=0.0,
                        max_flops=0.0, max_epochs=2)
    eq3_800 = 2.3717082451262845e-03  # 1.5 * 256^-0.5 * 800 * 1000^-1.5
    assert schedule.rate(800, epochs=1.0) == pytest.approx(eq3_800, rel=1e-12)  # half the epochs: no ramp yet
    assert schedule.rate(800, epochs=1.6) == pytest.approx(0.5 * eq3_800, rel=1e-9)  # (1 - 0.8) / 0.4
    assert schedule.rate(800, epochs=2.0) == 0.0  # the last epoch's last step
    unbounded = Schedule(256, 1000, 1.5, 100_000, 0.4, by_budget=False, whole_by_time=False, max_time_min=0.0,
                         max_flops=0.0, max_epochs=0)
    assert unbounded.rate(800, epochs=1.6) == pytest.approx(eq3_800, rel=1e-12)  # no epoch limit: steps alone


def _whole_by_time(step: int, max_steps: int, decay_frac: float, time_frac: float, whole: bool = True) -> float:
    """``Schedule.rate`` with d_model 256, warmup 1000, scale 1.5, a budget of 1 minute of which
    ``time_frac`` is gone, and ``train.lr_schedule_by_time`` = ``whole``."""
    from aiayn.train.objective import Schedule
    schedule = Schedule(256, 1000, 1.5, max_steps, decay_frac, by_budget=True, whole_by_time=whole, max_time_min=1.0,
                        max_flops=0.0)
    return schedule.rate(step, elapsed=60 * time_frac)


def test_whole_schedule_measured_in_wall_time_golden():
    # lr_schedule_by_time: Eq. 3 at step' = max(step, time_frac * max_steps), the ramp at step' / max_steps.
    # d_model 256, warmup 1000, scale 1.5, max_steps 1000, decay over the last 40%.
    # step 200, half the time gone: step' = 500, Eq. 3 = 1.5 * 256^-0.5 * 500 * 1000^-1.5 = 1.4823e-3, no ramp yet
    assert _whole_by_time(200, 1000, 0.4, 0.5) == pytest.approx(1.482317653203928e-03, rel=1e-9)
    # 80% of the time gone: step' = 800, Eq. 3 = 2.3717e-3, ramp (1 - 0.8) / 0.4 = 0.5
    assert _whole_by_time(200, 1000, 0.4, 0.8) == pytest.approx(0.5 * 2.3717082451262845e-03, rel=1e-9)
    # time behind the steps: step' = step, the plain schedule (Eq. 3 at 200 = 5.9293e-4)
    assert _whole_by_time(200, 1000, 0.4, 0.1) == pytest.approx(5.929270612815711e-04, rel=1e-9)
    # past the warmup: max_steps 4000, step 300, half the time: step' = 2000,
    # Eq. 3 = 1.5 * 256^-0.5 * 2000^-0.5 = 2.0963e-3 (ramp off)
    assert _whole_by_time(300, 4000, 0.0, 0.5) == pytest.approx(2.096313728906e-03, rel=1e-9)
    assert _whole_by_time(300, 4000, 0.0, 0.5, whole=False) == pytest.approx(noam_lr(300, 256, 1000, 1.5), rel=1e-12)
    assert _whole_by_time(1000, 1000, 0.4, 1.2) == 0.0  # past the budget


def test_lr_schedule_by_time_needs_a_budget():
    from aiayn.config import ConfigError
    from aiayn.train.config import TrainConfig
    with pytest.raises(ConfigError, match="lr_schedule_by_time"):
        TrainConfig(lr_schedule_by_time=True)
    assert TrainConfig(lr_schedule_by_time=True, max_time_min=45).lr_schedule_by_time


def test_lr_decay_by_time_needs_a_ramp_and_a_budget():
    from aiayn.config import ConfigError
    from aiayn.train.config import TrainConfig
    with pytest.raises(ConfigError, match="lr_decay_by_time"):
        TrainConfig(lr_decay_by_time=True, lr_decay_frac=0.5)  # no max_time_min
    with pytest.raises(ConfigError, match="lr_decay_by_time"):
        TrainConfig(lr_decay_by_time=True, max_time_min=45)  # no ramp
    assert TrainConfig(lr_decay_by_time=True, lr_decay_frac=0.5, max_time_min=45).lr_decay_by_time


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_bpe_dropout_is_a_probability_below_one(p):
    from aiayn.config import ConfigError
    from aiayn.train.config import TrainConfig
    with pytest.raises(ConfigError, match=r"bpe_dropout must be in \[0, 1\)"):
        TrainConfig(bpe_dropout=p)
    assert TrainConfig(bpe_dropout=0.1).bpe_dropout == 0.1 and TrainConfig().bpe_dropout == 0.0  # off: the paper


def test_rdrop_kl_hand_computed():
    # Copy 1: logits [0, 0, 0] -> p1 = [1/3, 1/3, 1/3]; copy 2: [0, 0, ln 2] -> p2 = [1/4, 1/4, 1/2].
    # 1/2 sum_v (p1 - p2)(log p1 - log p2) = 1/2 [2 (1/12) ln(4/3) - (1/6) ln(2/3)] = ln(2) / 12.
    # A second position is padding in the target: whatever its logits, it adds nothing.
    logits = torch.tensor([[[0.0, 0.0, 0.0], [5.0, -1.0, 2.0]],
                           [[0.0, 0.0, math.log(2.0)], [-3.0, 0.0, 1.0]]], dtype=torch.float64)  # (2B,T,V), B=1
    target = torch.tensor([[2, 0]])  # pad_id 0
    assert rdrop_kl(logits, target, pad_id=0).item() == pytest.approx(math.log(2.0) / 12, rel=1e-12)


def test_rdrop_kl_is_the_mean_of_the_two_kl_divergences():
    B, T, V = 3, 4, 9
    logits = torch.randn(2 * B, T, V, dtype=torch.float64)
    target = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 1]])
    lp1, lp2 = torch.log_softmax(logits[:B], -1), torch.log_softmax(logits[B:], -1)
    kl12 = torch.nn.functional.kl_div(lp2, lp1, log_target=True, reduction="none").sum(-1)  # KL(p1 || p2)
    kl21 = torch.nn.functional.kl_div(lp1, lp2, log_target=True, reduction="none").sum(-1)
    want = ((kl12 + kl21) / 2)[target.ne(0)].sum()
    assert rdrop_kl(logits, target, 0).item() == pytest.approx(want.item(), rel=1e-10)
    # identical copies agree: no consistency loss, and none from bf16 logits either
    same = torch.cat([logits[:B], logits[:B]]).bfloat16()
    assert rdrop_kl(same, target, 0).item() == 0.0


def test_rdrop_alpha_is_not_negative():
    from aiayn.config import ConfigError
    from aiayn.train.config import TrainConfig
    with pytest.raises(ConfigError, match="rdrop_alpha"):
        TrainConfig(rdrop_alpha=-1.0)
    assert TrainConfig().rdrop_alpha == 0.0  # off: the paper


def test_rdrop_kl_gradient_matches_autograd_in_float64():
    B, T, V = 2, 5, 11
    logits = torch.randn(2 * B, T, V, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]])
    before = logits.detach().clone()
    got = rdrop_kl(logits, target, 0)
    (g_got,) = torch.autograd.grad(3.0 * got, logits)
    want = rdrop_kl_reference(logits, target, 0)
    (g_want,) = torch.autograd.grad(3.0 * want, logits)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(g_got, g_want, atol=1e-14)
    assert torch.equal(logits.detach(), before)  # float64 statistics are computed on a copy
    assert torch.autograd.gradcheck(lambda z: rdrop_kl(z, target, 0), (logits,))


def test_rdrop_kl_bf16_logits_close_to_reference(monkeypatch):
    monkeypatch.setattr(objective, "_BLOCK_ELEMENTS", 3 * 50)  # several blocks of 3 rows
    logits = (3 * torch.randn(2 * 4, 6, 50)).bfloat16().requires_grad_()
    target = torch.randint(1, 50, (4, 6))
    target[1, 3:] = 0
    got = rdrop_kl(logits, target, 0)
    (g_got,) = torch.autograd.grad(got, logits)
    ref_in = logits.detach().float().requires_grad_()
    want = rdrop_kl_reference(ref_in, target, 0)
    want.backward()
    assert got.dtype == torch.float32 and g_got.dtype == torch.bfloat16
    # the gradient of each copy's kept rows, p1 (d - KL12 + 1) - p2 over 2 and its mirror, as each path
    # computes it in float32 (Rounded): _SymmetricKL's forward, l = z - logsumexp(z), d = l1 - l2,
    # KL12 = p1 . d, KL21 = -p2 . d, ((d + (1 - KL12)) p1 - p2) 0.5, rounded to bfloat16 (times the
    # upstream 1: exact); the reference's autograd, d/dlp1 = 0.5 d p1 + 0.5 (p1 - p2) and its mirror,
    # then log_softmax's backward, in float32
    keep = target.reshape(-1) != 0
    z1, z2 = (Rounded(h.reshape(-1, 50)[keep]) for h in logits.detach().reshape(2, -1, 6, 50).unbind(0))
    l1, l2 = z1 - z1.logsumexp(), z2 - z2.logsumexp()
    d, p1, p2 = l1 - l2, l1.exp(), l2.exp()
    fused = (((d + (1 - (p1 * d).sum())) * p1 - p2) * 0.5, ((-d + (1 + (p2 * d).sum())) * p2 - p1) * 0.5)
    lp1, lp2 = z1.log_softmax(), z2.log_softmax()
    P, Q, D = lp1.exp(), lp2.exp(), lp1 - lp2
    dlp1, dlp2 = D * 0.5 * P + (P - Q) * 0.5, -(D * 0.5) * Q - (P - Q) * 0.5
    ref = (dlp1 - lp1.exp() * dlp1.sum(), dlp2 - lp2.exp() * dlp2.sum())
    # the value: the fused path's sum of every row's KL12 and KL21 (in blocks: one sum of 2N terms in
    # some order) times 0.5 (exact), the reference's sum of the N V products (P - Q) D times 0.5
    flat = lambda r: Rounded(r.v.reshape(-1), r.e.reshape(-1))  # noqa: E731
    k12, k21 = (p1 * d).sum(), -(p2 * d).sum()
    fused_kl = Rounded(torch.cat([k12.v, k21.v]).reshape(-1), torch.cat([k12.e, k21.e]).reshape(-1)).sum(0) * 0.5
    ref_kl = flat((P - Q) * D).sum(0) * 0.5
    assert torch.allclose(fused_kl.v, ref_kl.v, rtol=1e-9, atol=1e-12)  # the same value (float64 twice)
    within(got.reshape(1), want.double().reshape(1), 1.01 * (fused_kl.e + ref_kl.e))
    for half in (0, 1):
        assert torch.allclose(fused[half].v, ref[half].v, rtol=1e-9, atol=1e-12)  # the same value (float64 twice)
        within(g_got.reshape(2, -1, 50)[half][keep], ref_in.grad.reshape(2, -1, 50)[half][keep].double(),
               1.01 * (fused[half].to(torch.bfloat16).e + ref[half].e))  # 1.01: float64's own rounding


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_gradients_with_the_loss_kernel(precision):
    """train.c_kernels (the default on CPU) is a fast path: a model's gradients through the C loss
    (kernels/loader.py, cross_entropy.c) are PyTorch's path's, up to rounding."""
    from aiayn.kernels.loader import load
    from aiayn.model import ModelConfig, Transformer
    from aiayn.train import runtime as rt

    kernels = load()
    if kernels is None:
        pytest.skip("no C compiler: training uses PyTorch's loss (tested above)")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, n_layers=1, d_model=32, d_ff=64, n_heads=2, d_k=16, d_v=16,
                                    p_drop=0.0))
    src, tgt = torch.randint(3, 50, (3, 6)), torch.randint(3, 50, (3, 5))
    tgt[2, 3:] = 0
    grads = []
    for k in (kernels, None):
        model.zero_grad()
        with rt.autocast(torch.device("cpu"), precision):
            logits = model(src, tgt)
        z = logits.detach().clone()  # before the backward, which may reuse the logits' storage
        sums = label_smoothed_loss(logits, tgt, 0.1, 0, k)
        (sums.loss / sums.n_tokens).backward()
        grads.append((z, sums.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (z1, l1, g1), (z2, l2, g2) = grads
    # each path's loss against the exact loss of its own logits (the two forwards need not agree bit for bit),
    # within its float32 rounding (``loss_sums``, tests/arith.py: cross_entropy.c has vexp.h's exp and libm's logf); 1.01: float64's
    t = tgt.reshape(-1)
    (c_loss, _), _ = loss_sums(z1.reshape(-1, 50).float(), t, 0.1, 0, exp_rel=EXP_REL_ERR)
    (pt_loss, _), _ = loss_sums(z2.reshape(-1, 50).float(), t, 0.1, 0)
    within(l1, c_loss.v.view(()), 1.01 * c_loss.e.view(()))
    within(l2, pt_loss.v.view(()), 1.01 * pt_loss.e.view(()))
    if precision == "fp32":  # each path's gradients within float32's roundings of the exact ones (``gradient_bound``)
        batch = SimpleNamespace(src=src, tgt_in=tgt, tgt_out=tgt)
        same_gradients(g1, g2, gradient_bound(model, "fp32", batch, 0.1, 1 / float(sums.n_tokens)))
        return
    tol = 2e-2  # bf16: a hand tolerance (autocast's backward is not followed by gradient_bound)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=tol * g2[name].abs().max().item() + 1e-7, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_block_size_does_not_change_the_sums(dtype, monkeypatch):
    """The GPU's few large blocks (``_BLOCK_ELEMENTS_CUDA``) against the CPU's cache-sized ones,
    here both on the CPU: the same sums and gradients bit for bit (the arithmetic is per row)."""
    V = 37
    torch.manual_seed(3)
    target = torch.randint(1, V, (6, 9))
    target[2, 5:] = 0
    base = (torch.randn(6, 9, V) * 3).to(dtype)
    out = []
    for elements in (2 * V, 2 ** 28):  # 2 rows per block; one block
        monkeypatch.setattr(objective, "_BLOCK_ELEMENTS", elements)
        logits = base.clone().requires_grad_(True)
        sums = label_smoothed_loss(logits, target, 0.1, 0)
        (sums.loss * 0.7 + sums.nll * 0.2).backward()
        out.append((sums.loss, sums.nll, logits.grad))
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_block_rows_by_device():
    z = torch.empty(5, 1000)
    assert objective._block_rows(z) == 2 ** 20 // 1000
    assert objective._block_rows(torch.empty(5, 2 ** 21)) == 1  # a row longer than a block: one row
    z_cuda = torch.empty(5, 1000, device="meta")
    assert objective._block_rows(z_cuda) == 2 ** 20 // 1000  # only CUDA takes the large blocks
