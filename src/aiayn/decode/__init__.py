"""Decoding (§6.1): greedy / beam search / sampling over a step protocol (``search``), the
adapter over ``aiayn.Transformer`` (``adapter``), and text-in text-out ``Translator``, made from
checkpoints by ``loading``."""
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import Constraints, Hypothesis, SpecialIds, length_penalty, search

__all__ = ["Constraints", "DecodeConfig", "Hypothesis", "SpecialIds", "length_penalty", "search"]
