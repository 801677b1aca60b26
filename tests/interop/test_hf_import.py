"""aiayn import --format hf: a MarianMTModel directory as OPUS-MT ships one becomes an aiayn
checkpoint that computes and translates as transformers does (aiayn/interop/hf_import.py, aiayn/interop/marian_vocab.py).

The directories are built here, without a network: SentencePiece models trained on a few hundred
Multi30k lines, one per side as OPUS-MT's (<unk> 0, <s> 1, </s> 2, no <pad>), a joint vocab.json
numbered as OPUS-MT numbers it (</s> 0, <unk> 1, the pieces, <pad> last), and a MarianMTModel
saved with ``save_pretrained``.
"""
from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest
import torch

import aiayn
from aiayn.cli import main
from aiayn.checkpoint import load_checkpoint
from aiayn.config import replace
from aiayn.decode.config import TRANSLATE_DECODE, DecodeConfig
from aiayn.decode.loading import load_model_for_inference
from aiayn.decode.translator import Translator
from aiayn.data.vocab import Tokenizer, joint_vocabulary
from aiayn.errors import UserError

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from aiayn.interop.hf_export import export_hf, marian_config, marian_state_dict  # noqa: E402
from aiayn.interop.hf_import import SENTENCEPIECE_UNK, ImportConfig, import_hf  # noqa: E402
from aiayn.interop.marian_vocab import Specials, aiayn_pieces, id_order, segmenter  # noqa: E402
from tests.arith import within  # noqa: E402
from tests.conftest import copy_lines  # noqa: E402
from tests.rounding import two_implementations_bound  # noqa: E402


def read_lines(shared_data: Path, name: str, n: int) -> list[str]:
    with gzip.open(shared_data / "multi30k" / "raw" / name, "rt", encoding="utf-8") as f:
        return [next(f).strip() for _ in range(n)]


def marian_spm(lines: list[str], vocab_size: int, model_type: str = "unigram") -> bytes:
    """A SentencePiece model with SentencePiece's own special ids, as Marian's (<unk> 0, <s> 1, </s> 2)."""
    import sentencepiece as spm
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
                                   model_type=model_type, character_coverage=1.0, minloglevel=2)
    return buf.getvalue()


def opus_vocab(*models: bytes, extra: tuple[str, ...] = ()) -> dict[str, int]:
    """vocab.json as OPUS-MT's: </s> 0, <unk> 1, every piece of the models once, ``extra``, <pad> last."""
    import sentencepiece as spm
    vocab = {"</s>": 0, "<unk>": 1}
    for m in models:
        sp = spm.SentencePieceProcessor()
        sp.LoadFromSerializedProto(m)
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    for p in extra:
        vocab.setdefault(p, len(vocab))
    vocab["<pad>"] = len(vocab)
    return vocab


def write_tokenizer(out: Path, src_spm: bytes, tgt_spm: bytes, vocab: dict[str, int]):
    from transformers import MarianTokenizer
    out.mkdir(parents=True, exist_ok=True)
    (out / "source.spm").write_bytes(src_spm)
    (out / "target.spm").write_bytes(tgt_spm)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tok = MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json"),
                          source_lang="en", target_lang="de")
    tok.save_pretrained(out)
    return tok


def save_marian(model, out: Path, pad: int) -> None:
    from transformers import GenerationConfig
    model.generation_config = GenerationConfig(  # OPUS-MT's settings
        decoder_start_token_id=pad, eos_token_id=0, pad_token_id=pad, forced_eos_token_id=0,
        bad_words_ids=[[pad]], num_beams=4, max_length=128)
    model.save_pretrained(out)


def hf_outputs(gen: torch.Tensor, eos: int, pad: int) -> list[list[int]]:
    """generate's rows without the start token, cut at EOS (the ids aiayn's Translation.tokens hold)."""
    out = []
    for row in gen.tolist():
        row = row[1:]
        row = row[: row.index(eos)] if eos in row else row
        out.append([t for t in row if t != pad])
    return out


