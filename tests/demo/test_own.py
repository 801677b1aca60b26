"""``aiayn demo --train SRC TGT --valid SRC TGT --test SRC TGT``: the demo's steps on a user's
own parallel text (the copy task of conftest), with the demo's recipe made tiny by --set; and
the demo's 4,096-token steps on any number of processes (``step_sets``)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import sacrebleu

from aiayn.demo import stages
from aiayn.demo.config import RECIPES, DemoConfig
from aiayn.train.config import load_recipe

from aiayn.cli import main
from tests.conftest import copy_lines

# the demo's recipe (recipes/multi30k.json: its batches, schedule, checkpoints) with a tiny model
TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set", "model.n_heads=2",
        "--set", "model.d_k=16", "--set", "model.d_v=16", "--set", "train.warmup_steps=20",
        "--set", "train.lr_scale=0.5", "--set", "train.save_every_steps=5", "--set", "train.save_every_min=0",
        "--set", "train.precision=fp32", "--max-steps", "20", "--threads", "1", "--vocab-size", "29",
        "--alphas", "0.6,1.0"]


def _write(path, lines):
    text = "".join(line + "\n" for line in lines)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def _corpus(d, n_train=400):
    """The copy task as en -> de files (train gzipped, as a user's may be)."""
    d.mkdir()
    out = {}
    for split, n, seed, suffix in (("train", n_train, 1, ".gz"), ("valid", 40, 2, ""), ("test", 30, 3, "")):
        lines = copy_lines(n, seed)
        out[split] = [_write(d / f"{split}.en{suffix}", lines), _write(d / f"{split}.de{suffix}", lines)]
    return out


@pytest.mark.slow
def test_demo_on_own_files_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    files = _corpus(tmp_path / "corpus")
    argv = ["demo", "--train", *files["train"], "--valid", *files["valid"], "--test", *files["test"],
            "--processes", "1", *TINY]
    assert main([*argv, "--results-to", "bench/demo.json"]) == 0
    out = Path("runs/demo-en-de")  # under the current directory; the languages from train.en.gz, train.de.gz
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3:] == [f"model: {out / 'model.pt'}", f"translations: {out / 'test.hyp'}", f"plots: {out / 'plots'}"]
    results = json.loads((out / "results.json").read_text())
    assert json.loads(Path("bench/demo.json").read_text()) == results  # the copy for a results folder
    assert results["direction"] == "en-de"
    # prepared as the demo prepares: shared BPE covering every character
    options = json.loads((out / "data" / "manifest.json").read_text())["options"]
    assert options["character_coverage"] == 1.0 and options["shared_vocab"] and options["vocab_size"] == 29
    # the demo's 4,096-token steps in one process: 2 batches of the recipe's 2,048 tokens a step
    run_cfg = json.loads((out / "run" / "config.json").read_text())
    assert (run_cfg["train"]["accum_steps"], run_cfg["train"]["max_tgt_tokens"]) == (2, 2048)
    # the recipe sized to this machine (aiayn.demo.sizing), --set on top
    sized = load_recipe(RECIPES / results["sizing"]["recipe"])
    assert run_cfg["train"]["weight_decay"] == sized.train.weight_decay and run_cfg["model"]["d_model"] == 32
    assert results["train"]["steps"] == 20
    assert results["averaged"] == [f"ckpt_step{s:08d}.pt" for s in (5, 10, 15, 20)]  # the last 5 there are
    # α chosen on validation by sacreBLEU; test scored by sacreBLEU and chrF (no Multi30k metric)
    tuned = results["alpha_tuning"]
    assert set(tuned) == {"0.6", "1.0"} and "p_vs_first" not in tuned["0.6"]
    won = tuned["1.0"]["p_vs_first"] < 0.05 and tuned["1.0"]["valid_sacrebleu"] > tuned["0.6"]["valid_sacrebleu"]
    assert results["alpha"] == (1.0 if won else 0.6)  # §6.1's 0.6 unless 1.0 wins the paired bootstrap
    from aiayn.checkpoint import load_checkpoint
    assert load_checkpoint(out / "model.pt")["decode"] == {"alpha": results["alpha"]}  # translate's default now
    assert set(results["test"]) == {"sacreBLEU", "chrF2"}
    hyps = (out / "test.hyp").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 30
    refs = Path(files["test"][1]).read_text(encoding="utf-8").splitlines()
    # the scores are of the written translations against the test references (results.json rounds to 0.01)
    assert results["test"]["sacreBLEU"]["score"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=0.005)
    assert results["test"]["chrF2"]["score"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=0.005)
    assert len(results["examples"]) == 3 and list((out / "plots").glob("*.png"))
    # a re-run resumes: nothing is prepared or trained again
    mtime = (out / "run" / "summary.json").stat().st_mtime
    assert main(argv) == 0
    rerun = capsys.readouterr().out
    assert "training" not in rerun and "(prepared before: a re-run)" in rerun
    again = json.loads((out / "results.json").read_text())  # what it took from the first run, said
    assert again["prepare_seconds"] == results["prepare_seconds"] and again["train"] == results["train"]
    assert again["reused"] == ["prepare", "sizing", "train", "average"] and "reused" not in results
    assert (out / "run" / "summary.json").stat().st_mtime == mtime
    # other training lines are not a silent reuse of the data and model trained on these
    assert main([*argv, "--train-lines", "300"]) == 2
    assert "its train split was prepared from" in capsys.readouterr().err


