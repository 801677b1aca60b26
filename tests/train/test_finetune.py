"""Fine-tuning: prepare --tokenizer-from and train --init-from (aiayn/train/finetune.py)."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.data.batching import collate
from aiayn.data.dataset import DataDir
from aiayn.decode.loading import load_models_for_inference
from aiayn.checkpoint import load_checkpoint, tokenizer_hashes
from tests.arith import LAMBDA, U32
from tests.conftest import COPY_TRAIN, copy_lines
from tests.rounding import loss_bound


def _reverse_corpus(d: Path) -> list[str]:
    """A shifted domain of the copy task: the target is the source reversed. prepare's file options."""
    d.mkdir(parents=True, exist_ok=True)
    argv = []
    for split, n, seed in (("train", 1500, 3), ("valid", 100, 4)):
        src = copy_lines(n, seed)
        (d / f"{split}.src").write_text("\n".join(src) + "\n")
        (d / f"{split}.tgt").write_text("\n".join(" ".join(s.split()[::-1]) for s in src) + "\n")
        argv += [f"--{split}-src", str(d / f"{split}.src"), f"--{split}-tgt", str(d / f"{split}.tgt")]
    return argv


def _finetune(data: Path, out: Path, ckpt: Path, steps: int, *extra: str) -> dict:
    sets = [a for a in COPY_TRAIN if a not in ("--preset", "tiny")]
    assert main(["train", "--data", str(data), "--out", str(out), "--init-from", str(ckpt),
                 "--max-steps", str(steps), *sets, *extra]) == 0
    return json.loads((out / "summary.json").read_text())


def _valid_loss_bound(ckpt: Path, data: Path) -> float:
    """How far float32's roundings move the checkpoint's validation loss (NLL per token: eps_ls 0)
    on ``data``'s valid split from the exact one: each sentence's bound of its summed NLL
    (``loss_bound``, tests/rounding.py), and the sum's own roundings over the tokens, then the
    division."""
    [model], _, _ = load_models_for_inference(ckpt)
    valid = DataDir(data).split("valid")
    cfg = model.cfg
    batch = collate([valid[i] for i in range(len(valid))], cfg.pad_id, cfg.bos_id, cfg.eos_id)
    keep = batch.tgt_out != cfg.pad_id
    with torch.no_grad():
        lp = torch.log_softmax(copy.deepcopy(model).double()(batch.src, batch.tgt_in), -1)
        nll = -float(lp.gather(-1, batch.tgt_out[..., None])[..., 0][keep].sum())
    total = loss_bound(model, "fp32", batch, 0.0, cfg.pad_id)
    return (total + LAMBDA * math.sqrt(batch.n_tgt_tokens + 1) * U32 * 1.01 * nll) / batch.n_tgt_tokens


@pytest.mark.slow
def test_finetuning_on_a_shifted_domain_lowers_its_validation_loss(copy_checkpoint, copy_data_dir, tmp_path):
    data = tmp_path / "reverse"
    files = _reverse_corpus(tmp_path / "raw")
    assert main(["prepare", *files, "--out", str(data), "--tokenizer-from", str(copy_checkpoint),
                 "--num-workers", "1"]) == 0
    base = load_checkpoint(copy_checkpoint)
    d = DataDir(data)
    assert (d.src_tokenizer.sha256, d.tgt_tokenizer.sha256) == tokenizer_hashes(base["tokenizers"])
    assert d.shared_vocab and d.vocab_size == 29
    # 0 steps: the loaded model's loss on the new domain, before fine-tuning
    before = _finetune(data, tmp_path / "before", copy_checkpoint, 0)["valid"]["valid_loss"]
    after_run = _finetune(data, tmp_path / "after", copy_checkpoint, 60)
    after = after_run["valid"]["valid_loss"]
    assert after < 0.5 * before, (before, after)
    tuned = load_checkpoint(tmp_path / "after" / "last.pt")
    assert tokenizer_hashes(tuned["tokenizers"]) == tokenizer_hashes(base["tokenizers"])
    # the weights were loaded: on the copy task's own validation set, 0 steps = the base model's loss
    same = _finetune(copy_data_dir, tmp_path / "same", copy_checkpoint, 0)["valid"]["valid_loss"]
    assert abs(same - base["valid"]["valid_loss"]) <= 2 * _valid_loss_bound(copy_checkpoint, copy_data_dir)
    # --resume-optimizer loads Adam's moments: the first step differs from a fresh Adam's
    resumed = _finetune(data, tmp_path / "resumed", copy_checkpoint, 1, "--resume-optimizer")
    fresh = _finetune(data, tmp_path / "fresh", copy_checkpoint, 1)
    assert resumed["valid"]["valid_loss"] != fresh["valid"]["valid_loss"]


def test_init_from_refuses_another_tokenizer(copy_checkpoint, small_data_dir, tmp_path, capsys):
    rc = main(["train", "--data", str(small_data_dir), "--out", str(tmp_path / "run"),
               "--init-from", str(copy_checkpoint), "--max-steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "source tokenizer" in err and "target tokenizer" in err and "--tokenizer-from" in err


def test_init_from_refuses_other_shapes(copy_checkpoint, copy_data_dir, tmp_path, capsys):
    rc = main(["train", "--data", str(copy_data_dir), "--out", str(tmp_path / "run"), "--init-from",
               str(copy_checkpoint), "--max-steps", "1", "--no-progress", "--set", "model.d_ff=128",
               "--set", "model.n_layers=1"])
    err = capsys.readouterr().err
    assert rc == 2 and "d_ff 256 in the checkpoint, 128 here" in err and "n_layers 2 in the checkpoint, 1 here" in err


def test_resume_optimizer_refuses_a_checkpoint_without_adams_state(copy_checkpoint, copy_data_dir, tmp_path, capsys):
    """An average (or an export, or an EMA run's ema.pt and best.pt) holds weights only."""
    from aiayn.checkpoint.format import atomic_save, load_checkpoint
    weights = {k: v for k, v in load_checkpoint(copy_checkpoint).items() if k not in ("optimizer", "sha256")}
    atomic_save({**weights, "optimizer": None}, tmp_path / "weights.pt")
    rc = main(["train", "--data", str(copy_data_dir), "--out", str(tmp_path / "run"), "--init-from",
               str(tmp_path / "weights.pt"), "--resume-optimizer", "--max-steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "weights.pt: the checkpoint holds no optimizer state" in err
    assert "ema.pt and best.pt" in err and "give the run's last.pt" in err


def test_tokenizer_from_refuses_new_tokenizer_options(copy_checkpoint, tmp_path, capsys):
    files = _reverse_corpus(tmp_path / "raw")
    rc = main(["prepare", *files, "--out", str(tmp_path / "d"), "--tokenizer-from", str(copy_checkpoint),
               "--vocab-size", "100"])
    assert rc == 2 and "--vocab-size 100 would train a new one" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