# ---------------------------------------------------------------------------------------------
# Tokenization


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_segmenters_give_marian_tokenizers_ids(shared_data, tmp_path, model_type):
    """Source and target lines encode to MarianTokenizer's ids (through the id order), target ids
    decode to its text (where they hold no <unk>); a target-language token opening a source line
    is one token, as there."""
    en, de = read_lines(shared_data, "train.en.gz", 300), read_lines(shared_data, "train.de.gz", 300)
    src_spm, tgt_spm = marian_spm(en, 120, model_type), marian_spm(de, 120, model_type)
    vocab = opus_vocab(src_spm, tgt_spm, extra=(">>fra<<", ">>deu<<"))
    tok = write_tokenizer(tmp_path, src_spm, tgt_spm, vocab)
    V = len(vocab)
    order = id_order(vocab, Specials(pad=V - 1, unk=1, start=V - 1, eos=0), V, "vocab.json")
    assert order[:4] == [V - 1, 1, V - 1, 0] and len(order) == V + 1  # <pad> serves as pad and as start
    pieces = aiayn_pieces(vocab, order)
    assert pieces[:4] == ["<pad>", "<unk>", "<s>", "</s>"] and "▁>>fra<<" in pieces
    src = Tokenizer(segmenter(src_spm, pieces, source=True, name="source.spm").model)
    tgt = Tokenizer(segmenter(tgt_spm, pieces, source=False, name="target.spm").model)
    assert joint_vocabulary(src, tgt) and src.sha256 != tgt.sha256
    test_en, test_de = (read_lines(shared_data, f"test_2016_flickr.{lang}.gz", 60) for lang in ("en", "de"))
    test_en += [">>fra<< " + line for line in test_en[:5]]
    for line in test_en:
        assert [order[i] for i in src.encode(line)] + [0] == tok(line)["input_ids"], line
    for line in test_de:
        ids = tok(text_target=line)["input_ids"]
        assert [order[i] for i in tgt.encode(line)] + [0] == ids, line
        if 1 not in ids:  # transformers drops an <unk> from its text, SentencePiece writes " ⁇ "
            assert tgt.decode(tgt.encode(line)) == tok.decode(ids, skip_special_tokens=True)


def test_pieces_outside_the_vocabulary_are_left_out(shared_data):
    """A piece of the SentencePiece model that vocab.json lacks (MarianTokenizer's <unk>) is not
    produced: the line is segmented with the pieces the vocabulary has."""
    en = read_lines(shared_data, "train.en.gz", 300)
    src_spm = marian_spm(en, 120)
    vocab = opus_vocab(src_spm)
    gone = "▁man"
    del vocab[gone]
    vocab = {p: i for i, p in enumerate(sorted(vocab, key=vocab.get))}  # renumbered 0..V-1
    V = len(vocab)
    pieces = aiayn_pieces(vocab, id_order(vocab, Specials(V - 1, 1, V - 1, 0), V, "vocab.json"))
    seg = segmenter(src_spm, pieces, source=True, name="source.spm")
    assert gone in seg.dropped and seg.foreign == 0
    src = Tokenizer(seg.model)
    assert gone not in src.encode_pieces("A man walks.") and src.decode(src.encode("A man walks.")) == "A man walks."


# ---------------------------------------------------------------------------------------------
# A random Marian model: the same function, the same greedy translations


@pytest.fixture(scope="module")
def marian_dir(shared_data, tmp_path_factory) -> Path:
    """OPUS-MT's layout with random weights: swish, scaled embeddings, a final-logits bias (EOS's
    raised so that some lines end before the maximum length), attention biases not zero (as trained
    ones), 2 + 1 layers, d_model 32."""
    from transformers import MarianConfig, MarianMTModel
    out = tmp_path_factory.mktemp("marian")
    en, de = read_lines(shared_data, "train.en.gz", 300), read_lines(shared_data, "train.de.gz", 300)
    src_spm, tgt_spm = marian_spm(en, 120), marian_spm(de, 120)
    vocab = opus_vocab(src_spm, tgt_spm)
    write_tokenizer(out, src_spm, tgt_spm, vocab)
    V = len(vocab)
    cfg = MarianConfig(vocab_size=V, decoder_vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=1,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                       activation_function="swish", scale_embedding=True, pad_token_id=V - 1,
                       decoder_start_token_id=V - 1, eos_token_id=0, forced_eos_token_id=0,
                       max_position_embeddings=128, init_std=0.3)
    torch.manual_seed(0)
    model = MarianMTModel(cfg).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 1.0)
        model.final_logits_bias[0, 0] += 3.0
        for name, p in model.named_parameters():
            if "attn." in name and name.endswith("_proj.bias"):
                p.normal_(0.0, 0.05)
    save_marian(model, out, V - 1)
    return out


