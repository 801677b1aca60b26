"""A step's numbers read once per step, and the guards around the update: a NaN gradient behind a
finite loss is skipped as a non-finite loss is, and non-finite weights are never checkpointed."""
from __future__ import annotations

import json
import math

import pytest
import torch

import aiayn
from aiayn.errors import UserError
from aiayn.checkpoint.run import check_finite_weights
from aiayn.checkpoint import load_checkpoint
from aiayn.checkpoint.run import Learner
from aiayn.train import loss as loss_mod
from aiayn.train import step, updates
from aiayn.train.loss import SmoothedLoss
from aiayn.train.parallel import OneProcess
from aiayn.train.runtime import Dist, Place
from tests.train.steps import passes, read_step
from tests.train.test_training import _train_in_process


def test_read_step_golden():
    """One process: the sums as given, its own tokens and clock, the gradient norm (0 without one),
    its own counted FLOPs."""
    sums = torch.tensor([12.5, 10.0, 0.25], dtype=torch.float64)
    got = read_step(sums, torch.tensor(3.0), 40.0, torch.device("cpu"), 7.5, flops=2.5e9)
    assert got == (12.5, 10.0, 0.25, 40.0, 7.5, 3.0, 2.5e9)
    got = read_step(sums, None, 40.0, torch.device("cpu"), 7.5)
    assert got[-2:] == (0.0, 0.0)


def test_a_nan_gradient_behind_a_finite_loss_is_skipped(small_data_dir, tmp_path, monkeypatch):
    """At the third step the logits' gradient is made NaN while the loss stays finite: that update
    is skipped (the old loop applied it and every later loss was NaN), the run ends with finite
    weights, and the step is not counted."""
    calls = []
    real = loss_mod.label_smoothed_loss

    def poisoned(logits, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3 and logits.requires_grad:
            logits.register_hook(lambda g: torch.full_like(g, math.nan))
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(loss_mod, "label_smoothed_loss", poisoned)
    summary = _train_in_process(small_data_dir, tmp_path / "run", 6)
    assert summary["steps"] == 6
    ckpt = load_checkpoint(tmp_path / "run" / "last.pt")
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())
    losses = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["train_loss"]) for r in losses if "train_loss" in r)
    assert len(calls) >= 7  # six counted steps and the skipped one 


def test_non_finite_weights_are_not_checkpointed(tmp_path):
    model = aiayn.Transformer(aiayn.get_preset("tiny", vocab_size=50))
    check_finite_weights(model, 3, tmp_path)  # finite: nothing happens
    with torch.no_grad():
        next(model.parameters())[0, 0] = math.inf
    with pytest.raises(UserError, match=f"non-finite weights; not checkpointing them. No checkpoint is in {tmp_path} yet$"):
        check_finite_weights(model, 3, tmp_path)  # (none written yet: none named)
    (tmp_path / "last.pt").write_bytes(b"")
    with pytest.raises(UserError, match=f"non-finite weights.*The last good checkpoint is {tmp_path / 'last.pt'}$"):
        check_finite_weights(model, 3, tmp_path)


def _tiny_step(**train):
    from aiayn.data.batching import collate
    from aiayn.train.config import RunConfig, TrainConfig
    from aiayn.train.loop import schedule_of
    from aiayn.train.objective import make_optimizer
    torch.manual_seed(0)
    cfg = aiayn.get_preset("tiny", vocab_size=40, p_drop=0.0)
    model = aiayn.Transformer(cfg).train()
    opt = make_optimizer(model.parameters(), 1.0, (0.9, 0.98), 1e-9, fused=True)
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(4, 40, (n,), generator=g).numpy(), torch.randint(4, 40, (n + 1,), generator=g).numpy())
             for n in (3, 5, 4)]
    batch = collate(pairs, cfg.pad_id, cfg.bos_id, cfg.eos_id)
    t = TrainConfig(eps_ls=0.1, **train)
    place = Place(Dist(), torch.device("cpu"), "fp32")
    stepper = step.TrainStep(Learner(model, opt), SmoothedLoss(t.eps_ls, cfg.pad_id), OneProcess(place),
                             schedule_of(RunConfig(cfg, t)), step.StepRules(t.clip_norm, t.max_bad_steps))
    return model, opt, cfg, t, batch, stepper


