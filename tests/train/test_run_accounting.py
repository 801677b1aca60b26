"""What a run directory records about the run: its seconds (validation included), the temporaries a
killed training leaves, and a recipe's misspelt section (docs/training.md, docs/checkpoints.md)."""
from __future__ import annotations

import json
import time

import pytest

from aiayn.checkpoint import load_checkpoint
from aiayn.cli import main
from aiayn.config import ConfigError
from aiayn.train.config import load_recipe
from aiayn.train.rundir import remove_stale_temps

FAST = ["--no-progress", "--set", "train.save_every_min=0", "--set", "train.validate_every_steps=0",
        "--set", "train.precision=fp32", "--set", "train.threads=1", "--set", "train.max_src_tokens=600",
        "--set", "train.max_tgt_tokens=600", "--set", "train.warmup_steps=50"]
VALIDATION_S = 1000.0  # what each validation takes on the clock below: far above any real step's seconds


def test_train_seconds_include_the_last_validation(small_data_dir, tmp_path, monkeypatch):
    """summary.json's train_seconds (and the final checkpoint's) hold the validations, as valid_seconds
    says they do: a validation of 1,000 s at the end of a 2-step run makes both at least 1,000 s. The
    end's validation used to come after the last step's clock reading, so valid_seconds exceeded
    train_seconds and tokens_per_s counted only the steps."""
    from aiayn.train import loop, validation

    class Clock:  # the real clock, plus the seconds the validations are made to take
        ahead = 0.0

        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + Clock.ahead

    real_validate = validation.validate

    def slow_validate(*args, **kwargs):
        out = real_validate(*args, **kwargs)
        Clock.ahead += VALIDATION_S
        return {**out, "valid_seconds": out["valid_seconds"] + VALIDATION_S}

    monkeypatch.setattr(loop, "time", Clock)
    monkeypatch.setattr(validation, "validate", slow_validate)
    run = tmp_path / "run"
    assert main(["train", "--data", str(small_data_dir), "--out", str(run), "--preset", "tiny", *FAST,
                 "--max-steps", "2"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["valid_seconds"] >= VALIDATION_S
    assert summary["train_seconds"] >= summary["valid_seconds"]
    assert summary["tokens_per_s"] <= summary["target_tokens"] / VALIDATION_S + 0.05  # (rounded to 0.1)
    last = load_checkpoint(run / "last.pt")
    assert last["train_seconds"] >= last["valid_seconds"] >= VALIDATION_S


@pytest.mark.parametrize("name", ["ema.pt", "train_log.jsonl", "last.pt", "ckpt_step00000012.pt", "summary.json"])
def test_a_killed_trainings_temporaries_are_removed_at_the_next_start(tmp_path, name):
    """Every file a training writes atomically (ema.pt with train.ema_decay, the train log a resume
    rewrites) leaves a temporary when killed mid-write; the next training removes it at its start, and
    leaves another command's (``aiayn average RUN --out RUN/avg.pt``) alone."""
    mine = tmp_path / f".{name}.aiayn-tmp-abc123de"
    other = tmp_path / ".avg.pt.aiayn-tmp-abc123de"
    mine.write_bytes(b"half")
    other.write_bytes(b"another command's, writing now")
    assert remove_stale_temps(tmp_path) == [mine]
    assert not mine.exists() and other.exists()


def test_a_misspelt_recipe_section_names_its_line_and_the_close_name(tmp_path):
    """"trian" for "train" is refused as a misspelt field is: the file, the line, the close name."""
    recipe = tmp_path / "r.json"
    recipe.write_text('{\n  "preset": "tiny",\n  "trian": {"warmup_steps": 100}\n}\n')
    with pytest.raises(ConfigError) as err:
        load_recipe(recipe)
    message = str(err.value)
    assert message.startswith(f"{recipe}:3: ") and "did you mean train?" in message and "\n" not in message


def test_the_summary_line_gives_the_last_validations_bleu():
    """With train.valid_bleu the printed summary's last validation carries its BLEU, as each validation's
    log line does; without it, none."""
    from aiayn.train.monitor import summary_text
    s = {"steps": 30, "epochs": 1, "target_tokens": 1000, "train_seconds": 4.0, "tokens_per_s": 250.0,
         "stop_reason": "max_steps", "counted_flops": 1e9, "device_fp32_matmul_tflops": 0.1,
         "table2_cost_estimate_flops": 4e11,
         "valid": {"valid_loss": 5.9884, "valid_ppl": 320.12, "valid_bleu": 12.344}}
    assert "stop: max_steps, valid loss 5.988 ppl 320.12 BLEU 12.34\n" in summary_text(s)
    del s["valid"]["valid_bleu"]
    assert "stop: max_steps, valid loss 5.988 ppl 320.12\n" in summary_text(s)
