"""``aiayn demo`` end to end on real Multi30k lines: prepare, a short training, average,
translate, score, plot. Asserts only what must hold."""
from __future__ import annotations

import gzip
import json

import pytest
import sacrebleu

from aiayn.cli import main


@pytest.mark.slow
def test_demo_pipeline_end_to_end(shared_data, tmp_path, capsys):
    out = tmp_path / "demo"
    recipe = tmp_path / "smoke.json"  # the quick model with a schedule that fits 200 steps
    recipe.write_text(json.dumps({
        "preset": "multi30k",
        "model": {"n_layers": 2, "d_model": 128, "d_ff": 512, "n_heads": 4, "d_k": 32, "d_v": 32, "p_drop": 0.1},
        "train": {"warmup_steps": 80, "lr_scale": 2.0, "max_src_tokens": 2048, "max_tgt_tokens": 2048,
                  "save_every_steps": 40, "save_every_min": 0, "validate_every_steps": 0, "local_sgd_period": 8,
                  "threads": 2}}))
    common = ["demo", "--out", str(out), "--recipe", str(recipe), "--train-lines", "6000", "--eval-lines", "120",
              "--max-steps", "200", "--data-root", str(shared_data), "--processes", "2"]
    rc = main(common + ["--alphas", "0.6,1.0"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3] == f"model: {out / 'model.pt'}"
    assert lines[-2] == f"translations: {out / 'test_2016.hyp'}"
    assert lines[-1] == f"plots: {out / 'plots'}"
    assert (out / "model.pt").is_file() and list((out / "plots").glob("*.png"))
    hyps = (out / "test_2016.hyp").read_text(encoding="utf-8").splitlines()
    with gzip.open(shared_data / "multi30k/raw/test_2016_flickr.en.gz", "rt", encoding="utf-8") as f:
        n_src = len([next(f) for _ in range(120)])
    assert len(hyps) == n_src and all(h.strip() for h in hyps)
    results = json.loads((out / "results.json").read_text())
    # 2 processes of one thread each (as the demo trains on 2 cores), their weights averaged every 8 steps
    assert results["train"]["devices"] == 2 and results["train"]["steps"] == 200
    assert json.loads((out / "run" / "config.json").read_text())["train"]["threads"] == 1
    with gzip.open(shared_data / "multi30k/raw/test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        refs = [next(f).rstrip("\n") for _ in range(n_src)]
    # the scores are of the written translations against test_2016's references (results.json rounds to 0.01)
    assert results["test"]["sacreBLEU"]["score"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=0.005)
    assert results["test"]["chrF2"]["score"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=0.005)
    assert results["valid"]["multi30k_bleu"] > 1.0  # a low floor: 200 steps of a small model
    # length ratios (hypothesis / reference tokens) beside every BLEU, for α's effect on length
    assert all(0.0 < r["length_ratio"] < 5.0 for r in results["alpha_tuning"].values())
    assert 0.0 < results["valid"]["length_ratio"] < 5.0
    # α: §6.1's 0.6 unless 1.0 beats it on validation with paired-bootstrap p < 0.05
    tuned = results["alpha_tuning"]
    assert "p_vs_first" not in tuned["0.6"] and 0.0 <= tuned["1.0"]["p_vs_first"] <= 1.0
    won = tuned["1.0"]["p_vs_first"] < 0.05 and tuned["1.0"]["valid_multi30k_bleu"] > tuned["0.6"]["valid_multi30k_bleu"]
    assert results["alpha"] == (1.0 if won else 0.6)
    assert "length_ratio" in results["test"]["Multi30k tokenized BLEU (lc.norm.tok, fairseq-score style)"]
    # every character of the training text is in the vocabulary (digits and capitals included)
    from aiayn.data.dataset import DataDir
    from aiayn.data.vocab import UNK_ID
    tok = DataDir(out / "data").src_tokenizer
    chars = set()
    for lang in ("en", "de"):
        with gzip.open(shared_data / f"multi30k/raw/train.{lang}.gz", "rt", encoding="utf-8") as f:
            chars.update(c for _, line in zip(range(6000), f) for c in line.strip())
    assert {"6", "9", "(", "!"} <= chars
    assert [c for c in sorted(chars) if UNK_ID in tok.encode(c)] == []
    # in order: the same sentence translated alone gives the same line
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.translator import Translator
    tr = Translator.from_checkpoint(out / "model.pt", cfg=DecodeConfig(beam_size=4, alpha=results["alpha"]))
    with gzip.open(shared_data / "multi30k/raw/test_2016_flickr.en.gz", "rt", encoding="utf-8") as f:
        src = [next(f).strip() for _ in range(120)]
    assert tr.translate([src[37]]) == [hyps[37]] and tr.translate([src[90]]) == [hyps[90]]
    # a re-run resumes: nothing is trained or averaged again
    averaged_at = (out / "model.pt").stat().st_mtime_ns
    assert main(common + ["--alphas", "0.6"]) == 0
    rerun = capsys.readouterr().out
    assert "training" not in rerun.split("[2/7] trained")[0].split("[1/7]")[-1]
    assert f"[3/7] averaged before (a re-run): 5 checkpoints -> {out / 'model.pt'}" in rerun
    assert (out / "model.pt").stat().st_mtime_ns == averaged_at


@pytest.mark.slow
def test_demo_lowercase(shared_data, tmp_path, capsys):
    """--lowercase: lowercase translations, sacreBLEU -lc beside cased sacreBLEU; an output
    directory prepared the other way is refused by name instead of silently reused."""
    out = tmp_path / "demo"
    recipe = tmp_path / "smoke.json"
    recipe.write_text(json.dumps({
        "preset": "multi30k",
        "model": {"n_layers": 1, "d_model": 64, "d_ff": 128, "n_heads": 2, "d_k": 32, "d_v": 32, "p_drop": 0.1},
        "train": {"warmup_steps": 20, "max_src_tokens": 1024, "max_tgt_tokens": 1024,
                  "save_every_steps": 20, "save_every_min": 0, "validate_every_steps": 0}}))
    common = ["demo", "--out", str(out), "--recipe", str(recipe), "--train-lines", "1500", "--eval-lines", "20",
              "--max-steps", "40", "--data-root", str(shared_data), "--alphas", "1.0", "--vocab-size", "1000"]
    assert main(common + ["--lowercase", "--set", "train.seed=7", "--set", "model.p_drop=0.0"]) == 0
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    # --set overrides the recipe, as in `aiayn train`, and is recorded
    run_cfg = json.loads((out / "run" / "config.json").read_text())
    assert run_cfg["train"]["seed"] == 7 and run_cfg["model"]["p_drop"] == 0.0
    assert results["config"]["sets"] == "train.seed=7,model.p_drop=0.0"
    assert main(common + ["--lowercase", "--set", "train.no_such_field=1"]) == 2
    assert "no_such_field" in capsys.readouterr().err
    assert {"sacreBLEU", "sacreBLEU -lc"} <= set(results["test"]) and "sacrebleu_lc" in results["valid"]
    hyps = (out / "test_2016.hyp").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 20 and all(h == h.lower() for h in hyps)
    assert all(t == t.lower() for t in results["examples"].values())
    assert main(common) == 2   # the cased run would reuse lowercased data
    assert "prepared with lowercase=True" in capsys.readouterr().err
    assert main(common + ["--lowercase", "--character-coverage", "0.9999"]) == 2  # so would another coverage
    assert "character_coverage=1.0" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_members_train_at_once_and_translate_as_an_ensemble(shared_data, tmp_path, capsys):
    """--members 2: two `aiayn train` processes with one thread and their own seed each, each
    averaged, one ensemble file as model.pt; a failing member stops the run with its log named."""
    out = tmp_path / "demo"
    recipe = tmp_path / "smoke.json"
    recipe.write_text(json.dumps({
        "preset": "multi30k",
        "model": {"n_layers": 1, "d_model": 64, "d_ff": 128, "n_heads": 2, "d_k": 32, "d_v": 32, "p_drop": 0.1},
        "train": {"warmup_steps": 20, "max_src_tokens": 1024, "max_tgt_tokens": 1024, "threads": 2,
                  "save_every_steps": 10, "save_every_min": 0, "validate_every_steps": 0}}))
    common = ["demo", "--out", str(out), "--recipe", str(recipe), "--train-lines", "1500", "--eval-lines", "20",
              "--max-steps", "30", "--data-root", str(shared_data), "--alphas", "1.0", "--vocab-size", "1000",
              "--average-last", "2", "--members", "2"]
    assert main(common + ["--set", "train.seed=3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3] == f"model: {out / 'model.pt'}"
    results = json.loads((out / "results.json").read_text())
    members = [json.loads((out / "run" / f"member{i}" / "config.json").read_text())["train"] for i in (1, 2)]
    assert [(m["seed"], m["threads"]) for m in members] == [(3, 1), (4, 1)]
    assert [s["steps"] for s in results["train_members"]] == [30, 30]
    assert results["averaged"] == [[f"member{i}/ckpt_step{s:08d}.pt" for s in (20, 30)] for i in (1, 2)]
    from aiayn.decode.translator import Translator
    from aiayn.checkpoint import ENSEMBLE_FORMAT, load_checkpoint
    assert load_checkpoint(out / "model.pt", ensemble_ok=True)["format"] == ENSEMBLE_FORMAT
    tr = Translator.from_checkpoint(out / "model.pt")
    assert len(tr.models) == 2 and len((out / "test_2016.hyp").read_text().splitlines()) == 20
    # a re-run resumes: no member is trained again
    mtimes = [(out / "run" / f"member{i}" / "summary.json").stat().st_mtime for i in (1, 2)]
    assert main(common + ["--set", "train.seed=3"]) == 0
    rerun = capsys.readouterr().out
    assert "training 2 members" not in rerun and "[3/7] averaged before (a re-run): the last 2" in rerun
    assert [(out / "run" / f"member{i}" / "summary.json").stat().st_mtime for i in (1, 2)] == mtimes
    # another --average-last averages anew, and the ensemble with it
    assert main([*common[:common.index("--average-last")], "--average-last", "1", "--members", "2",
                 "--set", "train.seed=3"]) == 0
    assert "[3/7] averaged the last 1 checkpoints of each member" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["averaged"] == [[f"member{i}/ckpt_step00000030.pt"]
                                                                          for i in (1, 2)]
    # a member that fails stops the run and names its log
    from aiayn.demo.stages import _train_members
    from aiayn.errors import UserError
    from aiayn.train.config import load_recipe
    bad = [tmp_path / "bad" / "member1", tmp_path / "bad" / "member2"]
    bad[0].mkdir(parents=True)
    (bad[0] / "summary.json").write_text("{}")  # finished: skipped
    with pytest.raises(UserError, match="member2: training failed .*member2.log"):
        _train_members(tmp_path / "no-data", bad, recipe, [], load_recipe(recipe).train)


def test_demo_without_sacremoses_stops_before_training(tmp_path, monkeypatch, capsys):
    """The demo's tokenized BLEU needs sacremoses: without it the demo says so at once, not after
    training (where the length penalty is chosen)."""
    import sys
    monkeypatch.setitem(sys.modules, "sacremoses", None)  # import sacremoses -> ImportError
    assert main(["demo", "--out", str(tmp_path / "demo"), "--data-root", str(tmp_path / "none")]) == 2
    assert "sacremoses" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


def _one_gpu(monkeypatch, gpus=1, free_gib=80, capability=(9, 0), name="NVIDIA H200", tflops=794.0, cores=16):
    """The device's and the host's answers to ``auto_members``, mocked: an H200 by default."""
    import os

    import torch

    from aiayn.train import runtime as rt
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_gib << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    rates = []
    monkeypatch.setattr(rt, "matmul_tflops", lambda device, n, seconds, dtype: rates.append(dtype) or tflops)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    return rates


@pytest.mark.parametrize("gpus, options, members", [
    (1, {}, 4),                                   # one GPU, the GPU recipe: four members at once
    (0, {}, 1),                                   # a CPU: one model
    (8, {}, 1),                                   # eight GPUs: one model, data parallel over them
    (1, {"recipe": "mine.json"}, 1),              # a recipe of one's own: as given
    (1, {"quick": True}, 1),
    (1, {"processes": 2}, 1),
    (1, {"processes": 1}, 4),
    (1, {"members": 2}, 2),                       # asked for: kept, on any device
    (0, {"members": 3}, 3),
])
def test_members_default_to_four_on_one_gpu_with_the_gpu_recipe(monkeypatch, gpus, options, members):
    """--members 0 (the default) is ``GPU_MEMBERS`` where the demo's step leaves one GPU mostly idle,
    else 1; the device's answers mocked (an H200, 80 GiB free)."""
    from aiayn.demo.config import GPU_MEMBERS, DemoConfig
    from aiayn.demo.stages import auto_members
    _one_gpu(monkeypatch, gpus=gpus)
    assert GPU_MEMBERS == 4
    assert auto_members(DemoConfig(**options)) == members


@pytest.mark.parametrize("free_gib, members", [(80, 4), (6, 4), (4, 2), (3, 2), (2, 1), (1, 1)])
def test_members_are_fewer_where_the_gpu_holds_fewer(monkeypatch, free_gib, members):
    """Each member needs its training peak (``aiayn.cost.memory``: 0.37 GiB for multi30k-gpu.json at
    its 4,096 + 4,096 tokens in bf16, vocabulary 8,000) and 1 GiB for its process: 1.37 GiB."""
    from aiayn.demo.config import DemoConfig
    from aiayn.demo.stages import auto_members
    _one_gpu(monkeypatch, free_gib=free_gib)
    assert auto_members(DemoConfig()) == members


@pytest.mark.parametrize("gpu, capability, tflops, cores, minutes, members", [
    ("NVIDIA H200", (9, 0), 794.0, 16, 0, 4),     # the measured case: 4.0 ms a step, 4 x 58 s of 14,500 steps
    ("NVIDIA A100-SXM4-40GB", (8, 0), 280.0, 16, 0, 2),  # 11.3 ms a step: 2 x 164 s fit 8 minutes, 3 do not
    ("NVIDIA L4", (8, 9), 100.0, 16, 0, 1),
    ("Tesla T4", (7, 5), 40.0, 2, 0, 1),          # fp16: one model, trained to the clock
    ("NVIDIA H200", (9, 0), 794.0, 2, 0, 2),      # a host of 2 cores issues 2 members' steps
    ("NVIDIA A100-SXM4-40GB", (8, 0), 280.0, 16, 16, 4),  # --minutes 16: 4 x 164 s fit
])
def test_members_are_as_many_as_the_device_serves_in_the_minutes(monkeypatch, caplog, gpu, capability, tflops,
                                                                 cores, minutes, members):
    """On a GPU slower than the H200 the members take turns on the device: as many as still reach the
    recipe's 14,500 steps in its minutes (a step's device work scaled by the matmul rate measured in
    the run's precision), and no more than the host has cores; the count and why are logged."""
    import torch

    from aiayn.demo.config import DemoConfig
    from aiayn.demo.stages import auto_members
    rates = _one_gpu(monkeypatch, capability=capability, name=gpu, tflops=tflops, cores=cores)
    with caplog.at_level("INFO", logger="aiayn.demo.stages"):
        assert auto_members(DemoConfig(minutes=minutes)) == members
    assert rates == [torch.float16 if capability < (8, 0) else torch.bfloat16]
    assert f"members: {members} on {gpu}" in caplog.text


def test_members_memory_is_sized_in_the_run_precision(monkeypatch):
    """A GPU without native bf16 or fast fp16 (compute capability 6.1: a P40) trains in fp32, and each
    member's peak is sized in fp32 (``aiayn.cost.memory``: 0.58 GiB, 1.58 GiB with its process's 1 GiB,
    against bf16's 1.37): 3 GiB free hold one member, where bf16's sizing made it two. Sixteen cores
    and 600 minutes, so that neither the host nor the device's turns are what limits."""
    import torch

    from aiayn.demo.config import DemoConfig
    from aiayn.demo.stages import auto_members
    rates = _one_gpu(monkeypatch, free_gib=3, capability=(6, 1), name="Tesla P40", tflops=12.0)
    assert auto_members(DemoConfig(minutes=600)) == 1
    assert rates == [torch.float32]
    _one_gpu(monkeypatch, free_gib=3)  # the same free memory on an H200, in bf16: two
    assert auto_members(DemoConfig(minutes=600)) == 2


def test_negative_members_are_refused(capsys):
    assert main(["demo", "--members", "-1", "--out", "unused"]) == 2
    assert "--members and --processes must be at least 0" in capsys.readouterr().err


def _finished_run(run_dir, recipe, sets):
    """A run directory as a finished ``aiayn train`` of ``recipe`` with ``sets`` leaves it: its
    config.json (threads per process and the data directory's vocabulary, as training records them)
    and summary.json."""
    import dataclasses

    from aiayn.config import apply_sets, to_dict
    from aiayn.train.config import load_recipe
    run = apply_sets(load_recipe(recipe), sets)
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({
        "model": to_dict(dataclasses.replace(run.model, vocab_size=1000)),
        "train": to_dict(dataclasses.replace(run.train, threads=1, accum_steps=2))}))
    (run_dir / "summary.json").write_text(json.dumps({"steps": 40, "train_seconds": 5.0}))


def test_a_finished_run_is_reused_only_for_the_options_it_was_trained_with(tmp_path):
    """A re-run resumes a finished training only as it was asked for: another --max-steps (or
    --minutes, --recipe, --set) is an error naming the field, not the earlier model scored and
    recorded in results.json under the new options; the fields the demo derives from the process
    and thread counts, and the data directory's vocabulary, are no difference."""
    from aiayn.demo.config import RECIPES
    from aiayn.demo.stages import recipe_sets, train_recipe
    from aiayn.errors import UserError
    recipe, run_dir = RECIPES / "multi30k-quick.json", tmp_path / "run"
    _finished_run(run_dir, recipe, recipe_sets("", 1.0, 40))
    train_recipe(tmp_path / "no-data", run_dir, recipe, recipe_sets("", 1.0, 40), 1, "[2/7]")  # the same: reused
    with pytest.raises(UserError, match=r"config\.json: the finished run was trained with train\.max_steps=40, "
                                        r"but this run asks for train\.max_steps=60; use another --out"):
        train_recipe(tmp_path / "no-data", run_dir, recipe, recipe_sets("", 1.0, 60), 1, "[2/7]")
    with pytest.raises(UserError, match=r"model\.d_ff=.*model\.d_ff=64"):
        train_recipe(tmp_path / "no-data", run_dir, recipe, recipe_sets("model.d_ff=64", 1.0, 40), 1, "[2/7]")


def test_a_finished_run_of_an_older_version_had_attention_biases(tmp_path):
    """A config.json written before ``model.attn_bias`` (every other field named) trained with the
    attention projections' biases: a re-run that asks for none is refused, not given that model."""
    from aiayn.demo.config import RECIPES
    from aiayn.demo.stages import recipe_sets, train_recipe
    from aiayn.errors import UserError
    recipe, run_dir = RECIPES / "multi30k-quick.json", tmp_path / "run"
    _finished_run(run_dir, recipe, recipe_sets("", 1.0, 40))
    written = json.loads((run_dir / "config.json").read_text())
    del written["model"]["attn_bias"]
    (run_dir / "config.json").write_text(json.dumps(written))
    train_recipe(tmp_path / "no-data", run_dir, recipe, recipe_sets("", 1.0, 40), 1, "[2/7]")  # the recipe's: reused
    with pytest.raises(UserError, match=r"trained with model\.attn_bias=True, but this run asks for "
                                        r"model\.attn_bias=False"):
        train_recipe(tmp_path / "no-data", run_dir, recipe, recipe_sets("model.attn_bias=false", 1.0, 40), 1, "[2/7]")


@pytest.mark.slow
def test_demo_records_what_repeats_it_and_a_budget_in_flops_repeats_it_exactly(shared_data, tmp_path, capsys):
    """results.json names the recipe, the seed, the whole configuration trained and the code, libraries
    and machine; with the budget in counted FLOPs and checkpoints by steps (docs/training.md,
    "Reproducibility") a second run gives the same model bit for bit and the same translations."""
    import torch

    import aiayn
    from aiayn.checkpoint import load_checkpoint
    from aiayn.train.config import RECIPES
    outs = [tmp_path / "one", tmp_path / "two"]
    for out in outs:
        assert main(["demo", "--out", str(out), "--recipe", str(RECIPES / "multi30k-quick.json"), "--data-root",
                     str(shared_data), "--train-lines", "300", "--eval-lines", "10", "--vocab-size", "300",
                     "--processes", "1", "--threads", "1", "--alphas", "0.6", "--average-last", "2",
                     "--set", "train.max_time_min=0", "--set", "train.max_flops=1.2e11",
                     "--set", "train.save_every_min=0", "--set", "train.save_every_steps=5"]) == 0
    capsys.readouterr()
    results = json.loads((outs[0] / "results.json").read_text())
    run_config = json.loads((outs[0] / "run" / "config.json").read_text())
    assert results["recipe"] == str(RECIPES / "multi30k-quick.json") and results["run_config"] == run_config
    assert results["seed"] == run_config["train"]["seed"] == 1 and run_config["train"]["threads"] == 1
    env = results["environment"]
    assert env["aiayn"] == aiayn.__version__ and env["torch"] == torch.__version__ and env["cpu"]
    assert results["train"]["stop_reason"] == "max_flops" and len(results["averaged"]) == 2
    a, b = (load_checkpoint(out / "model.pt")["model"] for out in outs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (outs[0] / "test_2016.hyp").read_bytes() == (outs[1] / "test_2016.hyp").read_bytes()


def test_a_rerun_says_its_training_is_from_before(tmp_path, capsys):
    """A re-run that takes a finished training whole says so, as prepare and average do, instead of
    "trained: N steps" as if it had trained them now."""
    from aiayn.demo.config import RECIPES, DemoConfig
    from aiayn.demo.stages import recipe_sets, stage_train
    recipe = RECIPES / "multi30k-quick.json"
    _finished_run(tmp_path / "run", recipe, recipe_sets("", 1.0, 40))
    results = {}
    cfg = DemoConfig(recipe=str(recipe), minutes=1.0, max_steps=40, members=1, processes=1)
    assert stage_train(cfg, tmp_path / "no-data", tmp_path / "run", results) == [tmp_path / "run"]
    assert "[2/7] trained before (a re-run): 40 steps, 5 s" in capsys.readouterr().out
    assert results["reused"] == ["train"]


class _Stopped(Exception):
    """Raised in place of a stage: the demo got that far."""


def _stub_until_decoding(monkeypatch, out):
    """The stages before decoding stubbed (prepared, trained and averaged before), and the decoding
    interrupted as Ctrl-C interrupts it."""
    from aiayn.decode.translator import Translator
    from aiayn.demo import stages
    monkeypatch.setattr(stages, "stage_prepare", lambda cfg, files, data_dir, *rest: data_dir)
    monkeypatch.setattr(stages, "stage_train", lambda cfg, data_dir, run_dir, results: [run_dir])
    monkeypatch.setattr(stages, "stage_average", lambda cfg, dirs, run_dir, model_path, results: model_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Translator, "from_checkpoint", interrupted)


def test_an_interrupted_rerun_leaves_no_scores_of_the_run_before(shared_data, tmp_path, monkeypatch, capsys):
    """A re-run with other decoding options (--beam-size, --alphas) rewrites model.pt's α, the
    translations and the plots; stopped midway, it leaves no results.json of the run before beside
    them, and says how to go on."""
    out = tmp_path / "demo"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"alpha": 0.6, "test": {"sacreBLEU": {"score": 30.0}}}))
    _stub_until_decoding(monkeypatch, out)
    assert main(["demo", "--quick", "--out", str(out), "--data-root", str(shared_data), "--beam-size", "8"]) == 130
    assert not (out / "results.json").exists()
    err = capsys.readouterr().err
    assert "aiayn demo: interrupted; the same command resumes (prepare, train and average are skipped" in err


def test_interrupted_with_overwrite_says_to_resume_without_it(shared_data, tmp_path, monkeypatch, capsys):
    """After --overwrite, the same command would delete the run again: the way on is without it."""
    from aiayn.demo import stages

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(stages, "stage_prepare", interrupted)
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--data-root", str(shared_data), "--overwrite"]) == 130
    assert "interrupted; the same command without --overwrite resumes (prepare" in capsys.readouterr().err


@pytest.mark.parametrize("src", ["en", "de"])
def test_quick_says_what_it_trades_before_any_work(shared_data, tmp_path, monkeypatch, capsys, src):
    """--quick says first what it gives up against the full demo: a smaller model, fewer minutes
    (its --minutes where given), rougher translations; the full demo says nothing of it."""
    from aiayn.demo import stages

    def prepared(*args):
        raise _Stopped

    monkeypatch.setattr(stages, "stage_prepare", prepared)
    common = ["demo", "--out", str(tmp_path / "demo"), "--data-root", str(shared_data), "--src-lang", src]
    with pytest.raises(_Stopped):
        main([*common, "--quick", "--minutes", "2"])
    said = capsys.readouterr().out
    assert said.startswith("--quick: a 2+2-layer model trained for 2 minutes, where the full demo trains a larger one "
                           "for 45: every stage runs, but the translations are rough (what each scores: "
                           "docs/recipe.md)")
    with pytest.raises(_Stopped):
        main([*common, "--minutes", "2"])
    assert "--quick" not in capsys.readouterr().out


def test_the_examples_stage_says_which_sentence_it_drew(tmp_path, monkeypatch, capsys):
    """The attention plots are of the first example: the line says which sentence, and how many plots
    are where, not only the plot folder at the end."""
    from aiayn.demo.stages import stage_examples
    from aiayn.viz import attention

    class Translator:
        def translate(self, lines):
            return [line.upper() for line in lines]

    drawn = []
    monkeypatch.setattr(attention, "plot_attention", lambda tr, text, out: drawn.append(text) or [out / "a.png", out / "b.png"])
    results = {}
    stage_examples(Translator(), ["Two dogs.", "A cat."], tmp_path / "plots", results)
    assert drawn == ["Two dogs."] and results["examples"] == {"Two dogs.": "TWO DOGS.", "A cat.": "A CAT."}
    assert f'[7/7] attention drawn for "Two dogs.": 2 plots in {tmp_path / "plots"}' in capsys.readouterr().out


@pytest.mark.parametrize("tried, p_values, says", [
    ([0.6], {}, "the only one tried"),
    ([0.6, 1.0], {}, "the highest-scoring"),
    ([0.6, 1.0], {1.0: 0.2}, "p against α 0.6, paired bootstrap: "),
])
def test_the_alpha_line_says_why_its_alpha_was_taken(tried, p_values, says):
    """One α tried (--alphas 0.6) was said to be 'the highest-scoring', as if several had been."""
    from aiayn.demo.multi30k import alpha_reason
    assert alpha_reason(tried, p_values, 0.05).startswith(says)


@pytest.mark.parametrize("m, says", [(1, "1 minute"), (4, "4 minutes"), (0.5, "0.5 minutes"), (45, "45 minutes")])
def test_minutes_are_said_as_words(m, says):
    """--minutes 1 printed 'training ... for up to 1 minutes'."""
    from aiayn.demo.stages import minutes
    assert minutes(m) == says
