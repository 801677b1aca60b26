"""Reduced-precision decoding: a bf16 copy of the model, fp32 log-probabilities, same API."""
from __future__ import annotations

import pytest
import torch

import aiayn
from aiayn.decode.adapter import CachedDecoder
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import SpecialIds, search
from aiayn.decode.loading import load_model_for_inference
from aiayn.decode.translator import Translator
from aiayn.errors import UserError
from tests.rounding import assert_normalized, score_bound, step_bound


def test_bf16_translator_casts_a_copy_and_translates(tiny_checkpoint):
    """The Translator's bf16 path: a bfloat16 copy, the caller's model untouched, every line translated
    (its searches against float32's: ``test_reduced_precision_beam_search_finds_fp32s_best_hypotheses``)."""
    model, src_tok, tgt_tok = load_model_for_inference(tiny_checkpoint)
    bf16 = Translator(model, src_tok, tgt_tok, DecodeConfig(beam_size=2, precision="bf16"))
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is untouched
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    lines = ["A dog runs.", "", "Two men are sitting on a bench in the park."]
    out16 = bf16.translate(lines)
    assert len(out16) == 3 and out16[1] == ""


SRC = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])


def _first_steps(dtype: torch.dtype):
    """A tiny model's first decoding step in float32 and in ``dtype`` (a copy of the same weights):
    both decoders and both steps' log-probabilities."""
    cfg = aiayn.get_preset("tiny", vocab_size=50, p_drop=0.0)
    model = aiayn.Transformer(cfg).eval()
    model16 = aiayn.Transformer(cfg).eval()
    model16.load_state_dict(model.state_dict())
    d32, d16 = CachedDecoder(model), CachedDecoder(model16.to(dtype))
    with torch.inference_mode():
        lp32, _ = d32.step(torch.tensor([2, 2]), d32.start(SRC, 4))
        lp16, _ = d16.step(torch.tensor([2, 2]), d16.start(SRC, 4))
    return d32, d16, lp32, lp16


def test_bf16_step_log_probs_close_to_fp32():
    """The first step's log-probabilities of a bfloat16 copy against float32's, each within the bound of
    bfloat16's roundings along its path (``step_bound``: unit roundoff 2^-8 at every parameter and
    every result, carried to that log-probability by its derivatives, tests/rounding.py)."""
    d32, _, lp32, lp16 = _first_steps(torch.bfloat16)
    assert lp16.dtype == torch.float32
    assert_normalized(lp16, d32.model, "bf16", SRC)
    assert ((lp16 - lp32).abs().double() <= step_bound(d32.model, "bf16", SRC)).all()  # bf16 roundings, derived


def test_bf16_search_runs_with_fixed_length():
    cfg = aiayn.get_preset("tiny", vocab_size=50, p_drop=0.0)
    model = aiayn.Transformer(cfg).eval().to(torch.bfloat16)
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    dc = DecodeConfig(beam_size=3, min_len=6, max_len_a=0.0, max_len_b=6)
    with torch.inference_mode():
        hyps = search(CachedDecoder(model), src, dc, SpecialIds(pad=0, bos=2, eos=3))
    assert [len(h[0].tokens) for h in hyps] == [6, 6]


@pytest.mark.parametrize("precision", ["bf16", "fp16", "int8", "int8-bf16"])
def test_reduced_precision_beam_search_finds_fp32s_best_hypotheses(confident_model, monkeypatch, int8_anywhere,
                                                                   precision):
    """Beam search (K = 4, α = 0.6, §6.1) through the Translator's decoder (the C kernels where they
    build) in each reduced precision against float32's, on a model whose every decision leads by
    CONFIDENT_MARGIN (``confident_model``): the same best hypothesis for every sentence, on CPUs with
    bf16 and VNNI instructions and without, and its score within the bound of the precision's roundings
    along its path (``score_bound``: unit roundoff 2^-8 for bfloat16 and 2^-11 for float16 at every
    parameter and result, steps s_x / 2 and s_W / 2 at int8's, carried to the score by its
    derivatives; tests/rounding.py). fp16 runs with its CUDA check lifted (as in
    ``test_fp16_translator_casts_a_copy_and_translates``), int8 with its speed rule lifted (``int8_anywhere``)."""
    from aiayn.decode import loading
    monkeypatch.setattr(loading, "require_cuda_for_fp16", lambda model: None)
    model, src = confident_model
    out = {}
    for p in ("fp32", precision):
        tr = Translator(model, None, None, DecodeConfig(beam_size=4, precision=p))
        with torch.inference_mode():
            out[p] = search(tr.decoder, src, tr.cfg, tr.ids)
    for b, (hyps, ref) in enumerate(zip(out[precision], out["fp32"])):
        assert hyps[0].tokens == ref[0].tokens
        # the precision's roundings along the path, derived (score_bound)
        assert abs(hyps[0].score - ref[0].score) <= score_bound(model, precision, src[b], ref[0], tr.cfg, tr.ids)


