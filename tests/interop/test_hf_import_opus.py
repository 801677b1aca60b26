"""aiayn import as OPUS-MT's models are used: weights saved in fp16 with their position tables, a
run of unknown characters read as MarianTokenizer reads it, <unk> written as transformers'
decode writes it, and the folder's generation settings as translate's defaults, so that `aiayn
translate` gives what `generate` gives (aiayn/interop/hf_import.py, aiayn/interop/marian_dir.py).

The folders are built here as in tests/interop/test_hf_import.py (SentencePiece models trained on 300
Multi30k lines per side, vocabularies numbered as OPUS-MT's, ``save_pretrained``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from aiayn.checkpoint import load_checkpoint
from aiayn.cli import build_parser, main
from aiayn.config import replace
from aiayn.data.vocab import Tokenizer
from aiayn.decode.config import TRANSLATE_DECODE
from aiayn.decode.loading import load_model_for_inference
from aiayn.decode.translator import Translator
from aiayn.errors import UserError

pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from aiayn.commands.decode_settings import decode_config  # noqa: E402
from aiayn.interop.hf_import import SENTENCEPIECE_UNK, ImportConfig, import_hf  # noqa: E402
from aiayn.interop.marian_dir import POSITION_KEYS  # noqa: E402
from tests.interop.test_hf_import import (imported, imported_order, marian_dir, marian_spm, opus_vocab,  # noqa: E402, F401
                                   read_lines)


def copy_of(marian_dir: Path, tmp_path: Path, name: str = "model") -> Path:
    d = tmp_path / name
    shutil.copytree(marian_dir, d)
    return d


# ---------------------------------------------------------------------------------------------
# fp16 weights and position tables


def test_fp16_position_tables_import_within_fp16_rounding(marian_dir, tmp_path):  # noqa: F811
    """Every weight in fp16, the sinusoidal tables too (as OPUS-MT's converted files hold them):
    the table's rounding to fp16 (up to 2^-12 near 1, beyond the 1e-4 a float32 table may differ
    by) is accepted; the model is the fp16 weights'; a table off by more than fp16's rounding is
    still refused."""
    from safetensors.torch import load_file, save_file
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding
    state = load_file(marian_dir / "model.safetensors")
    table = MarianSinusoidalPositionalEmbedding(128, 32).create_weight()
    half = {k: v.half() for k, v in {**state, **{k: table for k in POSITION_KEYS}}.items()}
    assert (half[POSITION_KEYS[0]].float() - table).abs().max() > 1e-4  # what the float32 check refused
    d16, d32 = copy_of(marian_dir, tmp_path, "fp16"), copy_of(marian_dir, tmp_path, "fp32")
    save_file(half, d16 / "model.safetensors", metadata={"format": "pt"})
    save_file({k: v.float() for k, v in half.items() if k not in POSITION_KEYS}, d32 / "model.safetensors",
              metadata={"format": "pt"})
    got, want = import_hf(d16), import_hf(d32)
    assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    off = half[POSITION_KEYS[1]].clone()
    off[100, 3] += 2e-3  # |x| <= 1: more than u |x| + 1e-4 = 5.9e-4
    save_file({**half, POSITION_KEYS[1]: off}, d16 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="model.decoder.embed_positions.weight is not Marian's sinusoidal table"):
        import_hf(d16)


# ---------------------------------------------------------------------------------------------
# Unknown characters and <unk>


def unknown_lines(marian_dir: Path) -> list[str]:
    """Lines with runs of characters the source SentencePiece model does not know: characters the
    (joint) vocabulary has from the target side, alone and in runs, and characters no file has."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto((marian_dir / "source.spm").read_bytes())
    known = {c for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_unknown(i))
             for c in sp.id_to_piece(i)}
    vocab = json.loads((marian_dir / "vocab.json").read_text(encoding="utf-8"))
    foreign = sorted(p for p in vocab if len(p) == 1 and p.isalpha() and p not in known)
    assert len(foreign) >= 2, foreign  # the German side's umlauts, ß
    a, b = foreign[:2]
    return [f"A man {a}{b} walks.", f"{a}", f"x {a} y {b}{b}{a} z", f"{a}\u4f60 dog", f"dog\u4f60\u597d{b}.",
            f"{a}{b}{a}{b}", f"the {a}nd"]


def test_unknown_runs_give_marian_tokenizers_ids(marian_dir, imported, tmp_path):  # noqa: F811
    """A run of characters the source model does not know is MarianTokenizer's one <unk> (or the
    vocabulary's piece of a lone character) by default; ``unknown_runs`` chars, the former
    reading, gives one piece per character the vocabulary has."""
    from transformers import MarianTokenizer
    tok = MarianTokenizer.from_pretrained(marian_dir)
    _, src, _ = load_model_for_inference(imported)
    order, lines = imported_order(marian_dir), unknown_lines(marian_dir)
    for line in lines:
        assert [order[i] for i in src.encode(line)] + [0] == tok(line)["input_ids"], line
    assert [[order[i] for i in ids] + [0] for ids in src.encode_batch(lines)] == tok(lines)["input_ids"]
    chars = Tokenizer(import_hf(marian_dir, ImportConfig(unknown_runs="chars"))["tokenizers"]["src"])
    assert [order[i] for i in chars.encode(lines[0])] + [0] != tok(lines[0])["input_ids"]


