"""Parsing with a trained model (§6.3): words -> beam search -> linearized tree -> tree.

The paper's decoding settings for parsing: beam size 21, α = 0.3, maximum output length =
input length + 300 (``PARSE_DECODE``; input length in source subword tokens, EOS included, as
``aiayn.decode`` measures it). By default the search is constrained (``aiayn.parsing.constrain``)
so every output is a well-formed tree over exactly the input words; unconstrained outputs are
repaired where needed (``aiayn.parsing.linearize.delinearize``) and the repairs counted. The words
go back into the ``XX`` slots with the POS tags given (the gold ones when scoring), or ``XX``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from aiayn.config import ConfigError, param, replace
from aiayn.data.vocab import SPECIAL_IDS
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import Constraints, max_output_lengths, search
from aiayn.errors import InputError
from aiayn.parsing.constrain import SPACE, NoRoomForTree, TreeConstraint, TreeVocab, WordPieces, linearization_of
from aiayn.parsing.linearize import Delinearized, RepairStats, delinearize
from aiayn.parsing.evalb import read_lines
from aiayn.parsing.trees import BracketError, Tree, parse_tree

log = logging.getLogger(__name__)

PARSE_DECODE = replace(DecodeConfig(), beam_size=21, alpha=0.3, max_len_a=1.0, max_len_b=300)


@dataclass(frozen=True)
class ParseOptions:
    """How model outputs become trees (§6.3)."""

    constrained: bool = param(True, "constrained beam search: only well-formed trees over exactly the input words, "
                                    "in this process (no workers, no mbr); false = the plain search, ill-formed trees "
                                    "repaired (docs/parsing.md)")
    word_mass: bool = param(True, "words linearization, constrained: placing the next word scores the probability of "
                                  "any word there (the constraint picks which); false = the exact pieces' probability "
                                  "(docs/parsing.md)")


def tree_vocab(translator) -> TreeVocab:
    """The tree tokens of ``translator``'s target vocabulary (and so its model's linearization)."""
    tok = translator.tgt_tok
    return TreeVocab.from_pieces([tok.piece(i) for i in range(tok.vocab_size)], translator.ids.eos, tok.user_symbols)


def _constrained_linear(translator, vocab: TreeVocab, ids: list[list[int]],
                        sentences: Sequence[Sequence[str]], word_mass: bool = True,
                        where: tuple[str, int] = ("<input>", 1)) -> list[list[str]]:
    """The best constrained output per line of source ids (``translator.encode``), as tree tokens
    (``(NP``, ``)NP``) and words (``XX``, or the sentence's own words: never detokenized, where
    ``<unk>`` pieces would come back as ``⁇``). A line whose maximum output length leaves no room
    for its tree is an ``InputError`` naming it (``where``: the source and its first line)."""
    out: list[list[str]] = [[] for _ in ids]
    dev = translator.device
    for batch in translator.batches(ids):
        src = torch.full((len(batch), max(len(ids[i]) for i in batch)), translator.ids.pad, dtype=torch.long)
        for b, i in enumerate(batch):
            src[b, : len(ids[i])] = torch.tensor(ids[i])
        src = src.to(dev)  # (B, S)
        budget = max_output_lengths(src, translator.cfg, translator.ids.pad, translator.output_cap) - 1  # (B,)
        spelled = [[_spelled(translator.tgt_tok, w) for w in sentences[i]] for i in batch]
        words = None if vocab.word >= 0 else WordPieces.from_lists(spelled, dev)
        try:
            allowed = TreeConstraint(vocab, torch.tensor([len(sentences[i]) for i in batch], device=dev), budget,
                                     words, word_mass)
        except NoRoomForTree as exc:
            i = batch[exc.rows[0]]
            raise InputError(where[0], where[1] + i, f"{exc} ({len(sentences[i])} words, at most "
                             f"{int(budget[exc.rows[0]])} output tokens: raise --max-len-b, or split the line)") from None
        hyps = search(translator.decoder, src, translator.cfg, translator.ids,
                      Constraints(translator.output_cap, allowed=allowed))
        for b, (i, hs) in enumerate(zip(batch, hyps)):  # (none only if every allowed piece had probability 0)
            if hs:
                out[i] = _tree_tokens(translator.tgt_tok, vocab, hs[0].tokens, sentences[i], spelled[b])
    return out


def _spelled(tok, word: str) -> list[int]:
    """The target pieces of ``word`` for the ``words`` linearization: ``<unk>`` for a word that
    SentencePiece spells with no piece (``▁``, a zero-width space, a control character), which the
    constraint could not otherwise place."""
    return tok.encode(word) or [SPECIAL_IDS["unk"]]


def _tree_tokens(tok, vocab: TreeVocab, tokens, words: Sequence[str], spelled: list[list[int]]) -> list[str]:
    """A constrained output's ids as tokens: brackets and ``XX`` as their pieces, a copied word's
    pieces as the word itself (they spell ``spelled``, the words' pieces, in order)."""
    out, j, left = [], 0, 0
    for t in (int(x) for x in tokens):
        if t == vocab.eos:
            break
        if vocab.is_piece[t] and vocab.word < 0:
            if left == 0:
                out.append(words[j])
                left, j = len(spelled[j]), j + 1
            left -= 1
        else:
            out.append(tok.piece(t).lstrip(SPACE))
    return out


def check_constrainable(cfg: DecodeConfig) -> None:
    """Refuse the search options that fight the tree constraint: ``min_len`` forbids the EOS that
    ends a finished tree, ``no_repeat_ngram`` the repeats every tree has (``XX XX``, ``)NP )VP``).
    With either, the search could end with no tree, and a flat one would be made in its place."""
    clash = [f"--{name.replace('_', '-')} {value}" for name, value in
             (("min-len", cfg.min_len), ("no-repeat-ngram", cfg.no_repeat_ngram)) if value]
    if clash:
        raise ConfigError(f"{' and '.join(clash)}: not with --constrained true (the tree constraint alone decides "
                          f"where a parse ends and what it repeats); give --constrained false for the plain search")


def parse_words(translator, sentences: Sequence[Sequence[str]], tags: Sequence[Sequence[str]] | None = None,
                options: ParseOptions = ParseOptions(), source: str = "<input>",
                first_line: int = 1) -> list[Delinearized | None]:
    """A tree per sentence (a list of words; None for an empty one), in order.

    ``translator`` is an ``aiayn.decode.translator.Translator``; ``tags`` (one per word) label the
    preterminals (default ``XX``). Too long sentences are ``InputError``s naming ``source`` and
    the line (``first_line`` + index).
    """
    if options.constrained:
        check_constrainable(translator.cfg)
    lines = [" ".join(words) for words in sentences]
    linearization = linearization_of(translator.tgt_tok.user_symbols)
    skipped = set()  # lines --long-lines skip leaves out: an empty line, as translate writes
    if translator.cfg.long_lines == "skip":
        skipped = {k for k, ids in enumerate(translator.src_tok.encode_batch(lines))
                   if ids and len(ids) + 1 > translator.input_limit}
    if options.constrained:
        # a sentence whose words all encode to no piece still gets its tree: from the source EOS alone
        ids = [x or ([translator.ids.eos] if words and k not in skipped else [])
               for k, (x, words) in enumerate(zip(translator.encode(lines, source, first_line), sentences))]
        linear = _constrained_linear(translator, tree_vocab(translator), ids, sentences, options.word_mass,
                                     (source, first_line))
    else:
        linear = [text.split() for text in translator.translate(lines, source, first_line)]
    out: list[Delinearized | None] = []
    for k, (words, tokens) in enumerate(zip(sentences, linear)):
        out.append(delinearize(tokens, words, tags[k] if tags is not None else None, linearization)
                   if words and k not in skipped else None)
    return out


def read_gold_trees(path) -> tuple[list[str], list[Tree]]:
    """The lines of a gold file (as EVALB reads them) and their trees; a malformed tree is an
    ``InputError`` naming the file and line."""
    lines, trees = read_lines(path), []
    for n, text in enumerate(lines, start=1):
        try:
            trees.append(parse_tree(text))
        except BracketError as exc:
            raise InputError(path, n, str(exc)) from exc
    return lines, trees


def parse_trees(translator, gold: Sequence[Tree], options: ParseOptions = ParseOptions(), source: str = "<input>"
                ) -> tuple[list[Tree | None], RepairStats]:
    """Predicted trees over the words of ``gold`` (one per gold tree, in order, with its POS tags;
    ``source`` names its file in errors; None for a line ``--long-lines skip`` left out) and the
    repair counts (of the trees made)."""
    results = parse_words(translator, [g.words() for g in gold], [g.tags() for g in gold], options, source)
    stats = RepairStats()
    for result in results:
        if result is not None:
            stats.add(result)
    log.info("%s", stats.summary())
    return [r.tree if r is not None else None for r in results], stats


def bracketed_lines(trees: Sequence[Tree | None]) -> str:
    """One bracketing a line; an empty line for a tree not made (EVALB skips the sentence)."""
    return "".join((t.to_bracketed() if t is not None else "") + "\n" for t in trees)