@pytest.mark.parametrize("precision", ["bf16", "int8", "int8-bf16"])
def test_a_decoding_copy_is_not_copied_again(tiny_checkpoint, precision, int8_anywhere):
    """The service hands its Translator's decoding copies to a Translator per request batch: they are
    used as they are, not cast or quantized again on every batch."""
    from aiayn.decode.loading import model_for_precision

    model, src_tok, tgt_tok = load_model_for_inference(tiny_checkpoint)
    first = Translator(model, src_tok, tgt_tok, DecodeConfig(beam_size=2, precision=precision))
    again = Translator(first.models, src_tok, tgt_tok, DecodeConfig(beam_size=2, precision=precision))
    assert again.models[0] is first.models[0] is model_for_precision(first.models[0], precision)
    assert first.models[0] is not model  # the caller's model was copied once
    lines = ["A dog runs.", "Two men are sitting on a bench in the park."]
    assert again.translate(lines) == first.translate(lines)


def test_bf16_padded_rows_translate_the_same(tiny_checkpoint):
    """The bf16 copy pads its linear maps' rows (``cpu_row_bits``, aiayn/execution/linear.py); with the
    padding off the same batches give the same hypotheses and the same scores."""
    from aiayn.execution.linear import RowPaddedLinear as Linear
    model, src_tok, tgt_tok = load_model_for_inference(tiny_checkpoint)
    lines = [f"A dog number {i} runs in the park with {i % 7} men." for i in range(40)] + ["Two men sit."]
    results = {}
    for bits in (6, 0):
        tr = Translator(model, src_tok, tgt_tok, DecodeConfig(beam_size=3, nbest=2, precision="bf16", cpu_row_bits=bits))
        assert {m.row_bits for m in tr.model.modules() if isinstance(m, Linear)} == {bits}
        results[bits] = tr.translate_nbest(lines)
    assert results[6] == results[0]


def test_cpu_row_bits_outside_its_range_is_refused(tiny_checkpoint, capsys):
    """cpu_row_bits is 0 (off) or the leading bits kept: a negative value was read as off, silently;
    it is refused, in the translator's settings and in training's, and by the command in one line."""
    from aiayn.cli import main
    from aiayn.config import ConfigError
    from aiayn.train.config import TrainConfig
    for bad in (-1, 63):
        with pytest.raises(ConfigError, match=r"cpu_row_bits must be in \[0, 62\]"):
            DecodeConfig(cpu_row_bits=bad)
        with pytest.raises(ConfigError, match=r"cpu_row_bits must be in \[0, 62\]"):
            TrainConfig(cpu_row_bits=bad)
    assert DecodeConfig(cpu_row_bits=0).cpu_row_bits == 0 and DecodeConfig(cpu_row_bits=62).cpu_row_bits == 62
    assert main(["translate", "--checkpoint", str(tiny_checkpoint), "--precision", "bf16", "--cpu-row-bits", "-1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--cpu-row-bits must be in [0, 62] (0 = off), got -1" in captured.err


def test_fp16_step_log_probs_close_to_fp32():
    """float16 (CUDA, for GPUs without native bf16) decodes through the same code as bf16, with 11
    significand bits where bfloat16 has 8: the first step's log-probabilities, and the scores of
    searches of 6 steps, within the bounds of float16's roundings along their paths (unit roundoff
    2^-11 and subnormals' 2^-25: ``step_bound``, ``score_bound``)."""
    d32, d16, lp32, lp16 = _first_steps(torch.float16)
    dc = DecodeConfig(beam_size=3, min_len=6, max_len_a=0.0, max_len_b=6)
    ids = SpecialIds(pad=0, bos=2, eos=3)
    with torch.inference_mode():
        hyps16, hyps32 = search(d16, SRC, dc, ids), search(d32, SRC, dc, ids)
    assert lp16.dtype == torch.float32
    assert_normalized(lp16, d32.model, "fp16", SRC)
    assert ((lp16 - lp32).abs().double() <= step_bound(d32.model, "fp16", SRC)).all()  # fp16 roundings, derived
    assert [len(h[0].tokens) for h in hyps16] == [6, 6]
    for b, (h16, h32) in enumerate(zip(hyps16, hyps32)):  # a score: 6 steps' log-probabilities over lp(6)
        assert h16[0].tokens == h32[0].tokens
        assert abs(h16[0].score - h32[0].score) <= score_bound(d32.model, "fp16", SRC[b], h32[0], dc, ids)


def test_fp16_is_refused_off_cuda(tiny_checkpoint):
    model, src_tok, tgt_tok = load_model_for_inference(tiny_checkpoint)
    with pytest.raises(UserError, match="precision fp16 runs on CUDA .* not on cpu; on a CPU use bf16"):
        Translator(model, src_tok, tgt_tok, DecodeConfig(precision="fp16"))


def test_fp16_translator_casts_a_copy_and_translates(tiny_checkpoint, monkeypatch):
    """The Translator's fp16 path on the CPU with the CUDA check lifted: a float16 copy, the caller's
    model untouched, every line translated, the copy not copied again (the numbers: the test above)."""
    from aiayn.decode import loading
    from aiayn.decode.loading import model_for_precision
    monkeypatch.setattr(loading, "require_cuda_for_fp16", lambda model: None)
    model, src_tok, tgt_tok = load_model_for_inference(tiny_checkpoint)
    fp16 = Translator(model, src_tok, tgt_tok, DecodeConfig(beam_size=2, precision="fp16"))
    lines = ["A dog runs.", "", "Two men are sitting on a bench in the park."]
    out = fp16.translate(lines)
    assert len(out) == 3 and out[1] == "" and out[0] and out[2]
    assert next(model.parameters()).dtype == torch.float32
    assert next(fp16.model.parameters()).dtype == torch.float16
    assert model_for_precision(fp16.models[0], "fp16") is fp16.models[0]