def test_a_rerun_carries_the_timing_of_the_prepare_it_reused(tmp_path):
    """A re-run of the demo (its training interrupted, resumed) does not prepare again: its
    results.json still has prepare_seconds, those the first run's prepare stored in the manifest,
    and lists prepare among the stages it reused."""
    files = _corpus(tmp_path / "corpus", n_train=40)
    raw = {f"raw.{split}.{side}": Path(p) for split, pair in files.items() for side, p in zip(("src", "tgt"), pair)}
    cfg, first, again = DemoConfig(vocab_size=29), {}, {}
    stages.stage_prepare(cfg, raw, tmp_path / "data", ("src", "tgt"), first)
    stages.stage_prepare(cfg, raw, tmp_path / "data", ("src", "tgt"), again)
    assert again.get("prepare_seconds") == first["prepare_seconds"]
    assert again.get("reused") == ["prepare"] and "reused" not in first
    assert json.loads((tmp_path / "data" / "manifest.json").read_text())["seconds"] == first["prepare_seconds"]

def test_demo_on_own_files_refuses_what_it_cannot_use(tmp_path, capsys):
    """Unaligned files name the file and line (as `aiayn prepare`), before any training; flags of
    Multi30k and of your own files are not mixed; languages come from suffixes or flags."""
    files = _corpus(tmp_path / "corpus", n_train=10)
    short = _write(tmp_path / "corpus" / "short.de", copy_lines(9, 1))
    own = ["--valid", *files["valid"], "--out", str(tmp_path / "out")]

    def refused(argv) -> str:
        assert main(["demo", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        return err[0]

    assert f"{short}:10: source and target line counts differ" in refused(["--train", files["train"][0], short, *own])
    assert not (tmp_path / "out" / "run").exists()
    assert "--data-root" in refused(["--train", *files["train"], *own, "--data-root", str(tmp_path)])
    # with --train-lines the files given are read whole, as prepare reads them: errors name them
    assert f"{short}:10: source and target line counts differ" in refused(
        ["--train", files["train"][0], short, *own, "--train-lines", "5"])
    bad = tmp_path / "corpus" / "bad.de"
    bad.write_bytes(gzip.decompress(Path(files["train"][1]).read_bytes()).replace(b"\n", b"\n\xff", 1))
    assert f"{bad}:2: invalid UTF-8" in refused(["--train", files["train"][0], str(bad), *own, "--train-lines", "5"])
    blank = [_write(tmp_path / "corpus" / f"blank.{lang}", ["", " "]) for lang in ("en", "de")]
    assert f"{blank[0]}: no non-empty line" in refused(["--train", *files["train"], "--valid", *blank,
                                                     "--out", str(tmp_path / "out")])
    # nothing the demo reads may lie in --out (--overwrite would delete it); --results-to is checked first
    inside = tmp_path / "mine" / "data"
    inside.mkdir(parents=True)
    mine = [_write(inside / "train.en", copy_lines(10, 1)), _write(inside / "train.de", copy_lines(10, 1))]
    assert f"--out {tmp_path / 'mine'}: holds the input {mine[0]}" in refused(
        ["--train", *mine, "--valid", *files["valid"], "--out", str(tmp_path / "mine"), "--overwrite"])
    assert Path(mine[0]).is_file()
    assert f"--results-to {files['valid'][1]}: the same file as the input" in refused(
        ["--train", *files["train"], *own, "--results-to", files["valid"][1]])
    assert "a folder; name a file to write" in refused(["--train", *files["train"], *own, "--results-to", str(inside)])
    assert f"{mine[0]} is not a folder" in refused(["--train", *files["train"], *own, "--results-to", f"{mine[0]}/r.json"])
    assert "--train needs --valid" in refused(["--train", *files["train"], "--out", str(tmp_path / "out")])
    assert "--valid, --tgt-lang go with --train" in refused(["--valid", *files["valid"], "--tgt-lang", "fr"])
    assert "--test goes with --train" in refused(["--test", *files["valid"]])  # one option: 'goes'
    assert "--src-lang must be en or de for Multi30k" in refused(["--src-lang", "fr"])
    (tmp_path / "corpus" / "train.src").write_text("a\n")
    (tmp_path / "corpus" / "train.tgt").write_text("a\n")
    pair = [str(tmp_path / "corpus" / "train.src"), str(tmp_path / "corpus" / "train.tgt")]
    assert "give --src-lang" in refused(["--train", *pair, *own])
    assert "both files' suffixes say 'en'" in refused(["--train", files["train"][0], files["valid"][0], *own])
    # a --valid or --test pair given the other way round (its suffixes the run's languages swapped)
    swapped = f"--valid {files['valid'][1]} {files['valid'][0]}: the source file's suffix says 'de'"
    assert swapped in refused(["--train", *files["train"], "--valid", *files["valid"][::-1], "--out", str(tmp_path / "out")])
    assert "--test" in refused(["--train", *files["train"], *own, "--test", files["test"][0], files["test"][0]])
    assert "no such file (--test source)" in refused(["--train", *files["train"], *own, "--test", "nope.en", "nope.de"])
    # a misspelt --set key before the data is prepared, not after
    assert "--set train.max_stpes: unknown field 'max_stpes'" in refused(["--train", *files["train"], *own,
                                                                          "--set", "train.max_stpes=3"])
    assert not (tmp_path / "out" / "data").exists()


class _Trained(Exception):
    """Raised in place of the training stage: the demo got past preparing its data."""


def test_a_rerun_on_other_files_with_the_same_first_lines_is_refused(tmp_path, monkeypatch, capsys):
    """With --train-lines the data is prepared from the demo's copy of the first lines, so the copy's
    name and line count say nothing of the files given: a re-run on other files, or on the same ones
    the other way round, is an error naming the files the data was prepared from, not a silent reuse
    of that data and model (in another direction, for the swapped pair)."""
    files = _corpus(tmp_path / "corpus", n_train=40)
    other = [_write(tmp_path / "corpus" / f"other.{lang}", copy_lines(40, 7)) for lang in ("en", "de")]

    def trained(*args):
        raise _Trained

    monkeypatch.setattr(stages, "stage_train", trained)
    rest = ["--out", str(tmp_path / "out"), "--vocab-size", "29", "--train-lines", "20", "--eval-lines", "10"]
    for _ in range(2):  # prepared, then the same files again: a resumed run
        with pytest.raises(_Trained):
            main(["demo", "--train", *files["train"], "--valid", *files["valid"], *rest])
    was = f"prepared from {Path(files['train'][0]).resolve()} and {Path(files['train'][1]).resolve()} (the first 20"
    for train, valid in ((other, files["valid"]), (files["train"][::-1], files["valid"][::-1])):
        assert main(["demo", "--train", *train, "--valid", *valid, *rest]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and was in err[0] and f"this run gives {Path(train[0]).resolve()}" in err[0]
    assert main(["demo", "--train", *files["train"], "--valid", *files["valid"], *rest[:-4], "--eval-lines", "10"]) == 2
    assert "(40 lines)" in capsys.readouterr().err  # all the lines now


@pytest.mark.parametrize("name", ["train.en", "train.en.gz", "dir/corpus.pt-BR", "x.zh_Hant.gz"])
def test_language_from_suffix(name):
    from aiayn.demo.own import lang_of
    assert lang_of(name, "--src-lang") == name.split("/")[-1].removesuffix(".gz").split(".")[-1]


@pytest.mark.parametrize("per_process, local_sgd, processes, expected", [
    (2048, 0, 2, ["train.accum_steps=1"]),   # multi30k.json as the demo runs it on 2 cores
    (2048, 0, 1, ["train.accum_steps=2"]),   # one process: 2 batches a step
    (2048, 0, 4, ["train.accum_steps=1", "train.max_src_tokens=1024", "train.max_tgt_tokens=1024"]),
    (4096, 0, 1, ["train.accum_steps=1"]),   # multi30k-gpu.json on one GPU
    (4096, 0, 2, ["train.accum_steps=1", "train.max_src_tokens=2048", "train.max_tgt_tokens=2048"]),
    (2048, 8, 2, []),                        # local SGD: each process steps on its own
    (2048, 8, 1, ["train.accum_steps=2"]),
])
def test_step_sets_keep_the_demos_step_on_any_process_count(per_process, local_sgd, processes, expected):
    from aiayn.demo.config import DEMO_STEP_TOKENS
    from aiayn.demo.stages import step_sets
    from aiayn.train.config import TrainConfig, batching
    b = batching(TrainConfig(max_src_tokens=per_process, max_tgt_tokens=per_process))
    assert step_sets(b, local_sgd > 0, processes, DEMO_STEP_TOKENS) == expected
    assert step_sets(b, local_sgd > 0, processes, 0) == []
