"""``aiayn estimate``: FLOPs, batch split, time and Table 2's estimate against hand-computed numbers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.errors import UserError
from aiayn.model.config import get_preset
from aiayn.train.config import load_recipe
from aiayn.cost.estimate import (StepBatch, Throughput, device_throughput, estimate, measured_throughput,
                                  paper_batch, paper_model, step_batch, step_flops)

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def paper_step_estimate(recipe: str, devices: int, thr: Throughput):
    """The estimate of ``recipe``'s steps at the paper's 25,000 tokens a step on ``devices`` devices."""
    cfg = load_recipe(RECIPES / recipe)
    t = cfg.train
    return estimate(cfg.model, t.max_steps, step_batch(devices, t.max_tgt_tokens, t.accum_steps, 25_000), thr)


def test_base_flops_per_token_by_hand():
    """Base (D 512, F 2048, H 8, d_k = d_v = 64, V 37,000, N 6), S = T = L = 31 per sentence:
    encoder layer per token 2(512*8*192 + 8*64*512 + 2*512*2048) = 6,291,456;
    decoder layer per token 2(786,432 + 262,144 + 262,144 + 262,144 + 2,097,152) = 7,340,032,
    plus the cross-attention keys/values of each source token 2*512*8*128 = 1,048,576;
    output layer 2*512*37,000 = 37,888,000: linear part 6*6,291,456 + 6*8,388,608 + 37,888,000
    = 125,968,384 per token; attention cores 8 heads * 2 * 128 = 2,048 FLOPs per (query, key),
    18 of them per token pair over the stacks (6 encoder, 6 decoder self, 6 cross): 36,864 * L."""
    m = get_preset("base", vocab_size=37000)
    fwd = 125_968_384 + 36_864 * 31
    assert fwd == 127_111_168
    assert step_flops(m, 1, 31) == 3 * fwd
    assert step_flops(m, 25_000, 31) == pytest.approx(9.5333376e12, rel=1e-12)
    # big: linear 6*25,165,824 + 6*(29,360,128 + 4,194,304) + 75,776,000 = 428,097,536; cores 73,728 * L
    big = get_preset("big", vocab_size=37000)
    assert step_flops(big, 1, 31) == 3 * (428_097_536 + 73_728 * 31)


@pytest.mark.parametrize("devices,per_device,accum", [(8, 3125, 1), (1, 3125, 8), (3, 2777, 3), (16, 1562, 1),
                                                      (2, 3125, 4)])
def test_paper_batch_fills_25000_tokens(devices, per_device, accum):
    assert paper_batch(devices, 3125) == (per_device, accum)
    assert 25_000 - devices * accum <= per_device * devices * accum <= 25_000


def test_p100_estimate_of_the_base_recipe_is_the_papers_12_hours():
    """8 P100 at 28% of 10.6 TFLOP/s = 2.968 TFLOP/s each: 9.5333376e12 / (8 * 2.968e12) = 0.401505 s per
    step, 40,150.5 s (11.15 h, 89.2 device-hours) for 100K steps (the paper: 0.4 s, 12 h); Table 2's
    estimate 40,150.5 s * 8 * 9.5e12 = 3.0514e18 FLOPs (the paper: 3.3e18)."""
    thr = device_throughput("p100")
    assert (thr.tflops, thr.table2_tflops, thr.measured) == (pytest.approx(2.968), 9.5, False)
    e = paper_step_estimate("wmt14-ende-base.json", 8, thr)
    assert (e.per_device_tokens, e.accum_steps, e.tokens_per_step) == (3125, 1, 25_000)
    assert e.seconds_per_step == pytest.approx(0.401505, rel=1e-5)
    assert e.seconds == pytest.approx(40_150.5, rel=1e-5)
    assert e.device_hours == pytest.approx(89.223, rel=1e-4)
    assert e.table2_flops == pytest.approx(3.0514e18, rel=1e-4)
    assert e.model_flops == pytest.approx(9.5333376e17, rel=1e-12)
    # one device with 8 accumulated batches: the same FLOPs per step, 8 times the time per step
    one = paper_step_estimate("wmt14-ende-base.json", 1, thr)
    assert (one.per_device_tokens, one.accum_steps) == (3125, 8)
    assert one.seconds == pytest.approx(8 * e.seconds) and one.device_hours == pytest.approx(e.device_hours)


def test_step_batch_is_the_recipes_or_the_papers():
    """Without tokens per step, the recipe's batch as written; with, ``paper_batch`` of it (at most the
    recipe's per-device tokens in one batch, or ``max_device_tokens``)."""
    assert step_batch(4, 3125, 2) == StepBatch(3125, 4, 2) and StepBatch(3125, 4, 2).tokens == 25_000
    assert step_batch(1, 3125, 2, tokens_per_step=25_000) == StepBatch(3125, 1, 8)
    assert step_batch(1, 3125, 2, tokens_per_step=25_000, max_device_tokens=6250) == StepBatch(6250, 1, 4)


def test_measured_throughput_is_read_and_named(tmp_path):
    """A bench/train_throughput.py result: model GFLOP/s of aiayn-bf16 (else aiayn-fp32) and its matmul peak."""
    f = tmp_path / "train_base.json"
    f.write_text(json.dumps({"machine": {"cpu_model": "Test CPU", "threads": 2, "date": "2026-11-26T00:00:00"},
                             "systems": {"aiayn-fp32": {"model_gflops_per_s": 200.0, "peak_gflops": 250.0},
                                         "aiayn-bf16": {"model_gflops_per_s": 600.0, "peak_gflops": 900.0}}}))
    thr = measured_throughput(f)
    assert (thr.tflops, thr.table2_tflops, thr.measured) == (0.6, 0.9, True)
    assert str(f) in thr.source and "aiayn-bf16" in thr.source
    (tmp_path / "box").mkdir()
    (tmp_path / "box" / "train_base.json").write_text(f.read_text())
    assert device_throughput("box", results=tmp_path) == Throughput(0.6, 0.9, thr.device,
                                                                     thr.source.replace(str(f), str(tmp_path / "box" / "train_base.json")), True)
    with pytest.raises(UserError, match="unknown device 'nope'.*measured: box"):
        device_throughput("nope", results=tmp_path)