@pytest.fixture(scope="module")
def imported(marian_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("imported") / "model.pt"
    assert main(["import", "--format", "hf", str(marian_dir), "--out", str(path)]) == 0
    assert main(["import", "--format", "hf", str(marian_dir), "--out", str(path)]) == 2  # exists
    assert main(["import", "--format", "hf", str(marian_dir), "--out", str(path), "--overwrite"]) == 0
    return path


def test_imported_config_names_what_marian_has(imported):
    model, src, tgt = load_model_for_inference(imported)
    cfg = model.cfg
    assert (cfg.activation, cfg.output_bias, cfg.layer_norm_eps, cfg.scale_embeddings) == ("swish", True, 1e-5, True)
    assert cfg.attn_bias  # Marian's attention projections have biases (§3.2.2's have none)
    assert (cfg.n_layers, cfg.decoder_layers, cfg.d_k) == (2, 1, 8)
    assert cfg.tie_src_tgt_embeddings and cfg.tie_embeddings
    assert src.sha256 != tgt.sha256 and src.vocab_size == tgt.vocab_size == cfg.vocab_size


def test_an_imported_checkpoint_names_the_code_that_wrote_it(imported):
    import aiayn
    from aiayn.host.environment import written_by
    assert load_checkpoint(imported)["written_by"] == written_by() and written_by()["aiayn"] == aiayn.__version__


def test_imported_logits_equal_marians(marian_dir, imported):
    from transformers import MarianMTModel
    hf = MarianMTModel.from_pretrained(marian_dir).eval()
    model, _, _ = load_model_for_inference(imported)
    ckpt_order = imported_order(marian_dir)
    pad = hf.config.pad_token_id
    src = torch.tensor([[5, 9, 40, 7, 0], [12, 30, 0, pad, pad]])  # Marian ids
    tgt = torch.tensor([[pad, 44, 45, 46], [pad, 3, 4, 5]])
    inv = {m: a for a, m in reversed(list(enumerate(ckpt_order)))}  # Marian id -> aiayn id (pad -> 0)
    to_aiayn = lambda t: t.apply_(lambda m: inv[m])  # noqa: E731
    with torch.no_grad():
        want = hf(input_ids=src, attention_mask=(src != pad).long(), decoder_input_ids=tgt).logits
        a_tgt = to_aiayn(tgt.clone())
        a_tgt[:, 0] = 2  # the decoder's first input: aiayn's <s>, Marian's <pad> row
        got = model(to_aiayn(src.clone()), a_tgt)
    within(want[..., ckpt_order], got.double(), two_implementations_bound(model, to_aiayn(src.clone()), a_tgt))


def imported_order(marian_dir: Path) -> list[int]:
    vocab = json.loads((marian_dir / "vocab.json").read_text(encoding="utf-8"))
    V = len(vocab)
    return id_order(vocab, Specials(pad=V - 1, unk=1, start=V - 1, eos=0), V, "vocab.json")


@pytest.mark.slow
def test_imported_greedy_translations_are_transformers(shared_data, marian_dir, imported):
    """Greedy search, α = 0, at most N tokens (generate's max_new_tokens = N, no forced EOS): token for token."""
    from transformers import MarianMTModel, MarianTokenizer
    hf = MarianMTModel.from_pretrained(marian_dir).eval()
    tok = MarianTokenizer.from_pretrained(marian_dir)
    lines = read_lines(shared_data, "test_2016_flickr.en.gz", 20)
    N, order = 25, imported_order(marian_dir)
    with Translator.from_checkpoint(imported, DecodeConfig(beam_size=1, alpha=0.0, max_len_a=0.0, max_len_b=N)) as tr:
        ours = [t[0] for t in tr.translate_nbest(lines)]
    with torch.no_grad():
        gen = hf.generate(**tok(lines, return_tensors="pt", padding=True), num_beams=1, do_sample=False,
                          max_new_tokens=N, forced_eos_token_id=None)
    theirs = hf_outputs(gen, 0, hf.config.pad_token_id)
    assert [[order[i] for i in t.tokens] for t in ours] == theirs
    assert [t.text for t in ours] == tok.batch_decode(gen, skip_special_tokens=True)
    assert 0 < sum(t.eos for t in ours) < len(lines)  # some end by EOS, some at N tokens


# ---------------------------------------------------------------------------------------------
# A trained model in OPUS-MT's ids: greedy and beam search as transformers' generate


def opus_layout(ckpt: Path, out: Path) -> Path:
    """The copy-task model as OPUS-MT numbers its ids: </s> 0, <unk> 1, the pieces, <pad> last,
    the decoder starting from <pad> (whose row is the model's <s> row; aiayn's own <pad> row,
    which only padding reads, is left out)."""
    from transformers import MarianMTModel
    model, src_tok, tgt_tok = load_model_for_inference(ckpt)
    V = model.cfg.vocab_size
    perm = [3, 1, *range(4, V), 2]  # aiayn's id of each Marian id
    state = marian_state_dict(model)
    for key in ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                "lm_head.weight"):
        state[key] = state[key][perm]
    state["final_logits_bias"] = state["final_logits_bias"][:, perm]
    pad = len(perm) - 1
    config = marian_config(model.cfg, pad_token_id=pad, bos_token_id=None, eos_token_id=0,
                           decoder_start_token_id=pad, forced_eos_token_id=0)
    config.vocab_size = config.decoder_vocab_size = len(perm)
    hf = MarianMTModel(config)
    hf.load_state_dict(state, strict=False)
    save_marian(hf.eval(), out, pad)
    vocab = {src_tok.piece(a): m for m, a in enumerate(perm)}
    vocab["<pad>"] = vocab.pop("<s>")
    write_tokenizer(out, src_tok.model_bytes, tgt_tok.model_bytes, vocab)
    return out


