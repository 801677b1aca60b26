"""``aiayn export``: CTranslate2 running the exported weights gives aiayn's translations."""
from __future__ import annotations

import pytest
import torch

import aiayn.model as M
from aiayn.decode.adapter import CachedDecoder
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import SpecialIds, search
from aiayn.interop.ct2_export import export_ct2

ctranslate2 = pytest.importorskip("ctranslate2")  # installed with aiayn[ct2]; .ci/run installs it

V = 40
TOKENS = ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(4, V)]


def _model(pre_norm: bool, learned: bool, attn_bias: bool = False) -> M.Transformer:
    torch.manual_seed(4)  # (3 drew a close call of two beams in pre-norm, where the two searches differ)
    cfg = M.ModelConfig(vocab_size=V, n_layers=2, n_dec_layers=3, d_model=32, d_ff=48, n_heads=4, d_k=8, d_v=8,
                        p_drop=0.0, pre_norm=pre_norm, learned_positions=learned, max_positions=64,
                        attn_bias=attn_bias)
    model = M.Transformer(cfg).eval()
    with torch.no_grad():  # peaky output distributions: no near-ties between the two runtimes
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(2.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)  # LayerNorm biases are exported too: not all zero
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.1)  # as the attention biases (attn_bias): without them, zeros are written
        model.tgt_embed.weight[3] *= 3.0  # EOS likelier, so that some outputs end before the limit
    return model


def _sources() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, V, (n,), generator=g).tolist() + [3] for n in (5, 9, 2, 12)]


@pytest.mark.parametrize("pre_norm,learned,attn_bias", [(True, False, False), (False, False, False),
                                                       (False, True, False), (False, False, True)])
@pytest.mark.parametrize("beam", [1, 4])
def test_ctranslate2_translates_like_aiayn(tmp_path, pre_norm, learned, attn_bias, beam):
    model = _model(pre_norm, learned, attn_bias)
    out = export_ct2(model, TOKENS, TOKENS, tmp_path / "ct2")
    srcs = _sources()
    L = 15
    cfg = DecodeConfig(beam_size=beam, alpha=0.0, max_len_a=0.0, max_len_b=L)
    ours = []
    for s in srcs:  # one sentence per call: no padding on either side
        hyp = search(CachedDecoder(model), torch.tensor([s]), cfg, SpecialIds())[0][0]
        ours.append([TOKENS[t] for t in hyp.tokens])
    tr = ctranslate2.Translator(str(out), device="cpu", inter_threads=1, intra_threads=1)
    # aiayn's search never emits <pad> or <s> and allows an empty output; CTranslate2's does not
    # ban them and defaults to at least one token
    res = tr.translate_batch([[TOKENS[t] for t in s] for s in srcs], beam_size=beam, length_penalty=0.0,
                             max_decoding_length=L, min_decoding_length=0, suppress_sequences=[["<pad>"], ["<s>"]])
    theirs = [r.hypotheses[0] for r in res]
    assert theirs == ours


def test_cli_export_of_a_real_checkpoint(tiny_checkpoint, tmp_path, capsys):
    """The exported directory carries the tokenizers; CTranslate2 on SentencePiece pieces gives
    the same text as aiayn's Translator (greedy)."""
    import sentencepiece as spm

    from aiayn.cli import main
    from aiayn.decode.translator import Translator

    out = tmp_path / "ct2"
    assert main(["export", "--checkpoint", str(tiny_checkpoint), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"ctranslate2 model: {out}"
    lines = ["A man rides a bike.", "Two dogs play in the snow near a house.", "x"]
    ours = Translator.from_checkpoint(tiny_checkpoint, cfg=DecodeConfig(beam_size=1, alpha=0.0)).translate(lines)
    sp_src = spm.SentencePieceProcessor(model_file=str(out / "source.spm"))
    sp_tgt = spm.SentencePieceProcessor(model_file=str(out / "target.spm"))
    tr = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    theirs = []
    for x in lines:  # aiayn's length limit |x| + 50 counts the source's EOS
        pieces = sp_src.encode(x, out_type=str) + ["</s>"]
        r = tr.translate_batch([pieces], beam_size=1, max_decoding_length=len(pieces) + 50,
                               min_decoding_length=0, suppress_sequences=[["<pad>"], ["<s>"]])[0]
        theirs.append(sp_tgt.decode(r.hypotheses[0]))
    assert theirs == ours
    assert main(["export", "--checkpoint", str(tmp_path / "missing.pt"), "--out", str(out)]) == 2


def test_the_weight_types_are_ctranslate2s_and_a_bad_one_is_an_option_error(capsys):
    """--quantization offers exactly the types ctranslate2's converter accepts, checked before any work."""
    from ctranslate2.specs.model_spec import ACCEPTED_MODEL_TYPES

    from aiayn.cli import main
    from aiayn.commands.export import CT2_QUANTIZATIONS
    assert set(CT2_QUANTIZATIONS) == set(ACCEPTED_MODEL_TYPES)
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--checkpoint", "m.pt", "--out", "x", "--quantization", "int4"])
    assert exit_.value.code == 2
    assert "aiayn export: error: argument --quantization: invalid choice: 'int4'" in capsys.readouterr().err
