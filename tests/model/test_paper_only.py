"""``aiayn.model`` is §3 of the paper and nothing else: the speed code (C kernels, padded rows,
fast dropout, the fp32 upcast of attention, the choice by device) lives in ``aiayn.execution`` and
``aiayn.kernels`` and is applied from outside; what compares or averages checkpoints lives in
``aiayn.checkpoint``. Counted on the source, as a reader meets it.
"""
from __future__ import annotations

import re
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "src" / "aiayn" / "model"
SPEED_CODE = re.compile(r"kernels|row_bits|fast_dropout|attn_fp32|device\.type")
MAX_LINES = 700  # the five modules of §3 (nanoGPT's one model file is ~330 lines, without an encoder)


def _sources() -> dict[str, list[str]]:
    return {p.name: p.read_text(encoding="utf-8").splitlines() for p in sorted(MODEL.glob("*.py"))}


def test_no_speed_code_in_the_model():
    found = [f"{name}:{i}: {line.strip()}" for name, lines in _sources().items()
             for i, line in enumerate(lines, 1) if SPEED_CODE.search(line)]
    assert found == []


def test_the_model_stays_small():
    counts = {name: len(lines) for name, lines in _sources().items()}
    assert sum(counts.values()) <= MAX_LINES, counts
