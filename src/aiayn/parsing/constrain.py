"""Constrained decoding for parsing (§6.3): beam search that can only write well-formed trees.

The target of a parsing model is a linearized tree (``aiayn.parsing.linearize``): ``(LABEL``
opens a phrase, ``)LABEL`` closes it, ``XX`` is a word's slot. Left alone, beam search may drop
or add words, leave brackets open or close the wrong one, and the output needs repair.
``TreeConstraint`` is a ``aiayn.decode.search.Allowed``: at every step it allows, per hypothesis,
only the target pieces that keep the prefix on the way to a tree over exactly the sentence's n
words. With d the open phrases, w the words placed and u the tokens generated so far:

* ``XX`` while w < n, inside a phrase (d >= 1);
* ``(LABEL`` (any label with both pieces in the vocabulary) while w < n, inside a phrase or as the
  first token (one root), and only if the rest still fits: u + 1 + (n - w) + (d + 1) <= budget;
* ``)LABEL`` of the innermost open phrase only, only once that phrase holds something (the last
  token is not an opening bracket), and for the root (d = 1) only once all n words are placed;
* EOS once the root is closed (d = 0 after at least one token), which implies w = n.

Every other piece (subwords, ``<unk>``) is forbidden. With the ``words`` linearization the words
themselves take the slots' place: the pieces of each sentence's words (P in all, in order) are
given, and with p of them placed,

* inside a word (piece p continues a word) only piece p is allowed: a word is copied whole;
* between words, piece p (the next word's first) takes ``XX``'s rule, with p < P for w < n, and
  the length rule counts pieces: u + 1 + (P - p) + (d + 1) <= budget.

From any prefix it allows, some token is
allowed, and u + (n - w) + d <= budget holds throughout, so every hypothesis ends with EOS within
``budget + 1`` tokens and delinearizes with no repair, whatever the model's probabilities. The
state is recomputed from the prefix at each step (vectorized over hypotheses; O(N * t) per step),
so the search needs no extra state to reorder.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from aiayn.data.vocab import SPECIAL_IDS
from aiayn.errors import UserError
from aiayn.parsing.linearize import SLOTS, WORD, WORDS, is_bracket

NEG_INF = float("-inf")
SPACE = "\u2581"  # SentencePiece's word-start mark: the tree tokens are the pieces "▁XX", "▁(NP", "▁)NP"


def linearization_of(symbols) -> str:
    """``slots`` when ``XX`` is among ``symbols`` (a tokenizer's user symbols, or its pieces),
    else ``words``."""
    return SLOTS if SPACE + WORD in symbols else WORDS


@dataclasses.dataclass(frozen=True)
class TreeVocab:
    """The tree tokens of a target vocabulary of V pieces, with L labels."""

    word: int            # id of the ``XX`` piece (-1 for the ``words`` linearization)
    eos: int
    open_ids: Tensor     # (L,) id of ``(LABEL`` per label
    close_ids: Tensor    # (L,) id of ``)LABEL`` per label
    open_label: Tensor   # (V,) label index of an opening piece, else -1
    close_label: Tensor  # (V,) label index of a closing piece, else -1
    is_word: Tensor      # (V,) bool: the ``XX`` piece
    is_piece: Tensor     # (V,) bool: a piece of a copied word (``words``): not a bracket, pad, BOS or EOS
    labels: tuple[str, ...]

    @property
    def linearization(self) -> str:
        return SLOTS if self.word >= 0 else WORDS

    @classmethod
    def from_pieces(cls, pieces: list[str], eos: int, user_symbols: frozenset[str] | None = None) -> "TreeVocab":
        """From the target pieces by id; labels need both brackets as single pieces. The
        linearization is ``slots`` when ``XX`` is a piece (a user symbol, when ``user_symbols``
        of the tokenizer are given), else ``words``."""
        opens, closes = {}, {}
        for i, p in enumerate(pieces):
            if p.startswith(SPACE) and is_bracket(p[1:], "("):
                opens[p[2:]] = i
            elif p.startswith(SPACE) and is_bracket(p[1:], ")"):
                closes[p[2:]] = i
        labels = tuple(sorted(set(opens) & set(closes)))
        if not labels:
            raise UserError("the target vocabulary has no bracket pieces: "
                            "not a parsing model (train one on `aiayn parse prepare` data)")
        V = len(pieces)
        open_label = torch.full((V,), -1, dtype=torch.long)
        close_label = torch.full((V,), -1, dtype=torch.long)
        for j, label in enumerate(labels):
            open_label[opens[label]], close_label[closes[label]] = j, j
        slots = linearization_of(pieces if user_symbols is None else user_symbols) == SLOTS
        word = pieces.index(SPACE + WORD) if slots else -1
        is_word = torch.zeros(V, dtype=torch.bool)
        if slots:
            is_word[word] = True
        is_piece = (open_label < 0) & (close_label < 0) & ~is_word
        is_piece[[SPECIAL_IDS["pad"], SPECIAL_IDS["bos"], eos]] = False
        for p, i in list(opens.items()) + list(closes.items()):   # brackets without their pair
            is_piece[i] = False
        return cls(word, eos, torch.tensor([opens[x] for x in labels]), torch.tensor([closes[x] for x in labels]),
                   open_label, close_label, is_word, is_piece, labels)

    def to(self, device: torch.device) -> "TreeVocab":
        return dataclasses.replace(self, **{f: getattr(self, f).to(device) for f in
                                            ("open_ids", "close_ids", "open_label", "close_label", "is_word",
                                             "is_piece")})


@dataclasses.dataclass(frozen=True)
class WordPieces:
    """The target pieces of each sentence's words, for the ``words`` linearization: B sentences,
    at most P pieces each."""

    ids: Tensor      # (B, P + 1) piece ids in order, padded with 0
    starts: Tensor   # (B, P + 1) bool: the piece begins a word (True at and after the end)
    count: Tensor    # (B,) pieces per sentence

    @classmethod
    def from_lists(cls, words: list[list[list[int]]], device: torch.device | str = "cpu") -> "WordPieces":
        """``words[b][j]``: the piece ids of word j of sentence b."""
        flat = [[i for w in sent for i in w] for sent in words]
        P = max((len(f) for f in flat), default=0)
        ids = torch.zeros(len(words), P + 1, dtype=torch.long)
        starts = torch.ones(len(words), P + 1, dtype=torch.bool)
        for b, sent in enumerate(words):
            ids[b, : len(flat[b])] = torch.tensor(flat[b], dtype=torch.long)
            k = 0
            for w in sent:
                starts[b, k + 1: k + len(w)] = False
                k += len(w)
        return cls(ids.to(device), starts.to(device), torch.tensor([len(f) for f in flat], device=device))


class NoRoomForTree(ValueError):
    """Rows (``rows``, indices of the batch) whose maximum output length leaves no room for a tree
    over every word: two brackets and the words at least."""

    def __init__(self, rows: list[int]):
        super().__init__("the maximum output length leaves no room for a tree over every word")
        self.rows = rows


class TreeConstraint:
    """``allowed(rows, prefix)`` for ``aiayn.decode.search`` (module docstring).

    ``n_words`` (B,): words of each batch sentence (>= 1); ``budget`` (B,): tokens it may generate
    before EOS (the search's maximum output length - 1; at least n + 2). ``words``: the words'
    pieces, required for (and only for) the ``words`` linearization; n then counts pieces.
    """

    def __init__(self, vocab: TreeVocab, n_words: Tensor, budget: Tensor, words: WordPieces | None = None,
                 word_mass: bool = True):
        if (words is None) != (vocab.linearization == SLOTS):
            raise ValueError("the words' pieces are needed for (and only for) the words linearization")
        if words is not None:
            if bool(vocab.is_piece.to(words.ids.device)[words.ids].logical_not().logical_and(
                    torch.arange(words.ids.shape[1], device=words.ids.device) < words.count[:, None]).any()):
                raise UserError("a word is spelled with a bracket piece of the tree vocabulary: "
                                "escape brackets as -LRB- and -RRB-")
            n_words = words.count
        short = (budget < n_words + 2).nonzero().flatten().tolist()
        if short:
            raise NoRoomForTree(short)
        self.vocab, self.n_words, self.budget, self.words = vocab.to(n_words.device), n_words, budget, words
        self.word_mass = word_mass

    def state(self, prefix: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per row of prefix (N, u): words placed w, open phrases d, the innermost open phrase's
        label (-1 if none) and whether the last token opened a phrase; all (N,)."""
        v, (N, u) = self.vocab, prefix.shape
        if u == 0:
            zero = torch.zeros(N, dtype=torch.long, device=prefix.device)
            return zero, zero, zero - 1, zero.bool()
        opened, closed = v.open_label[prefix], v.close_label[prefix]  # (N, u) label or -1
        is_open = opened >= 0
        depth = (is_open.long() - (closed >= 0).long()).cumsum(1)  # (N, u) open phrases after each token
        d = depth[:, -1]
        # The innermost open phrase is the last opening token whose depth is still the current one.
        pos = torch.arange(1, u + 1, device=prefix.device).expand(N, u)
        last = torch.where(is_open & (depth == d[:, None]), pos, 0).amax(1)  # (N,) 1-based, 0 = none
        top = torch.where(last > 0, opened.gather(1, (last - 1).clamp(min=0)[:, None]).squeeze(1), -1)
        return v.is_word[prefix].sum(1), d, top, is_open[:, -1]

    def next_piece(self, rows: Tensor, prefix: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``words`` only, per row of prefix (N, u): the pieces placed p, the id of piece p and
        whether it continues a word (rather than starting one); all (N,)."""
        p = self.vocab.is_piece[prefix].sum(1) if prefix.shape[1] else torch.zeros_like(rows)
        ids, starts = self.words.ids[rows], self.words.starts[rows]  # (N, P + 1)
        # (a beam search also extends its dead hypotheses, score -inf, with pieces never allowed: clamp)
        at = p.clamp(max=ids.shape[1] - 1)[:, None]
        return p, ids.gather(1, at).squeeze(1), ~starts.gather(1, at).squeeze(1)

    def rescore(self, log_probs: Tensor, rows: Tensor, prefix: Tensor) -> Tensor:
        """``aiayn.decode.search.Rescoring``: log_probs (N, V) masked to the allowed pieces; with
        ``word_mass`` (``words`` only) a word's first piece scores the probability that any word
        comes next (the sum over every word piece: the constraint decides which word) and its
        other pieces score 0 (they are forced). A model then need not copy well to place words."""
        allowed, (following, inside) = self._allowed(rows, prefix)
        if self.words is not None and self.word_mass:
            any_word = log_probs.masked_fill(~self.vocab.is_piece, NEG_INF).logsumexp(1)  # (N,)
            r = torch.arange(len(rows), device=rows.device)
            log_probs[r, following] = torch.where(inside, 0.0, any_word)
        return log_probs.masked_fill_(~allowed, NEG_INF)

    def __call__(self, rows: Tensor, prefix: Tensor) -> Tensor:
        """(N, V) bool: the pieces each hypothesis may generate next."""
        return self._allowed(rows, prefix)[0]

    def _allowed(self, rows: Tensor, prefix: Tensor) -> tuple[Tensor, tuple[Tensor | None, Tensor | None]]:
        """``__call__``'s mask, and (``words`` only, else None) ``next_piece``'s id of piece p and
        whether it continues a word, for ``rescore``."""
        v, (N, u) = self.vocab, prefix.shape
        following = inside = None
        n, budget = self.n_words[rows], self.budget[rows]  # (N,)
        w, d, top, last_open = self.state(prefix)
        mask = torch.zeros(N, v.is_word.numel(), dtype=torch.bool, device=prefix.device)
        if self.words is None:
            mask[:, v.word] = (d >= 1) & (w < n)
        else:
            w, following, inside = self.next_piece(rows, prefix)
            r = ((d >= 1) & (w < n) | inside).nonzero().squeeze(1)
            mask[r, following[r]] = True
        can_open = (w < n) & ((d >= 1) | (u == 0)) & (u + 1 + (n - w) + (d + 1) <= budget)
        mask[:, v.open_ids] = can_open[:, None]
        can_close = (d >= 1) & ~last_open & ((d > 1) | (w == n)) & (top >= 0)
        r = can_close.nonzero().squeeze(1)
        mask[r, v.close_ids[top[r]]] = True
        mask[:, v.eos] = (d == 0) & (u > 0) & (w == n)
        if self.words is not None:
            mask[inside] = False
            r = inside.nonzero().squeeze(1)
            mask[r, following[r]] = True
        return mask, (following, inside)
