"""scripts/wmt14.sh end to end on stand-in files: real newstest text under the WMT14 file names.

A few hundred lines of newstest2013 stand in for each training corpus (Europarl v7, Common Crawl
gzipped, News Commentary v9; for En-Fr also the UN corpus and the gzipped Gigaword corpus), 50
more for the dev set, and the first 12 lines of newstest2014 as test-full.tgz's SGML. The script
runs with --ci: a one-layer model of width 32, 4 steps of two accumulated 300-token batches.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "wmt14.sh"


def _lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def _write(path: Path, lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode("utf-8")))
    else:
        path.write_text(text, encoding="utf-8")


def _sgm(path: Path, lines: list[str], kind: str) -> None:
    segs = [f'<seg id="{i}">{line}</seg>' for i, line in enumerate(lines, 1)]
    _write(path, [f'<{kind}set setid="newstest2014" srclang="any">', '<doc docid="stand-in" origlang="en">',
                  *segs, "</doc>", f"</{kind}set>"])


def stand_in(raw: Path, news: Path, tgt: str) -> None:
    """The WMT14 file names, with newstest lines standing in for each corpus."""
    en, xx = _lines(news / "newstest2013.en.gz"), _lines(news / f"newstest2013.{tgt}.gz")
    pair = f"{tgt}-en"
    corpora = [f"training/europarl-v7.{pair}", f"commoncrawl.{pair}", f"training/news-commentary-v9.{pair}"]
    if tgt == "fr":
        corpora += ["un/undoc.2000.fr-en", "giga-fren.release2.fixed"]
    (raw / "training").mkdir(parents=True)
    (raw / "un").mkdir()
    for k, name in enumerate(corpora):
        gz = ".gz" if name.startswith(("commoncrawl", "giga")) else ""
        src, ref = en[300 * k:300 * (k + 1)], xx[300 * k:300 * (k + 1)]
        if k == 0:
            ref[5] = "  "  # an empty side: dropped by the clean stage
        _write(raw / f"{name}.en{gz}", src)
        _write(raw / f"{name}.{tgt}{gz}", ref)
    (raw / "dev").mkdir()
    _write(raw / "dev" / "newstest2013.en", en[2900:2950])
    _write(raw / "dev" / f"newstest2013.{tgt}", xx[2900:2950])
    test = f"newstest2014-{tgt}en"
    (raw / "test-full").mkdir()
    _sgm(raw / "test-full" / f"{test}-src.en.sgm", _lines(news / f"{test}.en.gz")[:12], "src")
    _sgm(raw / "test-full" / f"{test}-ref.{tgt}.sgm", _lines(news / f"{test}.{tgt}.gz")[:12], "ref")


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
def test_en_de_walk_through_end_to_end(tmp_path, shared_data):
    raw, work = tmp_path / "raw", tmp_path / "work"
    stand_in(raw, shared_data / "wmt14-newstest", "de")
    proc = run_script("--raw", str(raw), "--work", str(work), "--pair", "ende", "--model", "base", "--ci")
    err = proc.stderr
    assert "europarl-v7.de-en: 299 pairs kept, 1 dropped" in err
    assert "commoncrawl.de-en: 300 pairs kept, 0 dropped" in err
    assert "300 tokens x 1 x 2 accumulated per step" in err
    manifest = json.loads((work / "data" / "manifest.json").read_text())
    assert manifest["vocab"]["model_type"] == "bpe" and manifest["vocab"]["src"]["vocab_size"] == 1000
    assert manifest["splits"]["train"]["inputs"]["lines"] == 899 and manifest["splits"]["test"]["pairs"] == 12
    # the SGML segments, in order, are the test set
    assert (work / "text" / "test.en").read_text(encoding="utf-8").splitlines() == \
        _lines(shared_data / "wmt14-newstest" / "newstest2014-deen.en.gz")[:12]
    config = json.loads((work / "run" / "config.json").read_text())
    assert (config["train"]["accum_steps"], config["train"]["max_tgt_tokens"], config["model"]["d_model"]) == (2, 300, 32)
    assert config["train"]["warmup_steps"] == 2 and config["train"]["eps_ls"] == 0.1  # the recipe, overridden for CI
    assert "averaged 4 checkpoint(s)" in proc.stdout  # --last 5 of a 4-step run
    assert len((work / "newstest2014.de").read_text(encoding="utf-8").splitlines()) == 12
    labels = [s["label"] for s in json.loads((work / "scores.json").read_text())["scores"]]
    assert any("sacreBLEU" in x for x in labels) and any("compound" in x for x in labels)
    assert "newstest2014: 12 sentences" in proc.stdout


@pytest.mark.slow
def test_en_fr_prepares_a_shared_unigram_vocabulary_from_five_corpora(tmp_path, shared_data):
    raw, work = tmp_path / "raw", tmp_path / "work"
    stand_in(raw, shared_data / "wmt14-newstest", "fr")
    proc = run_script("--raw", str(raw), "--work", str(work), "--pair", "enfr", "--model", "big", "--ci",
                      "--stages", "clean,prepare")
    assert "giga-fren.release2.fixed: 300 pairs kept" in proc.stderr and "undoc.2000.fr-en: 300" in proc.stderr
    manifest = json.loads((work / "data" / "manifest.json").read_text())
    assert manifest["vocab"]["model_type"] == "unigram" and manifest["vocab"]["shared"]
    assert manifest["splits"]["train"]["inputs"]["lines"] == 1499
    assert not (work / "run").exists()


@pytest.mark.parametrize("gpus,tokens", [(0, ""), (1, ""), (3, ""), (8, ""), (16, ""), (2, "12500"), (8, "5000")])
def test_plan_splits_the_batch_as_estimate_does(tmp_path, gpus, tokens):
    """The script's batch split (bash arithmetic) is aiayn.cost.estimate.paper_batch's."""
    from aiayn.cost.estimate import paper_batch
    args = ["--work", str(tmp_path), "--stages", "plan", "--gpus", str(gpus)] + (["--tokens-per-gpu", tokens] if tokens else [])
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, check=True)
    assert tuple(map(int, proc.stdout.split())) == paper_batch(max(gpus, 1), int(tokens or 3125))


def test_missing_corpus_is_named(tmp_path):
    (tmp_path / "raw").mkdir()
    proc = subprocess.run(["bash", str(SCRIPT), "--raw", str(tmp_path / "raw"), "--work", str(tmp_path / "w"),
                           "--ci", "--stages", "clean"], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 2 and "no europarl-v7.de-en.en (or europarl-v7.de-en.en.gz)" in proc.stderr


def test_average_stage_reruns(tmp_path, tiny_checkpoint):
    """The average stage is rerunnable like the others: its own average.pt is replaced (a rerun after
    a failed evaluate, or after training further), not an error that stops the script there."""
    run = tmp_path / "w" / "run"
    run.mkdir(parents=True)
    shutil.copy(tiny_checkpoint, run / "ckpt_step00000003.pt")
    for _ in range(2):
        proc = run_script("--work", str(tmp_path / "w"), "--ci", "--stages", "average")
        assert "averaged 1 checkpoint(s)" in proc.stdout
    assert (run / "average.pt").is_file()


@pytest.mark.parametrize("option", ["--work", "--gpus", "--set"])
def test_an_option_without_its_value_is_one_line(tmp_path, option):
    args = ["--work", str(tmp_path)] if option != "--work" else []
    proc = subprocess.run(["bash", str(SCRIPT), *args, option], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == f"wmt14.sh: error: {option} needs a value\n"


def test_a_python_without_aiayn_is_named_before_any_stage(tmp_path):
    """Every stage but clean runs aiayn through $PYTHON (default: the checkout's .venv, else the
    shell's python): one without aiayn is one line naming it, before the clean stage's work."""
    no_aiayn = tmp_path / "python"
    no_aiayn.write_text("#!/bin/sh\nexit 1\n")
    no_aiayn.chmod(0o755)
    proc = subprocess.run(["bash", str(SCRIPT), "--work", str(tmp_path / "w"), "--ci"], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": str(no_aiayn)})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{no_aiayn} cannot import aiayn" in proc.stderr and ".venv/bin/activate" in proc.stderr
    assert not (tmp_path / "w" / "text").exists()
