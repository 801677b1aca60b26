"""``Translator`` and the decoding cache used from Python, as a library: what it leaves of the caller's
models and of torch's global state, and one-line errors for what a caller gets wrong."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from aiayn.config import replace
from aiayn.decode.cache import init_cache
from aiayn.decode.config import DecodeConfig
from aiayn.decode.loading import load_model_for_inference
from aiayn.decode.translator import Translator
from aiayn.errors import UserError
from tests.conftest import copy_lines

CFG = DecodeConfig(max_len_b=4)  # short outputs: a random model's are as long as allowed


def _modes(model: torch.nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


@pytest.mark.parametrize("packed", [False, True])  # False: the caller's model decodes as it is (as on CUDA)
def test_a_model_in_training_decodes_without_dropout_and_stays_in_training(untrained_checkpoint, packed):
    """A fine-tuning loop that translates its validation lines with its own model: the search runs in
    eval mode, and the model comes back in the mode each of its modules had, not left in eval (dropout
    off for the rest of the run) on one path and in training on the other."""
    model, src_tok, tgt_tok = load_model_for_inference(untrained_checkpoint)
    assert model.cfg.p_drop > 0
    cfg = replace(CFG, packed_weights=packed)
    lines = copy_lines(4, seed=3)
    want = Translator(model, src_tok, tgt_tok, cfg).translate_nbest(lines)  # in eval mode: no dropout
    ids = Translator(model, src_tok, tgt_tok, cfg).encode(lines[:1])[0]
    want_att = Translator(model, src_tok, tgt_tok, cfg).attention(ids, want[0][0].tokens, want[0][0].eos)
    model.train()
    model.encoder_layers[0].eval()  # a mix of modes (a frozen layer), each to be given back as it was
    modes = _modes(model)
    tr = Translator(model, src_tok, tgt_tok, cfg)
    assert [[(t.text, t.tokens) for t in ts] for ts in tr.translate_nbest(lines)] == \
        [[(t.text, t.tokens) for t in ts] for ts in want]  # the same arithmetic in the same order: exact
    assert _modes(model) == modes
    got_att = tr.attention(ids, want[0][0].tokens, want[0][0].eos)
    assert all(np.array_equal(got_att[k], want_att[k]) for k in ("encoder", "decoder_self", "cross"))
    assert _modes(model) == modes


def test_loading_and_translating_leave_torchs_global_state_alone(untrained_checkpoint):
    """A seeded program draws the same numbers whether or not it loads a translator on the way
    (building the model drew its initial weights, replaced by the checkpoint's, from the global RNG);
    the thread count and the gradient mode are the caller's too (docs/decoding.md)."""
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    threads = torch.get_num_threads()
    tr = Translator.from_checkpoint(untrained_checkpoint, CFG)
    tr.translate(copy_lines(2, seed=4))
    Translator.from_checkpoint(untrained_checkpoint, replace(CFG, sampling=True, nbest=2)).translate(["a b c"])
    assert torch.equal(torch.rand(4), want)
    assert torch.get_num_threads() == threads and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_lines_that_are_not_a_list_of_text_are_one_line_errors(untrained_checkpoint):
    tr = Translator.from_checkpoint(untrained_checkpoint, CFG)
    with pytest.raises(UserError, match=r"^lines: a list of lines \(str\), got NoneType$"):
        tr.translate(None)
    with pytest.raises(UserError, match=r"^lines: a list of lines \(str\), got int$"):
        tr.translate(3)
    with pytest.raises(UserError, match=r"^lines: a list of lines, not one string"):
        tr.translate(b"a b c")
    # bytes of UTF-8 are text, as SentencePiece reads them; other bytes would become <unk> pieces
    assert tr.translate([b"a b c"]) == tr.translate(["a b c"])
    with pytest.raises(UserError, match=r"^lines\[1\]: not UTF-8 \(byte 2: b'\\xff'\); give str, or bytes of UTF-8$"):
        tr.translate([b"a b", b"a \xff b"])


def test_settings_that_are_not_a_decode_config_are_one_line_errors(untrained_checkpoint):
    """Not an AttributeError from inside the constructor (a dict of settings, as other toolkits take)."""
    with pytest.raises(UserError, match=r"^cfg: a DecodeConfig \(aiayn.decode.config\), got dict; e.g. "):
        Translator.from_checkpoint(untrained_checkpoint, {"beam_size": 2})
    model, src_tok, tgt_tok = load_model_for_inference(untrained_checkpoint)
    with pytest.raises(UserError, match=r"^cfg: a DecodeConfig .* got NoneType"):
        Translator(model, src_tok, tgt_tok, None)


def test_a_step_with_other_rows_than_the_cache_is_a_one_line_error(untrained_checkpoint):
    """Tokens for 3 rows against a cache of 2 (the encoder output's): a UserError saying so, not a
    shape error from inside the cache's buffers; and after a reorder, the rows of its indices."""
    model, _, _ = load_model_for_inference(untrained_checkpoint)
    src = torch.tensor([[5, 6, 7, 3], [8, 9, 3, 0]])  # (B, S)
    with torch.no_grad():
        cache = init_cache(model, model.encode(src), max_len=8)
        with pytest.raises(UserError, match=r"^tokens: 3 rows for a cache of 2 \(the encoder output's rows, or"):
            model.decode(torch.full((3, 1), 2), cache=cache)
        cache = model.decode(torch.full((2, 1), 2), cache=cache).cache.reorder(torch.tensor([0, 0, 1]))
        assert model.decode(torch.full((3, 1), 5), cache=cache).logits.shape == (3, 1, model.cfg.vocab_size)
        with pytest.raises(UserError, match=r"^tokens: 2 rows for a cache of 3 "):
            model.decode(torch.full((2, 1), 5), cache=cache)
