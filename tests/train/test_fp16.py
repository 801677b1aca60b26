"""fp16 training with its gradient scaler: what ``train.precision=auto`` takes on a T4, V100 or
P100 (``runtime.resolve_precision``). aiayn refuses fp16 on the CPU because it is slow there, not
because it computes anything else, so these tests run the scaler's path on the CPU (PyTorch's CPU
autocast to float16 and ``GradScaler("cpu")``) with that refusal lifted; tests/gpu/test_cuda.py
runs the same step on CUDA."""
from __future__ import annotations

import functools
import math

import pytest
import torch

import aiayn
from aiayn.checkpoint import load_checkpoint
from aiayn.checkpoint.run import Learner
from aiayn.errors import UserError
from aiayn.train import runtime as rt
from aiayn.train.config import RunConfig, TrainConfig
from aiayn.train.loop import schedule_of
from aiayn.train.objective import optimizer_for
from aiayn.train.step import TrainStep
from tests.train.test_fused_loss import _batch
from tests.train.test_training import _logged, _train_in_process

CPU = torch.device("cpu")


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """``train.precision=fp16`` accepted on the CPU (the refusal lifted, nothing else changed)."""
    resolve = rt.resolve_precision
    monkeypatch.setattr(rt, "resolve_precision",
                        lambda spec, device: ("fp16", "test") if spec == "fp16" else resolve(spec, device))


def overflow_then_recover(device: torch.device) -> None:
    """The loop's fp16 step (``TrainStep.for_run``) on ``device`` with its scaler started at 2^40: the
    float16 gradients overflow, and the scaler leaves the weights and Adam's state as they were (fused
    Adam's step count and moments stay 0) and halves its scale; the step's loss is finite, so the run
    goes on, the step not counted (as fairseq), and once the scale has come down a step updates the
    weights."""
    cfg = aiayn.get_preset("tiny", vocab_size=61, p_drop=0.0)
    t = TrainConfig(precision="fp16", warmup_steps=4)
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).to(device).train()
    schedule = schedule_of(RunConfig(cfg, t))
    learner = Learner(model, optimizer_for(model.parameters(), t, schedule, device),
                      torch.amp.GradScaler(device.type, init_scale=2.0 ** 40))
    stepper = TrainStep.for_run(t, learner, rt.Place(rt.Dist(), device, "fp16"), schedule)
    batch = _batch(cfg, n=8)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    s = stepper.step([batch], 1)
    assert not s.finite and math.isfinite(s.loss) and not math.isfinite(s.norm)  # the gradients overflowed
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    assert all(int(st["step"]) == 0 and not st["exp_avg"].any() for st in learner.opt.state.values())
    assert learner.scaler.get_scale() == 2.0 ** 39
    n = 1
    while all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items()):
        n += 1
        assert n <= 40, "the scale never came down to where float16 holds the gradients"
        s = stepper.step([batch], n)
    assert s.finite and 0 < s.norm < math.inf  # the unscaled gradients' norm
    assert learner.scaler.get_scale() == 2.0 ** (41 - n)  # halved at each of the n - 1 skipped steps
    assert int(learner.opt.state[learner.params[0]]["step"]) == 1  # Adam took the one step


def test_an_overflowing_fp16_step_is_skipped_and_its_scale_halved():
    overflow_then_recover(CPU)


def gradients_not_finite_at_any_scale(device: torch.device) -> None:
    """The loop's fp16 step on ``device`` with a NaN in one parameter's gradient at every step behind a
    finite loss: the scaler skips every update and halves its scale each time, and each skip is
    logged; once the scale falls below ``MIN_LOSS_SCALE`` the run stops with an error that says why,
    its weights untouched. (Left to go on, every step counted as trained, nothing said why the loss
    stood still, and after some 165 skips the scale reached 0: the first step with finite gradients
    after that was unscaled as 0 x 1/0, NaN in every weight.)"""
    cfg = aiayn.get_preset("tiny", vocab_size=61, p_drop=0.0)
    t = TrainConfig(precision="fp16", warmup_steps=4)
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).to(device).train()
    schedule = schedule_of(RunConfig(cfg, t))
    learner = Learner(model, optimizer_for(model.parameters(), t, schedule, device), torch.amp.GradScaler(device.type))
    learner.params[-1].register_hook(lambda g: torch.full_like(g, float("nan")))
    stepper = TrainStep.for_run(t, learner, rt.Place(rt.Dist(), device, "fp16"), schedule)
    batch = _batch(cfg, n=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    skipped = 0
    with pytest.raises(UserError, match=r"fp16's loss scale fell to .* at step \d+.*not finite at any scale.*"
                                        r"precision=fp32"):
        for n in range(1, 200):
            s = stepper.step([batch], n)
            assert not s.finite and math.isfinite(s.loss)  # the loss is finite, the gradients not
            skipped = n
    assert 16 + 13 <= skipped + 1 < 60  # 2^16 halved past 1e-4 (2^-13.3)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_gradients_not_finite_at_any_scale_stop_an_fp16_run(caplog):
    with caplog.at_level("INFO", logger="aiayn.train.step"):
        gradients_not_finite_at_any_scale(CPU)
    assert sum("fp16 gradients overflowed" in m for m in caplog.messages) >= 29


def test_the_scalers_state_is_saved_and_resumed(small_data_dir, tmp_path, fp16_on_cpu, monkeypatch):
    """An fp16 run of 12 steps, and the same run stopped at step 6 and resumed: the same weights and
    the same scaler state (its scale and growth count: with a growth interval of 3 the scale moves
    within the run, so a resume that lost it would end elsewhere)."""
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, growth_interval=3))

    def train(run, steps):
        _train_in_process(small_data_dir, run, steps, "train.precision=fp16", "train.save_every_steps=3")
        return load_checkpoint(run / "last.pt")

    whole = train(tmp_path / "whole", 12)
    half = train(tmp_path / "resumed", 6)
    assert half["step"] == 6 and half["scaler"] != whole["scaler"]
    resumed = train(tmp_path / "resumed", 12)
    assert whole["scaler"]["scale"] != 65536.0  # it moved
    assert resumed["scaler"] == whole["scaler"]
    for k, v in whole["model"].items():
        assert torch.equal(resumed["model"][k], v), k
    assert _logged(tmp_path / "resumed") == _logged(tmp_path / "whole")


def test_overflowing_fp16_steps_do_not_count(small_data_dir, tmp_path, fp16_on_cpu, monkeypatch, caplog):
    """A run whose scaler starts at 2^40: its first steps overflow, and each is skipped without counting
    (as fairseq's ``num_updates``): a run of 6 steps takes 6 updates, Adam's step count is 6, and the
    log names every overflow and gives a finite gradient norm at every logged step (the unscaled
    gradients', not 0)."""
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0 ** 40))
    with caplog.at_level("INFO", logger="aiayn.train.step"):
        _train_in_process(small_data_dir, tmp_path, 6, "train.precision=fp16")
    overflows = [m for m in caplog.messages if "fp16 gradients overflowed" in m]
    assert len(overflows) >= 10  # 2^40 halved to where float16 holds the gradients
    ckpt = load_checkpoint(tmp_path / "last.pt")
    assert ckpt["step"] == 6
    assert {int(st["step"]) for st in ckpt["optimizer"]["state"].values()} == {6}
    norms = _logged(tmp_path, "grad_norm")
    assert sorted(norms) == [1, 2, 3, 4, 5, 6] and all(0 < v < math.inf for v in norms.values())
