"""aiayn export --format hf: a Hugging Face MarianMTModel that computes and translates as aiayn (aiayn/interop/hf_export.py)."""
from __future__ import annotations

import pytest
import torch

import aiayn
from aiayn.cli import main
from aiayn.decode.config import DecodeConfig
from aiayn.decode.translator import Translator
from aiayn.errors import UserError
from tests.arith import U32, gamma, within
from tests.conftest import copy_lines
from tests.rounding import two_implementations_bound

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from aiayn.interop.hf_export import marian_model, model_permutation  # noqa: E402

SENTENCES = ["a b c d e f g h", "l k j i", "a a b b c c", "h", "",
             "l k j i h g f e d c b a l k",  # longer than any training sentence: the model errs
             "g g g g g g g g g g g"]


def test_permutation_turns_interleaved_sinusoids_into_marians():
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding
    from aiayn.model.positional import sinusoidal_table
    for D in (8, 64):
        marian = MarianSinusoidalPositionalEmbedding(50, D).create_weight()
        ours = sinusoidal_table(50, D)[:, model_permutation(D)]
        # both float64 sines and cosines of angles below 50 (each angle a few roundings off: |δ| <= γ_4 50,
        # sin and cos within 1 ulp), rounded to float32 (u |value|) where the table is float32
        u64 = 2.0 ** -53
        bound = float(gamma(4, u64)) * 50 * 2 + 4 * u64 + U32 * (ours.double().abs() + marian.double().abs())
        within(ours, marian.double(), bound)
    assert model_permutation(6).tolist() == [0, 2, 4, 1, 3, 5]


@pytest.mark.parametrize("over", [{}, {"tie_src_tgt_embeddings": False, "tgt_vocab_size": 37},
                                  {"scale_embeddings": False, "n_dec_layers": 1},
                                  {"tie_embeddings": False, "output_bias": True}, {"attn_bias": True}])
def test_marian_logits_equal_aiayns(over):
    """The same function, but for LayerNorm's epsilon (Marian's fixed 1e-5, the model's 1e-6: set to
    the model's here), within the two float32 computations' roundings. Without ``attn_bias`` (§3.2.2)
    Marian's attention biases are zeros."""
    torch.manual_seed(0)
    m = aiayn.Transformer(aiayn.get_preset("tiny", vocab_size=40, **over)).eval()
    with torch.no_grad():
        if m.out_bias is not None:
            m.out_bias.normal_()
        for name, p in m.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_()
    hf = marian_model(m)
    for mod in hf.modules():
        if isinstance(mod, torch.nn.LayerNorm):
            mod.eps = m.cfg.layer_norm_eps
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 11, 3, 0]])
    tgt = torch.tensor([[2, 5, 6, 7], [2, 9, 10, 11]])
    with torch.no_grad():
        want = m(src, tgt)
        got = hf(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt).logits
    within(got, want.double(), two_implementations_bound(m, src, tgt))


@pytest.mark.parametrize("over, reason", [
    ({"pre_norm": True}, "pre-norm"), ({"d_k": 8}, "d_k = d_v = d_model / h"),
    ({"learned_positions": True}, "sinusoidal positions only")])
def test_configurations_marian_cannot_express_are_refused(over, reason):
    m = aiayn.Transformer(aiayn.get_preset("tiny", vocab_size=40, **over))
    with pytest.raises(UserError, match=reason):
        marian_model(m)


@pytest.mark.slow
def test_exported_model_translates_as_aiayn(copy_checkpoint, tmp_path):
    from transformers import MarianMTModel, MarianTokenizer
    out = tmp_path / "hf"
    assert main(["export", "--format", "hf", "--checkpoint", str(copy_checkpoint), "--out", str(out)]) == 0
    hf = MarianMTModel.from_pretrained(out).eval()
    tok = MarianTokenizer.from_pretrained(out)
    lines = [s for s in SENTENCES if s]
    batch = tok(lines, return_tensors="pt", padding=True)
    N = 40  # at most N tokens both ways, so that a line the model errs on ends alike
    for beam in (1, 4):
        decode = DecodeConfig(beam_size=beam, alpha=0.0, max_len_a=0.0, max_len_b=N)
        with Translator.from_checkpoint(copy_checkpoint, decode) as tr:
            want = tr.translate(SENTENCES)
            want_ids = [list(t[0].tokens) for t in tr.translate_nbest(lines)]
        with torch.no_grad():
            gen = hf.generate(**batch, num_beams=beam, length_penalty=0.0, do_sample=False, max_new_tokens=N,
                              forced_eos_token_id=None)
        got = tok.batch_decode(gen, skip_special_tokens=True)
        assert got == [w for w in want if w], beam
        got_ids = [[t for t in row.tolist() if t not in (0, 2, 3)] for row in gen]
        assert got_ids == want_ids, beam
    # and the outputs compared are a model's that copies: most unseen sentences of its task (35 to 40 of
    # 40 after these 300 steps, trained in AVX-512, AVX2 or SSE4 arithmetic; which of the lines above
    # it copies moves with the last bits of that arithmetic)
    unseen = copy_lines(12, seed=11)
    with Translator.from_checkpoint(copy_checkpoint, decode) as tr:
        assert sum(t == s for t, s in zip(tr.translate(unseen), unseen)) >= len(unseen) // 2


@pytest.mark.parametrize("n", [2, 3])
def test_no_repeat_ngram_greedy_is_transformers(n):
    """Greedy search with no_repeat_ngram n: token for token generate's no_repeat_ngram_size n, on a
    random tiny model that repeats itself (both with pad and BOS suppressed, as the search never
    generates them; at most N tokens, no forced EOS)."""
    from aiayn.decode.adapter import CachedDecoder
    from aiayn.decode.search import SpecialIds, search
    from aiayn.interop.hf_export import MARIAN_LAYER_NORM_EPS
    torch.manual_seed(1)
    m = aiayn.Transformer(aiayn.get_preset("tiny", vocab_size=40, layer_norm_eps=MARIAN_LAYER_NORM_EPS)).eval()
    hf, cfg = marian_model(m), m.cfg
    src = torch.tensor([[5, 6, 7, 8, 9, 10, 3], [9, 10, 11, 3, 0, 0, 0], [12, 13, 3, 0, 0, 0, 0]])
    N, ids = 24, SpecialIds(pad=cfg.pad_id, bos=cfg.bos_id, eos=cfg.eos_id)
    outputs = {}
    for size in (0, n):
        decode = DecodeConfig(beam_size=1, alpha=0.0, max_len_a=0.0, max_len_b=N, no_repeat_ngram=size)
        ours = [hs[0].tokens for hs in search(CachedDecoder(m), src, decode, ids)]
        with torch.no_grad():
            gen = hf.generate(input_ids=src, attention_mask=(src != cfg.pad_id).long(), num_beams=1, do_sample=False,
                              max_new_tokens=N, no_repeat_ngram_size=size, suppress_tokens=[cfg.pad_id, cfg.bos_id],
                              forced_eos_token_id=None, min_length=0)
        rows = [row[1:].tolist() for row in gen]  # without the decoder's start token
        theirs = [tuple(r[: r.index(cfg.eos_id)] if cfg.eos_id in r else r) for r in rows]
        assert ours == theirs, size
        outputs[size] = ours
    grams = [[o[i:i + n] for i in range(len(o) - n + 1)] for o in outputs[0]]
    assert any(len(g) != len(set(g)) for g in grams)  # without the ban the model repeats itself
    assert outputs[n] != outputs[0]