def test_train_step_is_the_step_its_parts_make():
    """``TrainStep.step`` (the loop's and the benchmarks' step): Eq. 3's rate at the step, the loss over
    the step's tokens, the update queued before the read (fused Adam): the same numbers and weights,
    bit for bit, as its parts called by hand with the update after the read."""
    from aiayn.train.objective import learning_rate
    model, opt, cfg, t, batch, stepper = _tiny_step()
    s = stepper.step([batch], 3)
    assert s.finite and stepper.update_early
    assert s.lr == learning_rate(3, cfg.d_model, t.warmup_steps) and s.tokens == batch.n_tgt_tokens
    ref_model, ref_opt, *_ = _tiny_step()
    for group in ref_opt.param_groups:
        group["lr"] = s.lr
    sums, _ = passes(ref_model, [batch], t, 1 / batch.n_tgt_tokens, torch.device("cpu"), "fp32")
    norm = updates.grad_norm(list(ref_model.parameters()), None)
    loss, nll, kl, tokens, _, norm_value, _ = read_step(sums, norm, float(batch.n_tgt_tokens), torch.device("cpu"))
    updates.update(Learner(ref_model, ref_opt), t.clip_norm, norm)
    assert (s.loss, s.nll, s.norm) == (loss, nll, norm_value)
    a, b = model.state_dict(), ref_model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_step_skips_non_finite_steps_then_stops_the_run(caplog):
    """A step whose loss is not finite leaves the weights as they were; ``max_bad_steps`` in a row
    stop the run with an error that says what to try."""
    model, opt, cfg, t, batch, stepper = _tiny_step(max_bad_steps=2)
    with torch.no_grad():
        model.src_embed.weight[batch.src[0, 0]] = math.nan  # (tied: source, target and output)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    s = stepper.step([batch], 1)
    assert not math.isfinite(s.loss) and not s.finite
    with pytest.raises(UserError, match="2 non-finite losses or gradients in a row at step 2.*lr_scale"):
        stepper.step([batch], 2)
    after = model.state_dict()
    assert all(torch.allclose(before[k], after[k], rtol=0, atol=0, equal_nan=True) for k in before)
    assert opt.state_dict()["state"] == {} or all(float(v["step"]) == 0 for v in opt.state_dict()["state"].values())


def row_bits(model) -> set[int]:
    """The row padding of every linear map of ``model`` (``aiayn.execution.pad_linear_rows``)."""
    from aiayn.execution.linear import RowPaddedEmbedding, RowPaddedLinear
    return {m.row_bits for m in model.modules() if isinstance(m, (RowPaddedLinear, RowPaddedEmbedding))}


def test_the_run_step_follows_the_configuration(monkeypatch):
    """``TrainStep.for_run``, the loop's and the benchmarks' step: one process takes every step as a
    synchronization point on the plain model; the CPU's C kernels and padded rows follow
    ``train.c_kernels`` and ``train.cpu_row_bits``; ``train.compile`` gives a compiled net beside the
    plain one (the fallback); local SGD, with ranks, averages every ``local_sgd_period`` steps from
    the main rank's weights and wraps no DDP; ``train.rdrop_alpha`` wraps the loss."""
    from aiayn.train import parallel
    from aiayn.train.config import RunConfig, TrainConfig
    from aiayn.train.loop import schedule_of
    from aiayn.train.loss import RDrop
    model, opt, cfg, _, _, _ = _tiny_step()
    cpu, learner = torch.device("cpu"), Learner(model, opt)

    def made(place=Place(Dist(), cpu, "fp32"), **train):
        t = TrainConfig(**train)
        return step.TrainStep.for_run(t, learner, place, schedule_of(RunConfig(cfg, t)))
    plain = made(Place(Dist(), cpu, "bf16"), c_kernels=False, cpu_row_bits=5)
    assert (plain.net, plain.plain_net, plain.strategy.period) == (model, model, 1)
    assert type(plain.strategy) is parallel.OneProcess and type(plain.loss) is SmoothedLoss
    assert plain.loss.kernels is None and row_bits(model) == {5}
    assert isinstance(made(rdrop_alpha=0.5, c_kernels=False).loss, RDrop)
    compiled = object()
    monkeypatch.setattr(parallel, "compile_model", lambda net: compiled)
    s = made(Place(Dist(), cpu, "bf16"), compile=True, cpu_row_bits=5)  # the compiled net's rows unpadded
    assert s.net is compiled and s.plain_net is model and row_bits(model) == {0}
    broadcast = []
    monkeypatch.setattr(parallel, "broadcast_parameters", lambda params, dist: broadcast.append(len(params)))
    monkeypatch.setattr(parallel, "data_parallel", lambda *a, **k: pytest.fail("local SGD wraps no DDP"))
    lsgd = made(Place(Dist(rank=1, world_size=2), cpu, "fp32"), local_sgd_period=4, c_kernels=False)
    assert type(lsgd.strategy) is parallel.LocalSGD and (lsgd.strategy.period, lsgd.net) == (4, model)
    assert broadcast == [len(list(model.parameters()))]