@pytest.mark.slow
def test_trained_model_translates_as_generate_greedy_and_beam(copy_checkpoint, tmp_path):
    from transformers import MarianMTModel, MarianTokenizer
    d = opus_layout(copy_checkpoint, tmp_path / "opus")
    path = tmp_path / "imported.pt"
    assert main(["import", "--format", "hf", str(d), "--out", str(path)]) == 0
    hf, tok = MarianMTModel.from_pretrained(d).eval(), MarianTokenizer.from_pretrained(d)
    vocab = json.loads((d / "vocab.json").read_text(encoding="utf-8"))
    V = len(vocab)
    order = id_order(vocab, Specials(pad=V - 1, unk=1, start=V - 1, eos=0), V, "vocab.json")
    lines = copy_lines(18, seed=7) + ["l k j i h g f e d c b a l k", "g g g g g g g g g g g"]  # the last two: errs
    batch = tok(lines, return_tensors="pt", padding=True)
    N = 40  # at most N tokens: aiayn's max_len_b with max_len_a 0; generate's max_new_tokens, no forced EOS
    for beam in (1, 4):
        decode = DecodeConfig(beam_size=beam, alpha=0.0, max_len_a=0.0, max_len_b=N)
        with Translator.from_checkpoint(path, decode) as tr:
            ours = [t[0] for t in tr.translate_nbest(lines)]
        with torch.no_grad():
            gen = hf.generate(**batch, num_beams=beam, length_penalty=0.0, do_sample=False, max_new_tokens=N,
                              forced_eos_token_id=None)
        assert [[order[i] for i in t.tokens] for t in ours] == hf_outputs(gen, 0, V - 1), beam
        assert [t.text for t in ours] == tok.batch_decode(gen, skip_special_tokens=True), beam
        assert sum(t.eos for t in ours) >= 17, beam  # the lines it errs on may run to N tokens
    assert sum(t.text == s for t, s in zip(ours, lines)) >= 10  # it copies most


# ---------------------------------------------------------------------------------------------
# Export, then import: the same tensors


@pytest.mark.parametrize("over, model_type", [
    ({}, "unigram"), ({"tie_src_tgt_embeddings": False}, "unigram"),
    ({"activation": "swish", "output_bias": True, "scale_embeddings": False, "n_dec_layers": 1}, "bpe"),
    ({"tie_embeddings": False, "tie_src_tgt_embeddings": False}, "unigram"), ({"tie_embeddings": False}, "unigram"),
    ({"attn_bias": True}, "unigram")])