def test_unk_is_written_as_transformers_decode_writes_it(marian_dir, imported):  # noqa: F811
    """<unk> anywhere in a translation: nothing, as ``decode(skip_special_tokens=True)``, by
    default; ``unk_output`` gives another text (SentencePiece's own " ⁇ ")."""
    from transformers import MarianTokenizer
    tok = MarianTokenizer.from_pretrained(marian_dir)
    _, _, tgt = load_model_for_inference(imported)
    aiayn_id = {m: a for a, m in reversed(list(enumerate(imported_order(marian_dir))))}
    marked = Tokenizer(import_hf(marian_dir, ImportConfig(unk_output=" <?> "))["tokenizers"]["tgt"])
    spm_unk = Tokenizer(import_hf(marian_dir, ImportConfig(unk_output=SENTENCEPIECE_UNK))["tokenizers"]["tgt"])
    for line in ("Ein Hund läuft.", "Zwei Männer."):
        ids = tok(text_target=line)["input_ids"][:-1]
        for k in range(len(ids) + 1):
            with_unk = ids[:k] + [1] + ids[k:]
            ours = [aiayn_id[i] for i in with_unk]
            assert tgt.decode(ours) == tok.decode(with_unk, skip_special_tokens=True), with_unk
            assert "<?>" in marked.decode(ours) and "\u2047" in spm_unk.decode(ours)


# ---------------------------------------------------------------------------------------------
# Generation settings


def test_generation_settings_are_translates_defaults_and_flags_override_them(imported, caplog):  # noqa: F811
    """generation_config.json (num_beams 4, max_length 128, OPUS-MT's forced EOS; transformers'
    length_penalty 1.0) is stored as DecodeConfig fields; translate takes them unless a flag
    gives one, and says which it took."""
    stored = load_checkpoint(imported)["decode"]
    assert stored == {"beam_size": 4, "alpha": 1.0, "length_norm": "power", "max_len_a": 0.0,
                      "max_len_b": 126, "min_len": 0, "no_repeat_ngram": 0}  # 128 less the start and the forced EOS
    parse = build_parser().parse_args
    with caplog.at_level("INFO", logger="aiayn.commands.decode_settings"):
        cfg = _cfg(parse(["translate", "--checkpoint", str(imported)]))
    assert cfg == replace(TRANSLATE_DECODE, **stored)
    assert "decoding with its model's settings beam_size 4, alpha 1.0, length_norm power" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="aiayn.commands.decode_settings"):
        cfg = _cfg(parse(["translate", "--checkpoint", str(imported), "--beam-size", "4", "--alpha", "0.6",
                                    "--length-norm", "gnmt"]))
    assert cfg == replace(TRANSLATE_DECODE, **{**stored, "alpha": 0.6, "length_norm": "gnmt"})
    assert "settings beam_size" not in caplog.text and "max_len_b 126" in caplog.text
    two = _cfg(parse(["translate", "--checkpoint", str(imported), str(imported)]))
    assert two == replace(TRANSLATE_DECODE, **stored)  # an ensemble of members that carry the same: theirs


def _cfg(args):
    return decode_config(args, args.checkpoint)


def test_a_checkpoint_without_generation_settings_decodes_with_translates_defaults(tiny_checkpoint):
    assert "decode" not in load_checkpoint(tiny_checkpoint)
    assert _cfg(build_parser().parse_args(["translate", "--checkpoint", str(tiny_checkpoint)])) \
        == TRANSLATE_DECODE


# ---------------------------------------------------------------------------------------------
# An OPUS-MT-shaped folder: aiayn translate gives what generate gives


