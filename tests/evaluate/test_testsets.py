"""``aiayn evaluate --testset``: test sets through sacreBLEU's downloader, its cache filled here
from ../shared/data/wmt14-newstest so that nothing is downloaded."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.errors import UserError
from aiayn.evaluate.testsets import fetch_testset
from tests.decode.test_translator import make_checkpoint, spm_bytes  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[2]


def fill_sacrebleu_cache(outdir: Path, shared: Path, n: int | None = None) -> list[str]:
    """The text files sacreBLEU makes of wmt14/full en-de, from the shared newstest2014 (first ``n``
    lines); returns the source lines."""
    news = shared / "wmt14-newstest"
    src = gzip.decompress((news / "newstest2014-deen.en.gz").read_bytes()).decode().splitlines()[:n]
    ref = gzip.decompress((news / "newstest2014-deen.de.gz").read_bytes()).decode().splitlines()[:n]
    outdir.mkdir(parents=True, exist_ok=True)
    fields = {"src": src, "ref": ref, "docid": ["d"] * len(src), "genre": ["news"] * len(src),
              "origlang": ["en"] * len(src)}
    for field, lines in fields.items():
        (outdir / f"wmt14_full.en-de.{field}").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    return src


@pytest.fixture
def wmt14_cache(tmp_path, monkeypatch):
    """sacreBLEU's wmt14/full pointed at an empty folder of this test (its folders are fixed at import)."""
    from sacrebleu.dataset import DATASETS
    outdir = tmp_path / "sacrebleu" / "wmt14" / "full"
    monkeypatch.setattr(DATASETS["wmt14/full"], "_outdir", str(outdir))
    monkeypatch.setattr(DATASETS["wmt14/full"], "_rawdir", str(outdir / "raw"))
    return outdir


def test_sacrebleu_env_cache_is_used(tmp_path, shared_data):
    """$SACREBLEU names the cache; a filled one is read without any download (none is possible here)."""
    src = fill_sacrebleu_cache(tmp_path / "wmt14" / "full", shared_data)
    code = ("from aiayn.evaluate.testsets import fetch_testset; s, r, name = fetch_testset('wmt14', 'en-de'); "
            "print(len(s), len(r), name); print(s[0])")
    out = subprocess.run([sys.executable, "-c", code], env={"SACREBLEU": str(tmp_path), "PATH": "/usr/bin:/bin"},
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["3003 3003 wmt14/full", src[0]]


def test_download_failure_and_bad_names_are_user_errors(wmt14_cache, monkeypatch):
    import sacrebleu.dataset.base as base

    def no_network(url, *args, **kwargs):
        raise SystemExit(1)  # what sacreBLEU does after logging a bad MD5
    monkeypatch.setattr(base, "download_file", no_network)
    with pytest.raises(UserError, match=r"--testset wmt14: sacreBLEU could not fetch wmt14/full en-de into .*full"):
        fetch_testset("wmt14", "en-de")
    with pytest.raises(UserError, match=r"--testset nope: not a test set sacreBLEU knows"):
        fetch_testset("nope", "en-de")
    with pytest.raises(UserError, match=r"wmt14/full\) has no en-xx; it has cs-en, de-en"):
        fetch_testset("wmt14", "en-xx")


def test_cli_evaluate_testset(wmt14_cache, shared_data, tmp_path, spm_bytes, capsys):  # noqa: F811
    fill_sacrebleu_cache(wmt14_cache, shared_data, n=4)
    ckpt = make_checkpoint(tmp_path / "tiny.pt", spm_bytes)
    args = ["evaluate", "--checkpoint", ckpt, "--testset", "wmt14", "--max-len-b", "2", "--beam-size", "1",
            "--c-kernels", "false"]  # no kernel compilation
    assert main(args + ["--json", "--out", str(tmp_path / "hyp")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sentences"] == 4 and len((tmp_path / "hyp").read_text().splitlines()) == 4
    assert main(args + ["--src", "x"]) == 2
    assert "leave out --src and --ref" in capsys.readouterr().err
    assert main(["evaluate", "--checkpoint", ckpt]) == 2
    assert "give --src and --ref, or --testset" in capsys.readouterr().err