def test_export_then_import_gives_the_same_tensors(shared_data, tmp_path, over, model_type):
    from aiayn.data.vocab import SentencePieceSpec, train_sentencepiece
    en, de = read_lines(shared_data, "train.en.gz", 300), read_lines(shared_data, "train.de.gz", 300)
    spec = SentencePieceSpec(vocab_size=100, model_type=model_type, character_coverage=1.0)
    src_tok = Tokenizer.load(train_sentencepiece(en + de, tmp_path / "src.model", spec, num_threads=1))
    separate = over.get("tie_src_tgt_embeddings") is False
    tgt_tok = Tokenizer.load(train_sentencepiece(de, tmp_path / "tgt.model", spec, num_threads=1)) if separate else src_tok
    cfg = aiayn.get_preset("tiny", vocab_size=src_tok.vocab_size, d_model=32, d_ff=64, n_heads=4, d_k=8, d_v=8,
                           tgt_vocab_size=tgt_tok.vocab_size if separate else None, **over)
    model = aiayn.Transformer(cfg)
    with torch.no_grad():
        if cfg.output_bias:
            model.out_bias.normal_()
        for name, p in model.named_parameters():  # (attn_bias; without it the export writes zeros)
            if name.endswith("_proj.bias"):
                p.normal_()
    export_hf(model, src_tok, tgt_tok, tmp_path / "hf")
    ckpt = import_hf(tmp_path / "hf", ImportConfig(unk_output=SENTENCEPIECE_UNK))  # <unk> as aiayn's models write it
    want = model.state_dict()
    assert set(ckpt["model"]) == set(want)
    for k, v in want.items():
        assert torch.equal(ckpt["model"][k], v), k
    got = {**ckpt["model_config"], "layer_norm_eps": cfg.layer_norm_eps}  # Marian's is 1e-5
    assert aiayn.ModelConfig(**got) == cfg
    toks = ckpt["tokenizers"]
    assert (toks["src"], toks["tgt"], toks["shared"]) == (src_tok.model_bytes, tgt_tok.model_bytes, not separate)


# ---------------------------------------------------------------------------------------------
# Refusals


def test_what_aiayn_cannot_express_is_refused_with_every_difference(marian_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    d = tmp_path / "odd"
    d.mkdir()
    for f in marian_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    config = json.loads((d / "config.json").read_text())
    config.update(decoder_attention_heads=2, activation_function="tanh", decoder_ffn_dim=48)
    (d / "config.json").write_text(json.dumps(config))
    state = load_file(d / "model.safetensors")
    state["model.encoder.layernorm_embedding.weight"] = torch.ones(32)
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError) as err:
        import_hf(d)
    msg = str(err.value)
    for part in ("the encoder has 4 heads, the decoder 2", "activation 'tanh'", "FFN widths 64 (encoder) and 48",
                 "weights MarianMTModel does not have: model.encoder.layernorm_embedding.weight"):
        assert part in msg
    config["model_type"] = "bart"
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="a 'bart' model; aiayn imports Marian models"):
        import_hf(d)


# ---------------------------------------------------------------------------------------------
# The commands that take a checkpoint take the imported one