def test_paper_model_recognizes_base_and_big():
    assert paper_model(get_preset("base", vocab_size=32000, p_drop=0.3)) == "base"
    assert paper_model(get_preset("big")) == "big" and paper_model(get_preset("tiny")) is None


def test_cli_prints_the_estimate(capsys):
    recipe = str(RECIPES / "wmt14-ende-big.json")
    assert main(["estimate", "--recipe", recipe, "--gpus", "8", "--device", "p100", "--price", "2"]) == 0
    out = capsys.readouterr().out
    assert "the paper's Table 2, big model: 2.3e+19" in out and "base model" not in out
    assert "device-hours = $" in out and "assumed: 28% of 10.6" in out


@pytest.mark.parametrize("recipe, device, said", [
    ("wmt14-ende-base.json", "h200", "= 1.7 device-hours = $3.5 at $2 per device-hour"),
    ("wmt14-ende-big.json", "h200", "= 9.2 device-hours = $18 at $2 per device-hour"),
    ("wmt14-ende-big.json", "p100", "= 906 device-hours = $1,813 at $2 per device-hour")])
def test_hours_and_dollars_agree_as_printed(recipe, device, said, capsys):
    """One decimal below 10, whole above, each from the unrounded hours: never "2 device-hours = $3"."""
    assert main(["estimate", "--recipe", str(RECIPES / recipe), "--gpus", "8", "--device", device,
                 "--tokens-per-step", "25000", "--price", "2"]) == 0
    assert said in capsys.readouterr().out


def test_max_device_tokens_alone_is_an_error(capsys):
    assert main(["estimate", "--recipe", str(RECIPES / "wmt14-ende-base.json"), "--max-device-tokens", "25000"]) == 2
    assert "--max-device-tokens goes with --tokens-per-step" in capsys.readouterr().err


def test_length_from_a_prepared_data_directory(small_data_dir, capsys):
    """--data: sentences as long as the train split's longer side on average, plus EOS."""
    manifest = json.loads((small_data_dir / "manifest.json").read_text())
    mean = max(manifest["splits"]["train"][s]["length"]["mean"] for s in ("src", "tgt"))
    assert main(["estimate", "--recipe", str(RECIPES / "wmt14-ende-base.json"), "--data", str(small_data_dir),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["length"] == round(mean) + 1


def test_aiayn_own_gpu_figure_is_used_for_base_and_big():
    """H200: aiayn measured at 152.8 (base) and 293.8 (big) model TFLOP/s; the H100 borrows them
    (not measured there); other models, or --utilization, fall back to peak x utilization."""
    h200 = device_throughput("h200", model="base")
    assert (h200.tflops, h200.measured) == (152.8, True) and "measured: BENCHMARKS.md" in h200.source
    h100 = device_throughput("h100", model="big")
    assert (h100.tflops, h100.measured) == (293.8, False) and h100.source.startswith("assumed")
    assert device_throughput("h100").tflops == pytest.approx(0.16 * 989)
    assert device_throughput("h200", 0.5, model="base").tflops == pytest.approx(494.5)
    # 100K base steps on 8 H200: 9.5333376e12 / (8 * 152.8e12) = 0.0077989 s per step, 779.89 s
    e = paper_step_estimate("wmt14-ende-base.json", 8, h200)
    assert e.seconds == pytest.approx(779.887, rel=1e-5)


@pytest.mark.parametrize("extra, said", [
    (["--tokens-per-step", "7"], "7 tokens per step cannot be shared by 8 devices"),
    (["--tokens-per-step", "100"], "sentences of 31 tokens do not fit a batch of 12 tokens on one device"),
    (["--length", "100000"], "sentences of 100000 tokens do not fit a batch of 3125 tokens"),
    (["--price", "-1"], "--price must be a finite number >= 0"),
    (["--price", "nan"], "--price must be a finite number >= 0")])
def test_nonsense_is_refused_in_one_line(extra, said, capsys):
    """Fewer tokens a step than devices, a sentence longer than a batch, or a price below 0 or not a
    number: one line naming the option, not a ZeroDivisionError or a cost of "$-89.2"."""
    assert main(["estimate", "--recipe", str(RECIPES / "wmt14-ende-base.json"), *extra]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_utilization_beside_a_measurement_is_an_error(tmp_path, capsys):
    """--utilization replaces an assumed utilization; a measured rate has none, so the two together
    are refused rather than the option silently dropped."""
    measured = tmp_path / "train_base.json"
    measured.write_text(json.dumps({"machine": {"cpu_model": "x", "threads": 2, "date": "2026-01-01"},
                                    "systems": {"aiayn-fp32": {"model_gflops_per_s": 100.0, "peak_gflops": 400.0}}}))
    recipe = str(RECIPES / "multi30k.json")
    assert main(["estimate", "--recipe", recipe, "--measured", str(measured), "--gpus", "1"]) == 0
    capsys.readouterr()
    assert main(["estimate", "--recipe", recipe, "--measured", str(measured), "--utilization", "0.3"]) == 2
    assert "--utilization applies where nothing was measured" in capsys.readouterr().err
