"""Constrained decoding: the allowed pieces by hand, then well-formed trees from any model."""
from __future__ import annotations

import pytest
import torch

from aiayn.config import replace
from aiayn.decode.search import Constraints, SpecialIds, max_output_lengths, search
from aiayn.errors import UserError
from aiayn.parsing.constrain import TreeConstraint, TreeVocab, WordPieces
from aiayn.parsing.decode import PARSE_DECODE
from aiayn.parsing.linearize import delinearize

PIECES = ["<pad>", "<unk>", "<s>", "</s>", "▁XX", "▁(S", "▁)S", "▁(NP", "▁)NP", "▁(VP", "▁)VP",
          "▁a", "b", "▁(ADJP"]          # ADJP has no closing piece: never opened
EOS, XX, OS, CS, ONP, CNP, OVP, CVP = 3, 4, 5, 6, 7, 8, 9, 10
VOCAB = TreeVocab.from_pieces(PIECES, EOS)


def allowed_after(prefix: list[int], n: int, budget: int = 100) -> set[int]:
    c = TreeConstraint(VOCAB, torch.tensor([n]), torch.tensor([budget]))
    mask = c(torch.tensor([0]), torch.tensor([prefix], dtype=torch.long).view(1, len(prefix)))
    return set(mask[0].nonzero().squeeze(1).tolist())


def test_vocab_reads_the_tree_pieces():
    assert VOCAB.labels == ("NP", "S", "VP") and VOCAB.word == XX
    assert VOCAB.open_ids.tolist() == [ONP, OS, OVP] and VOCAB.close_ids.tolist() == [CNP, CS, CVP]
    with pytest.raises(UserError, match="not a parsing model"):
        TreeVocab.from_pieces(["<pad>", "<unk>", "<s>", "</s>", "▁a"], EOS)


def test_allowed_pieces_by_hand():
    opens = {OS, ONP, OVP}
    assert allowed_after([], 2) == opens                          # one root phrase first
    assert allowed_after([OS], 2) == opens | {XX}                 # no close of an empty phrase
    assert allowed_after([OS, ONP, XX], 2) == opens | {XX, CNP}   # only the innermost closes
    assert allowed_after([OS, ONP, XX, CNP], 2) == opens | {XX}   # the root waits for the last word
    assert allowed_after([OS, ONP, XX, CNP, XX], 2) == {CS}       # all placed: close, no more opens
    assert allowed_after([OS, ONP, XX, CNP, XX, CS], 2) == {EOS}  # closed root: only EOS
    assert allowed_after([OS, XX, OVP, XX, CVP], 2) == {CS}


def test_opening_only_while_the_rest_still_fits():
    # n = 1: "(S XX )S" takes 3 tokens; another phrase inside it needs 2 more.
    assert allowed_after([], 1, budget=3) == {OS, ONP, OVP}
    assert allowed_after([OS], 1, budget=3) == {XX}
    assert allowed_after([OS], 1, budget=5) == {XX, OS, ONP, OVP}
    with pytest.raises(ValueError, match="no room"):
        TreeConstraint(VOCAB, torch.tensor([2]), torch.tensor([3]))


class RandomDecoder:
    """A stand-in for any model: random next-piece distributions, peaked by ``scale``, with extra
    weight on ``favourite`` (EOS, a closing bracket, a subword...) to tempt the search."""

    class State:
        def reorder(self, idx):
            return self

    def __init__(self, V: int, seed: int, scale: float, favourite: int | None):
        self.V, self.scale, self.favourite = V, scale, favourite
        self.g = torch.Generator().manual_seed(seed)

    def start(self, src, max_len):
        return self.State()

    def step(self, tokens, state):
        logits = self.scale * torch.randn(tokens.numel(), self.V, generator=self.g)
        if self.favourite is not None:
            logits[:, self.favourite] += 10.0
        return logits.log_softmax(1), state