@pytest.mark.slow
def test_imported_checkpoint_translates_evaluates_exports_and_fine_tunes(shared_data, imported, tmp_path, capsys):
    en = read_lines(shared_data, "test_2016_flickr.en.gz", 4)
    de = read_lines(shared_data, "test_2016_flickr.de.gz", 4)
    (tmp_path / "in.en").write_text("\n".join(en) + "\n")
    (tmp_path / "ref.de").write_text("\n".join(de) + "\n")
    capsys.readouterr()
    assert main(["translate", "--checkpoint", str(imported), "--input", str(tmp_path / "in.en"), "--beam-size", "1",
                 "--alpha", "0"]) == 0
    settings = {**load_checkpoint(imported)["decode"], "beam_size": 1, "alpha": 0.0}  # the model's, but the flags'
    with Translator.from_checkpoint(imported, replace(TRANSLATE_DECODE, **settings)) as tr:
        assert capsys.readouterr().out.splitlines() == tr.translate(en)
    assert main(["evaluate", "--checkpoint", str(imported), "--src", str(tmp_path / "in.en"),
                 "--ref", str(tmp_path / "ref.de"), "--beam-size", "1", "--json"]) == 0
    assert main(["export", "--format", "hf", "--checkpoint", str(imported), "--out", str(tmp_path / "hf")]) == 0
    again = import_hf(tmp_path / "hf")
    first = load_model_for_inference(imported)[0].state_dict()
    assert all(torch.equal(again["model"][k], v) for k, v in first.items())
    # fine-tuning: the data encoded with the imported tokenizers (two, one joint vocabulary), one step
    files = []
    for split in ("train", "valid"):
        for side, lines in (("src", en), ("tgt", de)):
            (tmp_path / f"{split}.{side}").write_text("\n".join(lines) + "\n")
            files += [f"--{split}-{side}", str(tmp_path / f"{split}.{side}")]
    data = tmp_path / "data"
    assert main(["prepare", *files, "--out", str(data), "--tokenizer-from", str(imported), "--num-workers", "1"]) == 0
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--init-from", str(imported),
                 "--max-steps", "1", "--no-progress", "--set", "train.save_every_min=0",
                 "--set", "train.validate_every_steps=0", "--set", "train.precision=fp32",
                 "--set", "train.threads=1"]) == 0
    tuned = load_model_for_inference(tmp_path / "run" / "last.pt")[0]
    assert tuned.cfg.tie_src_tgt_embeddings and tuned.cfg.activation == "swish" and tuned.cfg.output_bias


def test_pytorch_bin_with_every_key_imports_as_safetensors(marian_dir, tmp_path):
    """An older directory (transformers 4's pytorch_model.bin: the tied matrices under each of
    their names, the positional tables saved too) gives the same checkpoint as model.safetensors."""
    from safetensors.torch import load_file
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding
    d = tmp_path / "bin"
    d.mkdir()
    for f in marian_dir.iterdir():
        if f.name != "model.safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    state = load_file(marian_dir / "model.safetensors")
    shared = state["model.shared.weight"]
    state.update({"model.encoder.embed_tokens.weight": shared, "model.decoder.embed_tokens.weight": shared,
                  "lm_head.weight": shared})
    table = MarianSinusoidalPositionalEmbedding(128, 32).create_weight()
    state["model.encoder.embed_positions.weight"] = state["model.decoder.embed_positions.weight"] = table
    torch.save(state, d / "pytorch_model.bin")
    want, got = import_hf(marian_dir), import_hf(d)
    assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    assert got["model_config"] == want["model_config"] and got["tokenizers"] == want["tokenizers"]
    state["model.decoder.embed_positions.weight"] = torch.randn(128, 32)  # learned positions: refused
    torch.save(state, d / "pytorch_model.bin")
    with pytest.raises(UserError, match="model.decoder.embed_positions.weight is not Marian's sinusoidal table"):
        import_hf(d)


@pytest.mark.slow
def test_an_export_imported_back_translates_as_the_checkpoint(copy_checkpoint, tmp_path, caplog):
    """generation_config.json tells transformers 4 beams and the model's every position, which is not
    aiayn's search (GNMT's α 0.6, |x| + 50): an export's aiayn.json records the checkpoint's own
    decoding, and the import restores that, not generate's settings."""
    out, back = tmp_path / "hf", tmp_path / "back.pt"
    assert main(["export", "--format", "hf", "--checkpoint", str(copy_checkpoint), "--out", str(out)]) == 0
    assert json.loads((out / "generation_config.json").read_text())["num_beams"] == 4
    import os
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == \
        {p.name: oct(0o666 & ~umask) for p in out.iterdir()}  # what open() gives; safetensors' file too
    with caplog.at_level("INFO"):
        assert main(["import", "--format", "hf", str(out), "--out", str(back)]) == 0
    assert "exported by aiayn: decodes with the exported checkpoint's settings (aiayn's defaults)" in caplog.text
    assert "decode" not in torch.load(back, map_location="cpu", weights_only=True)
    lines = copy_lines(12, seed=5)
    with Translator.from_checkpoint(copy_checkpoint) as a, Translator.from_checkpoint(back) as b:
        assert b.cfg == a.cfg and b.translate(lines) == a.translate(lines)
    # a record that is not settings is refused, naming the file
    (out / "aiayn.json").write_text(json.dumps({"format": "hf", "decode": {"beam": 3}}))
    assert main(["import", "--format", "hf", str(out), "--out", str(back), "--overwrite"]) == 2
