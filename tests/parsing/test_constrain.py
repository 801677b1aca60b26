"""Constrained decoding: the allowed pieces by hand, then well-formed trees from any model."""
from __future__ import annotations

import pytest
import torch

from aiayn.config import replace
from aiayn.decode.search import SpecialIds, max_output_lengths, search
from aiayn.errors import UserError
from aiayn.parsing.constrain import TreeConstraint, TreeVocab
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
                  allowed=TreeConstraint(VOCAB, n_words, budget))
    for n, hs in zip(n_words.tolist(), hyps):
        assert hs and hs[0].eos and hs[0].score > float("-inf")
        words = [f"w{i}" for i in range(n)]
        result = delinearize([PIECES[t][1:] for t in hs[0].tokens], words)
        assert not result.repaired, (result.repairs, [PIECES[t] for t in hs[0].tokens])
        assert result.tree.words() == words
