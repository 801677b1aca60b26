"""README.md's "Library" snippet runs as written: its code is read from README.md itself, so the page
cannot drift from the API."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def library_snippet() -> str:
    found = re.search(r"^## Library\n\n```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
    assert found, "README.md has no python block under ## Library"
    return found.group(1)


def test_the_readme_library_snippet_runs_as_written(untrained_checkpoint, tmp_path, monkeypatch):
    """With the tensors a reader makes for the names it leaves open (src, tgt_in, tokens, indices) and
    a checkpoint at the path it names. Its decoding step runs in eval mode: a model built from a
    config is in training mode, where dropout would perturb every step of a search."""
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    shutil.copy(untrained_checkpoint, tmp_path / "runs" / "demo" / "model.pt")
    monkeypatch.chdir(tmp_path)
    names = {"src": torch.tensor([[5, 6, 7, 3], [8, 9, 3, 0]]),  # (B, S) ids, 0 = padding, 3 = EOS
             "tgt_in": torch.tensor([[2, 5, 6], [2, 8, 0]]),  # (B, T), BOS = 2 first
             "tokens": torch.tensor([[2], [2]]),  # (B, 1): the first step's inputs
             "indices": torch.tensor([1, 1, 0])}  # the beams kept: rows of the cache
    exec(compile(library_snippet(), str(README), "exec"), names)
    model, out, cache = names["model"], names["out"], names["cache"]
    B, V = names["src"].size(0), model.cfg.vocab_size
    assert names["logits"].shape == (B, 3, V) and out.logits.shape == (B, 1, V)
    assert cache.length == 1 and cache.src_pad.size(0) == 3
    assert not any(m.training for m in model.modules())
