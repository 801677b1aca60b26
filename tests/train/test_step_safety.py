"""A step's numbers read once per step, and the guards around the update: a NaN gradient behind a
finite loss is skipped as a non-finite loss is, and non-finite weights are never checkpointed."""
from __future__ import annotations

import json
import math

import pytest
import torch

import aiayn
from aiayn.errors import UserError
from aiayn.train.checkpointing import check_finite_weights
from aiayn.train import step
from aiayn.checkpoint import load_checkpoint
from aiayn.train.runtime import Dist
from tests.train.test_training import _train_in_process


def test_read_step_golden():
    """One process: the sums as given, its own tokens and clock, the gradient norm (0 without one)."""
    sums = torch.tensor([12.5, 10.0, 0.25], dtype=torch.float64)
    got = step.read_step(sums, torch.tensor(3.0), None, 40.0, 7.5, Dist(), torch.device("cpu"), reduce=True)
    assert got == (12.5, 10.0, 0.25, 40.0, 7.5, 3.0)
    got = step.read_step(sums, None, None, 40.0, 7.5, Dist(), torch.device("cpu"), reduce=True)
    assert got[-1] == 0.0


def test_a_nan_gradient_behind_a_finite_loss_is_skipped(small_data_dir, tmp_path, monkeypatch):
    """At the third step the logits' gradient is made NaN while the loss stays finite: that update
    is skipped (the old loop applied it and every later loss was NaN), the run ends with finite
    weights, and the step is not counted."""
    calls = []
    real = step.label_smoothed_loss

    def poisoned(logits, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3 and logits.requires_grad:
            logits.register_hook(lambda g: torch.full_like(g, math.nan))
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(step, "label_smoothed_loss", poisoned)
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
    with pytest.raises(UserError, match="non-finite weights.*last good checkpoint"):
        check_finite_weights(model, 3, tmp_path)