@pytest.fixture
def one_thread():
    """Many small tensor operations: one thread runs them fastest (and does not fight for the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("B, beam, scale, favourite, max_len_b", [
    (40, 1, 1.0, None, 300), (40, 4, 5.0, EOS, 60), (20, 21, 3.0, CS, 300), (40, 3, 3.0, ONP, 12),
    (40, 5, 8.0, 12, 40)])
def test_every_output_is_a_tree_over_exactly_the_words(B, beam, scale, favourite, max_len_b):
    """Whatever the model, each output delinearizes with no repair over the sentence's own words
    (random models mostly nest phrases until the length budget forces the closes: that is tested too)."""
    g = torch.Generator().manual_seed(beam)
    n_words = torch.randint(1, 25, (B,), generator=g)  # (B,) sentences of 1-24 words
    src = torch.zeros(B, int(n_words.max()) + 1, dtype=torch.long)
    for b, n in enumerate(n_words.tolist()):
        src[b, : n + 1] = 11                              # one source piece per word, then EOS
    cfg = replace(PARSE_DECODE, beam_size=beam, max_len_b=max_len_b)
    budget = max_output_lengths(src, cfg, 0) - 1
    hyps = search(RandomDecoder(len(PIECES), beam, scale, favourite), src, cfg, SpecialIds(),
                  Constraints(allowed=TreeConstraint(VOCAB, n_words, budget)))
    for n, hs in zip(n_words.tolist(), hyps):
        assert hs and hs[0].eos and hs[0].score > float("-inf")
        words = [f"w{i}" for i in range(n)]
        result = delinearize([PIECES[t][1:] for t in hs[0].tokens], words)
        assert not result.repaired, (result.repairs, [PIECES[t] for t in hs[0].tokens])
        assert result.tree.words() == words


# The words linearization: no XX piece; words are copied piece by piece.
PIECES_W = ["<pad>", "<unk>", "<s>", "</s>", "▁(S", "▁)S", "▁(NP", "▁)NP", "▁(VP", "▁)VP", "▁a", "b", "▁c", "d"]
W_OS, W_CS, W_ONP, W_CNP, W_OVP, W_CVP, A, B_, C, D = range(4, 14)
VOCAB_W = TreeVocab.from_pieces(PIECES_W, EOS)


def words_allowed_after(prefix: list[int], words: list[list[int]], budget: int = 100) -> set[int]:
    c = TreeConstraint(VOCAB_W, torch.tensor([len(words)]), torch.tensor([budget]), WordPieces.from_lists([words]))
    mask = c(torch.tensor([0]), torch.tensor([prefix], dtype=torch.long).view(1, len(prefix)))
    return set(mask[0].nonzero().squeeze(1).tolist())


def test_words_vocab_has_no_slot_and_knows_the_pieces():
    assert VOCAB_W.linearization == "words" and VOCAB.linearization == "slots"
    assert VOCAB_W.is_piece.nonzero().squeeze(1).tolist() == [1, A, B_, C, D]   # <unk> is a word's piece too
    # the tokenizer's user symbols decide, not the pieces alone: "▁XX" as a plain BPE piece is a word's piece
    assert TreeVocab.from_pieces(PIECES, EOS, frozenset(PIECES[4:11])).linearization == "slots"
    assert TreeVocab.from_pieces(PIECES, EOS, frozenset(PIECES[5:11])).linearization == "words"


def test_words_copied_whole_by_hand():
    words = [[A, B_], [C], [C, D]]                                  # "ab c cd"
    opens = {W_OS, W_ONP, W_OVP}
    assert words_allowed_after([], words) == opens
    assert words_allowed_after([W_OS], words) == opens | {A}                   # the first word's first piece
    assert words_allowed_after([W_OS, A], words) == {B_}                       # inside a word: only its next piece
    assert words_allowed_after([W_OS, W_ONP, A, B_], words) == opens | {C, W_CNP}
    assert words_allowed_after([W_OS, A, B_, C], words) == opens | {C}         # the root waits for the last word
    assert words_allowed_after([W_OS, A, B_, C, C], words) == {D}
    assert words_allowed_after([W_OS, A, B_, C, C, D], words) == {W_CS}
    assert words_allowed_after([W_OS, A, B_, C, C, D, W_CS], words) == {EOS}
    # the length rule counts pieces: "(S a b )S" is 4 tokens, a phrase inside needs 2 more
    assert words_allowed_after([W_OS], [[A, B_]], budget=4) == {A}
    assert words_allowed_after([W_OS], [[A, B_]], budget=6) == opens | {A}


def test_words_need_their_pieces_and_no_bracket_in_a_word():
    with pytest.raises(ValueError, match="words linearization"):
        TreeConstraint(VOCAB_W, torch.tensor([1]), torch.tensor([50]))
    with pytest.raises(ValueError, match="words linearization"):
        TreeConstraint(VOCAB, torch.tensor([1]), torch.tensor([50]), WordPieces.from_lists([[[11]]]))
    with pytest.raises(UserError, match="bracket piece"):
        TreeConstraint(VOCAB_W, torch.tensor([1]), torch.tensor([50]), WordPieces.from_lists([[[W_ONP]]]))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("B, beam, scale, favourite", [(30, 1, 1.0, None), (30, 4, 5.0, EOS), (20, 21, 3.0, W_CS),
                                                       (30, 5, 8.0, D)])
def test_every_words_output_is_a_tree_copying_exactly_the_words(B, beam, scale, favourite):
    g = torch.Generator().manual_seed(beam)
    vocab = ["ab", "c", "cd", "abdd", "a"]
    spelled = {"ab": [A, B_], "c": [C], "cd": [C, D], "abdd": [A, B_, D, D], "a": [A]}
    sentences = [[vocab[i] for i in torch.randint(0, 5, (int(n),), generator=g).tolist()]
                 for n in torch.randint(1, 15, (B,), generator=g)]
    words = WordPieces.from_lists([[spelled[w] for w in s] for s in sentences])
    src = torch.zeros(B, int(words.count.max()) + 1, dtype=torch.long)
    for b, n in enumerate(words.count.tolist()):
        src[b, : n + 1] = 11
    cfg = replace(PARSE_DECODE, beam_size=beam, max_len_b=40)
    budget = max_output_lengths(src, cfg, 0) - 1
    hyps = search(RandomDecoder(len(PIECES_W), beam, scale, favourite), src, cfg, SpecialIds(),
                  Constraints(allowed=TreeConstraint(VOCAB_W, torch.tensor([len(s) for s in sentences]), budget, words)))
    for sentence, hs in zip(sentences, hyps):
        assert hs and hs[0].eos and hs[0].score > float("-inf")
        text = "".join(PIECES_W[t] for t in hs[0].tokens).replace("▁", " ").split()
        assert [t for t in text if t[0] not in "()"] == sentence
        result = delinearize(text, sentence, linearization="words")
        assert not result.repaired, (result.repairs, text)
        assert result.tree.words() == sentence


def test_word_mass_scores_any_word_then_forces_the_rest():
    """A word's first piece scores log(sum of every word piece's probability); its later pieces 0."""
    c = TreeConstraint(VOCAB_W, torch.tensor([2]), torch.tensor([100]), WordPieces.from_lists([[[A, B_], [C]]]))
    probs = torch.full((1, len(PIECES_W)), 0.02)
    probs[0, [1, A, B_, C, D]] = torch.tensor([0.01, 0.1, 0.05, 0.2, 0.04])   # word pieces: 0.4 in all
    out = c.rescore(probs.log(), torch.tensor([0]), torch.tensor([[W_OS]]))
    assert out[0, A].item() == pytest.approx(torch.tensor(0.4).log().item())   # (S -> the first word: any word
    assert out[0, W_ONP].item() == pytest.approx(torch.tensor(0.02).log().item())
    assert set(out[0].isfinite().nonzero().squeeze(1).tolist()) == {A, W_OS, W_ONP, W_OVP}
    out = c.rescore(probs.log(), torch.tensor([0]), torch.tensor([[W_OS, A]]))
    assert out[0, B_].item() == 0.0 and out[0].isfinite().sum().item() == 1       # inside: forced, free
    plain = TreeConstraint(VOCAB_W, torch.tensor([2]), torch.tensor([100]), WordPieces.from_lists([[[A, B_], [C]]]),
                           word_mass=False).rescore(probs.log(), torch.tensor([0]), torch.tensor([[W_OS]]))
    assert plain[0, A].item() == pytest.approx(torch.tensor(0.1).log().item())