@pytest.fixture(scope="module")
def opus_dir(shared_data, tmp_path_factory) -> Path:
    """As OPUS-MT ships a model with separate vocabularies: source.spm + vocab.json with target-language
    tags, target.spm + target_vocab.json (both </s> 0, <unk> 1, <pad> last, equal sizes as transformers
    wants one pad id), random weights saved in fp16 (swish, 2 + 2 layers, d_model 32, the final-logits
    bias raising EOS and sinking <pad>, which trained models never predict), and OPUS-MT's
    generation_config.json: 4 beams, max_length, <pad> banned, renormalized, forced EOS."""
    from transformers import GenerationConfig, MarianConfig, MarianMTModel, MarianTokenizer
    out = tmp_path_factory.mktemp("opus")
    en, de = read_lines(shared_data, "train.en.gz", 300), read_lines(shared_data, "train.de.gz", 300)
    src_spm, tgt_spm = marian_spm(en, 120), marian_spm(de, 120)
    tags = (">>deu<<", ">>nld<<")
    sizes = len(opus_vocab(src_spm, extra=tags)), len(opus_vocab(tgt_spm))
    n = max(sizes)  # the smaller one filled up with pieces no text has
    src_vocab = opus_vocab(src_spm, extra=tags + tuple(f"<x{i}>" for i in range(n - sizes[0])))
    tgt_vocab = opus_vocab(tgt_spm, extra=tuple(f"<x{i}>" for i in range(n - sizes[1])))
    assert len(src_vocab) == len(tgt_vocab) == n and src_vocab != tgt_vocab
    for name, data in (("source.spm", src_spm), ("target.spm", tgt_spm)):
        (out / name).write_bytes(data)
    for name, vocab in (("vocab.json", src_vocab), ("target_vocab.json", tgt_vocab)):
        (out / name).write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json"),
                    target_vocab_file=str(out / "target_vocab.json"), separate_vocabs=True, source_lang="en",
                    target_lang="de").save_pretrained(out)
    pad = n - 1
    cfg = MarianConfig(vocab_size=n, decoder_vocab_size=n, d_model=32, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                       activation_function="swish", scale_embedding=True, pad_token_id=pad,
                       decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
                       share_encoder_decoder_embeddings=False, max_position_embeddings=256, init_std=0.2)
    torch.manual_seed(3)
    model = MarianMTModel(cfg).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 1.0)
        model.final_logits_bias[0, 0] += 4.0
        model.final_logits_bias[0, pad] = -30.0
    model.generation_config = GenerationConfig(
        bad_words_ids=[[pad]], bos_token_id=0, decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
        max_length=40, num_beams=4, pad_token_id=pad, renormalize_logits=True)
    model.half().save_pretrained(out)
    return out


@pytest.mark.slow
def test_opus_folder_translates_as_generate_with_its_own_settings(shared_data, opus_dir, tmp_path, capsys):
    """`aiayn import` then `aiayn translate` with no decoding flag: the texts of transformers'
    ``generate`` with no argument (the folder's generation_config.json), the model in float32 from
    the same fp16 weights. Some lines end by EOS, some at the maximum length (forced EOS there)."""
    from transformers import MarianMTModel, MarianTokenizer
    from safetensors.torch import load_file
    assert {v.dtype for v in load_file(opus_dir / "model.safetensors").values()} == {torch.float16}
    lines = [">>deu<< " + line for line in read_lines(shared_data, "test_2016_flickr.en.gz", 12)]
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    path = tmp_path / "opus.pt"
    assert main(["import", str(opus_dir), "--out", str(path)]) == 0
    capsys.readouterr()
    assert main(["translate", "--checkpoint", str(path), "--input", str(tmp_path / "in.en")]) == 0
    ours = capsys.readouterr().out.splitlines()
    hf = MarianMTModel.from_pretrained(opus_dir, dtype=torch.float32).eval()
    tok = MarianTokenizer.from_pretrained(opus_dir)
    with torch.no_grad():
        gen = hf.generate(**tok(lines, return_tensors="pt", padding=True))
    assert ours == tok.batch_decode(gen, skip_special_tokens=True)
    pad = hf.config.pad_token_id
    lengths = ((gen != pad) & (gen != 0)).sum(dim=1).tolist()  # content tokens
    assert 0 < sum(n == 38 for n in lengths) < len(lines)  # 40 less the start and the forced EOS
    with Translator.from_checkpoint(path, TRANSLATE_DECODE) as tr:  # aiayn's defaults: other translations
        assert tr.translate(lines) != ours


def test_evaluate_decodes_with_the_models_settings_too(imported, tmp_path, caplog):
    """aiayn evaluate reads the same settings as translate: the model's, unless a flag gives one."""
    from aiayn.cli import main

    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("a b c\n", encoding="utf-8")
    ref.write_text("a b c\n", encoding="utf-8")
    with caplog.at_level("INFO", logger="aiayn.commands.decode_settings"):
        assert main(["evaluate", "--checkpoint", str(imported), "--src", str(src), "--ref", str(ref)]) == 0
    assert "decoding with its model's settings beam_size 4, alpha 1.0, length_norm power" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="aiayn.commands.decode_settings"):
        assert main(["evaluate", "--checkpoint", str(imported), "--src", str(src), "--ref", str(ref),
                     "--beam-size", "2"]) == 0
    assert "settings beam_size" not in caplog.text and "alpha 1.0" in caplog.text


def test_serve_decodes_with_the_models_settings_too(imported, monkeypatch):
    """aiayn serve's request defaults are the model's settings where no flag gives one."""
    from aiayn.cli import main
    from aiayn.serve import app as app_mod

    seen = []

    class Stop(Exception):
        pass

    def create_app(translator, cfg):
        seen.append(translator.cfg)
        raise Stop

    monkeypatch.setattr(app_mod, "create_app", create_app)
    stored = load_checkpoint(imported)["decode"]
    for flags, expect in (([], stored), (["--beam-size", "2"], {**stored, "beam_size": 2})):
        with pytest.raises(Stop):
            main(["serve", "--checkpoint", str(imported), *flags])
        assert {k: getattr(seen[-1], k) for k in stored} == expect
