"""Choosing the model: validation BLEU (beam search against the raw references), best.pt and
patience by ``train.best_metric``, and the moving average of the weights (``train.ema_decay``)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from aiayn.checkpoint import load_checkpoint
from aiayn.cli import main
from aiayn.config import ConfigError
from aiayn.data.dataset import DataDir
from aiayn.train import validation
from aiayn.checkpoint.run import TrainState
from aiayn.train.config import TrainConfig
from aiayn.train.ema import WeightAverage

FAST = ["--no-progress", "--set", "train.save_every_min=0", "--set", "train.precision=fp32",
        "--set", "train.threads=1", "--set", "train.max_src_tokens=600", "--set", "train.max_tgt_tokens=600",
        "--set", "train.warmup_steps=50"]


def test_ema_update_by_hand():
    """ema <- d * ema + (1 - d) * w with d = 0.9: 1 then w = 2 gives 1.1; then w = 3 gives 1.29."""
    w = torch.nn.Parameter(torch.tensor([2.0, -1.0]))
    ema = WeightAverage(torch.nn.ParameterList([w]), 0.9, torch.device("cpu"), {"0": torch.tensor([1.0, 0.0])})
    ema.update()
    assert ema.ema[0].tolist() == pytest.approx([1.1, -0.1])
    with torch.no_grad():
        w.copy_(torch.tensor([3.0, -1.0]))
    ema.update()
    assert ema.ema[0].tolist() == pytest.approx([1.29, -0.19])
    with ema.weights():  # the model holds the average inside, its own weights after
        assert w.tolist() == pytest.approx([1.29, -0.19])
    assert w.tolist() == [3.0, -1.0]


@pytest.mark.parametrize("metric, bad", [("bleu", [0, 0, 1, 2, 0]), ("loss", [0, 1, 0, 1, 2])])
def test_patience_counts_validations_without_a_gain_in_the_chosen_metric(metric, bad):
    scripted = iter([(10.0, 3.0), (12.0, 3.1), (11.0, 2.9), (12.0, 3.0), (12.5, 3.2)])  # (bleu, loss)

    def result():
        bleu, loss = next(scripted)
        return {"valid_loss": loss, "valid_nll": loss, "valid_ppl": math.exp(loss), "valid_bleu": bleu, "valid_seconds": 2.0, "valid_bleu_seconds": 1.5}

    state = TrainState()
    seen = []
    for _ in bad:
        validation.track(result(), state, metric)
        seen.append(state.bad_validations)
    assert seen == bad
    assert state.best_valid_bleu == 12.5 and state.best_valid_loss == 2.9
    assert state.valid_seconds == 10.0 and state.valid_bleu_seconds == 7.5


def test_bleu_choice_needs_valid_bleu_and_decay_is_bounded():
    with pytest.raises(ConfigError, match="valid_bleu"):
        TrainConfig(best_metric="bleu")
    with pytest.raises(ConfigError, match="loss or bleu"):
        TrainConfig(best_metric="chrf")
    with pytest.raises(ConfigError, match="ema_decay"):
        TrainConfig(ema_decay=1.0)


def test_references_are_the_raw_lines_prepare_read(small_data_dir):
    data = DataDir(small_data_dir)
    refs = data.references("valid")
    raw = data.manifest["splits"]["valid"]["inputs"]["tgt"]
    assert refs == [line.strip() for line in open(raw, encoding="utf-8")]
    assert len(refs) == len(data.split("valid")) == 100
    assert data.references("train") is None  # cleaned: its pairs no longer match its lines


@pytest.mark.slow
def test_best_by_bleu_ema_and_resume(small_data_dir, tmp_path, capsys):
    """best.pt follows validation BLEU; ema.pt holds the moving average and translates; a run
    stopped and resumed ends with the same moving average as one run straight through."""
    opts = [*FAST, "--set", "train.validate_every_steps=2", "--set", "train.save_every_steps=2",
            "--set", "train.valid_bleu=true", "--set", "train.valid_bleu_max_lines=8", "--set", "train.valid_beam=2",
            "--set", "train.best_metric=bleu", "--set", "train.ema_decay=0.5", "--set", "train.keep_last=0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", "--data", str(small_data_dir), "--out", str(straight), "--preset", "tiny",
                 "--max-steps", "6", *opts]) == 0
    assert main(["train", "--data", str(small_data_dir), "--out", str(resumed), "--preset", "tiny",
                 "--max-steps", "4", *opts]) == 0
    assert main(["train", "--data", str(small_data_dir), "--out", str(resumed), "--preset", "tiny",
                 "--max-steps", "6", *opts]) == 0

    steps = [load_checkpoint(p) for p in sorted(straight.glob("ckpt_step*.pt"))]
    best = load_checkpoint(straight / "best.pt")
    assert best["valid"]["valid_bleu"] == max(c["valid"]["valid_bleu"] for c in steps) == best["best_valid_bleu"]
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["best_metric"] == "bleu" and summary["valid_bleu_seconds"] > 0
    assert summary["valid_seconds"] >= summary["valid_bleu_seconds"]

    ema, last = load_checkpoint(straight / "ema.pt"), load_checkpoint(straight / "last.pt")
    assert "optimizer" not in ema and ema["ema_decay"] == 0.5
    assert "optimizer" not in best and best["ema_decay"] == 0.5  # best.pt holds the weights validated
    assert any(not torch.equal(ema["model"][k], last["model"][k]) for k in last["model"])
    for k, v in load_checkpoint(resumed / "ema.pt")["model"].items():
        assert torch.equal(v, ema["model"][k]), k
    src = tmp_path / "in.txt"
    src.write_text("A dog runs.\n")
    capsys.readouterr()
    assert main(["translate", "--checkpoint", str(straight / "ema.pt"), "--input", str(src), "--quiet"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert math.isfinite(summary["valid"]["valid_loss"])


@pytest.mark.slow
def test_two_processes_share_the_validation_translations(small_data_dir, tmp_path):
    """Each of 2 data-parallel ranks translates every other validation line; the gathered BLEU is
    the one process's BLEU of the same weights: the same translations scored by the same code, so the
    same number."""
    import subprocess
    import sys
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "aiayn.cli",
           "train", "--data", str(small_data_dir), "--out", str(run), "--preset", "tiny", "--max-steps", "3", *FAST,
           "--set", "train.validate_every_steps=0", "--set", "train.valid_bleu=true",
           "--set", "train.valid_bleu_max_lines=15", "--set", "train.valid_beam=2"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    gathered = json.loads((run / "summary.json").read_text())["valid"]["valid_bleu"]
    from aiayn.decode.loading import load_model_for_inference
    model, src_tok, tgt_tok = load_model_for_inference(run / "last.pt")
    data = DataDir(small_data_dir)
    alone = validation.valid_bleu(model, data.split("valid"), validation.Bleu((src_tok, tgt_tok), data.references("valid")),
                                  15, None, 2)
    assert gathered == alone
