"""Parsing with a trained model (§6.3): words -> beam search -> linearized tree -> repaired tree.

The paper's decoding settings for parsing: beam size 21, α = 0.3, maximum output length =
input length + 300 (``PARSE_DECODE``; input length in source subword tokens, EOS included, as
``aiayn.decode`` measures it). Each output is delinearized over the sentence's own words with
the gold POS tags (``aiayn.parsing.linearize`` explains why), repaired if ill-formed, and counted.
"""
from __future__ import annotations

import logging
from typing import Sequence

from aiayn.config import replace
from aiayn.decode.config import DecodeConfig
from aiayn.parsing.linearize import RepairStats, delinearize
from aiayn.parsing.trees import Tree

log = logging.getLogger(__name__)

PARSE_DECODE = replace(DecodeConfig(), beam_size=21, alpha=0.3, max_len_a=1.0, max_len_b=300)


def parse_trees(translator, gold: Sequence[Tree]) -> tuple[list[Tree], RepairStats]:
    """Predicted trees over the words of ``gold`` (one per gold tree, in order) and repair counts.

    ``translator`` is an ``aiayn.decode.translator.Translator`` (anything with ``translate(lines)``).
    """
    outputs = translator.translate([" ".join(t.words()) for t in gold])
    stats = RepairStats()
    trees = []
    for g, text in zip(gold, outputs):
        result = delinearize(text.split(), g.words(), g.tags())
        stats.add(result)
        trees.append(result.tree)
    log.info("%s", stats.summary())
    return trees, stats
