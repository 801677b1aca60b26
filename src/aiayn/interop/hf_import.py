"""``aiayn import --format hf DIR --out FILE.pt``: a Hugging Face ``MarianMTModel`` as an aiayn checkpoint.

    aiayn import --format hf opus-mt-en-de --out runs/en-de/model.pt
    aiayn translate --checkpoint runs/en-de/model.pt < input.en

DIR is what ``save_pretrained`` writes and OPUS-MT's models ship: ``config.json``, the weights in
``model.safetensors`` or ``pytorch_model.bin``, ``source.spm`` / ``target.spm`` and ``vocab.json``
(and ``target_vocab.json`` for separate vocabularies), ``generation_config.json``. Every file is
checked before it is used (``aiayn.interop.marian_dir``). The checkpoint translates, serves, exports and
fine-tunes (``train --init-from``) as one aiayn trained. It inverts ``aiayn.interop.hf_export``:

- Marian is the paper's post-norm model with biases everywhere; its heads split d_model
  (d_k = d_v = d_model / h) and its positions are §3.5's sinusoids laid out in halves, which the
  inverse of ``hf.model_permutation`` turns into aiayn's interleaved ones in every weight;
- what Marian has and the paper lacks becomes a ``ModelConfig`` option: the FFN's activation
  (``activation``: OPUS-MT's swish, or gelu), the attention projections' biases (``attn_bias``) and the
  final-logits bias (``output_bias``) unless all zero (what an export of a model without them writes),
  LayerNorm's epsilon 1e-5 (``layer_norm_eps``), unscaled embeddings (``scale_embeddings``), untied or
  unshared matrices (``tie_embeddings``, ``tie_src_tgt_embeddings``), unequal depths;
- ids and SentencePiece models are mapped as ``aiayn.interop.marian_vocab`` says; a joint vocabulary
  with two SentencePiece models keeps one shared embedding (the checkpoint's two tokenizers
  then number the same pieces alike: ``aiayn.data.vocab.joint_vocabulary``);
- the generation settings (``generation_config.json``: beams, length penalty, maximum length...)
  become the checkpoint's ``decode`` entry, the DecodeConfig fields ``aiayn translate`` decodes
  with unless given (``decode_settings``);
- refused, with every difference named (``marian_refusals``): a model other than MarianMTModel,
  unequal head counts or FFN widths of the two stacks, another activation, an odd d_model,
  positional weights that are not the sinusoids, weights Marian does not have or lacks.
Not carried: LayerDrop (training only; a warning) and the generation settings aiayn's search has
no equivalent of (a warning names them). Greedy outputs are transformers' token for token; beams
can differ on close calls (``aiayn.interop.hf_export``'s module docstring).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from aiayn.config import ConfigError, param, replace
from aiayn.errors import UserError
from aiayn.host.environment import written_by
from aiayn.interop.hf_export import MARIAN_LAYER_NORM_EPS, model_permutation
from aiayn.interop.marian_dir import MarianDir, read_marian_dir, weight_refusals
from aiayn.interop.marian_vocab import UNKNOWN_RUNS, Specials, aiayn_pieces, id_order, segmenter
from aiayn.model import ModelConfig, Transformer

log = logging.getLogger(__name__)
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}  # transformers' name -> aiayn's
SENTENCEPIECE_UNK = " \u2047 "  # SentencePiece's own text for <unk> (TrainerSpec.unk_surface's default)


@dataclass(frozen=True)
class ImportConfig:
    """How ``aiayn import`` writes a Marian model's tokenizers (docs/import.md)."""

    unknown_runs: str = param("marian", "a run of characters the source SentencePiece model does not know: marian "
                                        "(one <unk>, or the vocabulary's piece of the whole run, as transformers' "
                                        "MarianTokenizer gives) or chars (each character the vocabulary has is its "
                                        "own piece)")
    unk_output: str = param("", "the text an <unk> of a translation becomes: '' drops it, as transformers' "
                                "decode(skip_special_tokens=True) does; SentencePiece writes ' \u2047 '")

    def __post_init__(self) -> None:
        if self.unknown_runs not in UNKNOWN_RUNS:
            raise ConfigError(f"unknown_runs must be {' or '.join(UNKNOWN_RUNS)}, got {self.unknown_runs!r}")


def marian_refusals(c: dict) -> list[str]:
    """What of the Marian config ``c`` aiayn's model cannot express (empty when it can)."""
    out = []
    if "MarianMTModel" not in (c.get("architectures") or ["MarianMTModel"]):
        out.append(f"architectures {c.get('architectures')}: aiayn imports the encoder-decoder MarianMTModel")
    heads = c["encoder_attention_heads"], c["decoder_attention_heads"]
    if heads[0] != heads[1]:
        out.append(f"the encoder has {heads[0]} heads, the decoder {heads[1]}: aiayn's stacks have one h")
    elif c["d_model"] % heads[0]:
        out.append(f"d_model {c['d_model']} is not a multiple of the {heads[0]} heads")
    if c["encoder_ffn_dim"] != c["decoder_ffn_dim"]:
        out.append(f"FFN widths {c['encoder_ffn_dim']} (encoder) and {c['decoder_ffn_dim']} (decoder): "
                   f"aiayn has one d_ff")
    if c["activation_function"] not in ACTIVATIONS:
        out.append(f"activation {c['activation_function']!r}: aiayn has {', '.join(ACTIVATIONS)}")
    if c["d_model"] % 2:
        out.append(f"d_model {c['d_model']} is odd: Marian's sinusoids then have no interleaved equivalent (§3.5)")
    return out


def model_config(c: dict, src_size: int, tgt_size: int | None, *, tie_src_tgt: bool, tie_out: bool,
                 bias: bool, attn_bias: bool) -> ModelConfig:
    """aiayn's ``ModelConfig`` of the Marian config ``c`` (``marian_refusals`` empty), vocabularies in
    aiayn's ids (``tgt_size`` None: one vocabulary, joint); ``bias``, ``attn_bias``: whether the
    final-logits bias, the attention projections' biases are not all zero."""
    h = c["encoder_attention_heads"]
    return ModelConfig(
        vocab_size=src_size, tgt_vocab_size=tgt_size,
        n_layers=c["encoder_layers"],
        n_dec_layers=None if c["decoder_layers"] == c["encoder_layers"] else c["decoder_layers"],
        d_model=c["d_model"], d_ff=c["encoder_ffn_dim"], n_heads=h, d_k=c["d_model"] // h, d_v=c["d_model"] // h,
        p_drop=float(c["dropout"]), p_drop_attn=float(c["attention_dropout"]),
        p_drop_ffn=float(c["activation_dropout"]), activation=ACTIVATIONS[c["activation_function"]],
        max_positions=c["max_position_embeddings"], tie_embeddings=tie_out, output_bias=bias, attn_bias=attn_bias,
        tie_src_tgt_embeddings=tie_src_tgt, scale_embeddings=bool(c["scale_embedding"]),
        layer_norm_eps=MARIAN_LAYER_NORM_EPS)


def _embeddings(d: MarianDir) -> tuple[Tensor, Tensor, Tensor]:
    """The encoder's and decoder's embedding matrices and the pre-softmax projection, as
    transformers ties them: all one (``model.shared``) when shared and tied, else as saved."""
    c, s = d.config, d.state
    shared = s.get("model.shared.weight")
    tie_out = c.get("tie_word_embeddings", True)
    everything = c.get("share_encoder_decoder_embeddings", True) and tie_out and shared is not None

    def pick(key: str) -> Tensor:
        found = shared if everything else s.get(key, shared)
        if found is None:
            raise UserError(f"{d.path}: no {key} nor model.shared.weight")
        return found

    enc, dec = pick("model.encoder.embed_tokens.weight"), pick("model.decoder.embed_tokens.weight")
    if not tie_out and "lm_head.weight" not in s:
        raise UserError(f"{d.path}: tie_word_embeddings is false and there is no lm_head.weight")
    out_w = dec if tie_out else s["lm_head.weight"]
    bias = s.get("final_logits_bias")
    if out_w.size(0) != dec.size(0) or (bias is not None and bias.numel() != dec.size(0)):
        raise UserError(f"{d.weights_file}: the decoder's embedding has {dec.size(0)} rows, the output projection "
                        f"{out_w.size(0)}, final_logits_bias {'none' if bias is None else bias.numel()}: one target "
                        f"vocabulary gives them all")
    return enc, dec, out_w


def id_orders(d: MarianDir, src_rows: int, tgt_rows: int) -> tuple[list[int], list[int]]:
    """The Marian id of each aiayn id, source and target side (``marian_vocab.id_order``)."""
    c, t = d.config, d.tokens
    for side, vocab in (("vocab.json", d.src_vocab), ("target vocabulary", d.tgt_vocab)):
        if t["unk"] not in vocab or t["eos"] not in vocab:
            raise UserError(f"{d.path}: {side} lacks {t['unk']} or {t['eos']}")
    tgt = Specials(pad=c["pad_token_id"], unk=d.tgt_vocab[t["unk"]], start=c["decoder_start_token_id"],
                   eos=c["eos_token_id"])
    tgt_file = "vocab.json" if d.src_vocab is d.tgt_vocab else "target_vocab.json"
    tgt_order = id_order(d.tgt_vocab, tgt, tgt_rows, f"{d.path / tgt_file} (with config.json's ids)")
    if d.src_vocab is d.tgt_vocab:
        if d.src_vocab[t["eos"]] != tgt.eos:
            raise UserError(f"{d.path}: the tokenizer ends a source with {t['eos']} = {d.src_vocab[t['eos']]}, "
                            f"the model's eos_token_id is {tgt.eos}")
        return tgt_order, tgt_order
    pad = d.src_vocab.get(t["pad"], c["pad_token_id"])
    start = {i: p for p, i in d.tgt_vocab.items()}.get(tgt.start)  # a source never holds it: its row, if any
    src = Specials(pad=pad, unk=d.src_vocab[t["unk"]], start=d.src_vocab.get(start, pad), eos=d.src_vocab[t["eos"]])
    return id_order(d.src_vocab, src, src_rows, f"{d.path / 'vocab.json'}"), tgt_order


def aiayn_state(d: MarianDir, cfg: ModelConfig, src_order: list[int], tgt_order: list[int],
                enc: Tensor, dec: Tensor, out_w: Tensor) -> dict[str, Tensor]:
    """Marian's weights under aiayn's names (the inverse of ``hf.marian_state_dict``): d_model
    dimensions back in §3.5's order, q/k/v fused, embedding rows in aiayn's ids."""
    s = d.state
    P = torch.argsort(model_permutation(cfg.d_model))  # Marian's dimension of each of aiayn's
    out: dict[str, Tensor] = {}

    def linear(name: str, d_in: bool, d_out: bool) -> tuple[Tensor, Tensor]:
        w, b = s[f"{name}.weight"], s[f"{name}.bias"]
        if d_in:
            w = w[:, P]
        if d_out:
            w, b = w[P], b[P]
        return w, b

    def put(name: str, wb: tuple[Tensor, Tensor]) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = wb
        if name.endswith("_proj") and not cfg.attn_bias:  # an attention projection, its biases all zero
            del out[f"{name}.bias"]

    def fused(*names: str) -> tuple[Tensor, Tensor]:  # projections stacked by rows, as aiayn's qkv/kv
        parts = [linear(n, True, False) for n in names]
        return torch.cat([w for w, _ in parts]), torch.cat([b for _, b in parts])

    def norm(name: str, marian: str) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = s[f"{marian}.weight"][P], s[f"{marian}.bias"][P]

    def ffn(name: str, marian: str) -> None:
        put(f"{name}.ffn.w1", linear(f"{marian}.fc1", True, False))
        put(f"{name}.ffn.w2", linear(f"{marian}.fc2", False, True))
        norm(f"{name}.conn_ffn.norm", f"{marian}.final_layer_norm")

    for i in range(cfg.n_layers):
        a, m = f"encoder_layers.{i}", f"model.encoder.layers.{i}"
        put(f"{a}.self_attn.qkv_proj", fused(*(f"{m}.self_attn.{p}_proj" for p in "qkv")))
        put(f"{a}.self_attn.out_proj", linear(f"{m}.self_attn.out_proj", False, True))
        norm(f"{a}.conn_attn.norm", f"{m}.self_attn_layer_norm")
        ffn(a, m)
    for i in range(cfg.decoder_layers):
        a, m = f"decoder_layers.{i}", f"model.decoder.layers.{i}"
        put(f"{a}.self_attn.qkv_proj", fused(*(f"{m}.self_attn.{p}_proj" for p in "qkv")))
        put(f"{a}.self_attn.out_proj", linear(f"{m}.self_attn.out_proj", False, True))
        norm(f"{a}.conn_self.norm", f"{m}.self_attn_layer_norm")
        put(f"{a}.cross_attn.q_proj", linear(f"{m}.encoder_attn.q_proj", True, False))
        put(f"{a}.cross_attn.kv_proj", fused(f"{m}.encoder_attn.k_proj", f"{m}.encoder_attn.v_proj"))
        put(f"{a}.cross_attn.out_proj", linear(f"{m}.encoder_attn.out_proj", False, True))
        norm(f"{a}.conn_cross.norm", f"{m}.encoder_attn_layer_norm")
        ffn(a, m)
    out["src_embed.weight"] = enc[src_order][:, P]
    out["tgt_embed.weight"] = out["src_embed.weight"] if cfg.tie_src_tgt_embeddings else dec[tgt_order][:, P]
    if not cfg.tie_embeddings:
        out["out_proj.weight"] = out_w[tgt_order][:, P]
    if cfg.output_bias:
        out["out_bias"] = s["final_logits_bias"].reshape(-1)[tgt_order]
    return out


def _tokenizers(d: MarianDir, src_order: list[int], tgt_order: list[int], opts: ImportConfig) -> dict:
    """The checkpoint's ``tokenizers`` entry: each side's SentencePiece model in aiayn's ids
    (``marian_vocab``), unknown runs and <unk>'s text as ``opts`` says."""
    models = {}
    for side, vocab, order, source in (("src", d.src_vocab, src_order, True), ("tgt", d.tgt_vocab, tgt_order, False)):
        name = f"{d.path / ('source.spm' if source else 'target.spm')}"
        seg = segmenter(d.spm[side], aiayn_pieces(vocab, order), source=source, name=name,
                        unknown_runs=opts.unknown_runs if source else None,
                        unk_surface=None if opts.unk_output == SENTENCEPIECE_UNK else opts.unk_output)
        if seg.dropped:
            log.warning("%s: %d of its pieces are not in the vocabulary (transformers writes <unk> for them; aiayn "
                        "segments around them), e.g. %s", name, len(seg.dropped), ", ".join(seg.dropped[:5]))
        log.info("%s: %d pieces in aiayn's ids, %d of them only the other side produces", name, len(order), seg.foreign)
        models[side] = seg.model
    from aiayn.data.vocab import Tokenizer
    toks = {side: Tokenizer(m) for side, m in models.items()}
    return {"src": models["src"], "tgt": models["tgt"], "src_sha256": toks["src"].sha256,
            "tgt_sha256": toks["tgt"].sha256, "shared": models["src"] == models["tgt"]}


# transformers' generate defaults (GenerationConfig) of the settings the import carries, and what each must be
GENERATE_DEFAULTS = {"num_beams": (1, "count"), "length_penalty": (1.0, "number"), "max_length": (20, "count"),
                     "max_new_tokens": (None, "count"), "min_length": (0, "size"), "min_new_tokens": (None, "size"),
                     "no_repeat_ngram_size": (0, "size"), "do_sample": (False, "flag"), "temperature": (1.0, "number"),
                     "top_k": (50, "size"), "top_p": (1.0, "number")}
_KIND = {"count": ("an integer >= 1", lambda v: type(v) is int and v >= 1),
         "size": ("an integer >= 0", lambda v: type(v) is int and v >= 0),
         "number": ("a number", lambda v: type(v) in (int, float)),
         "flag": ("true or false", lambda v: type(v) is bool)}
# settings of generate whose effect aiayn's search has without being told (ids, output options)
SAME_EFFECT = {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "transformers_version",
               "_from_model_config", "use_cache", "output_attentions", "output_hidden_states", "output_scores",
               "output_logits", "return_dict_in_generate", "bad_words_ids", "num_return_sequences"}
# settings aiayn's search has no equivalent of, whose effect is small: close calls of a beam, the last token at the
# maximum length (docs/import.md)
MINOR = {"early_stopping", "renormalize_logits", "forced_eos_token_id"}


def exported_settings(path: Path) -> dict | None:
    """The decoding settings of a folder aiayn's ``export --format hf`` wrote (its ``RECORD`` says
    so): the exported checkpoint's own (its ``decode`` entry; {} for a model aiayn trained, which
    translates with aiayn's defaults), as its generation_config.json gives transformers' ``generate``
    only what that can express (no GNMT penalty, no |x| + b). None for any other folder."""
    import json

    from aiayn.decode.loading import checked_settings
    from aiayn.interop.export_dir import RECORD
    file = path / RECORD
    if not file.is_file():
        return None
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{file}: not JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != "hf":
        return None
    settings = checked_settings(record.get("decode", {}), f"{file}: its decode entry")
    log.info("%s: exported by aiayn: decodes with the exported checkpoint's settings%s", file,
             "".join(f", {k} {v}" for k, v in settings.items()) or " (aiayn's defaults)")
    return settings


def decode_settings(g: dict, name: str | Path, pad: int, start: int) -> dict:
    """The DecodeConfig fields of transformers' generation settings ``g`` (generation_config.json,
    named ``name``) as ``generate`` reads them, its defaults where ``g`` has none: num_beams is
    beam_size; length_penalty is alpha with length_norm power (|Y|^α); max_new_tokens, else
    max_length less the decoder's start, is the maximum length (max_len_a 0); min_new_tokens,
    else min_length less the start, is min_len; no_repeat_ngram_size; do_sample with temperature,
    top_k and top_p. What is not carried is named in a log line (``MINOR``: info; else a warning)."""
    for key, (_, kind) in GENERATE_DEFAULTS.items():
        what, ok = _KIND[kind]
        if g.get(key) is not None and not ok(g[key]):
            raise UserError(f"{name}: {key} = {g[key]!r}: not {what}")
    v = {k: default if g.get(k) is None else g[k] for k, (default, _) in GENERATE_DEFAULTS.items()}
    forced_eos = 1 if g.get("forced_eos_token_id") is not None else 0  # its last token is EOS, which aiayn drops
    out = {"beam_size": v["num_beams"], "alpha": float(v["length_penalty"]), "length_norm": "power", "max_len_a": 0.0,
           "max_len_b": max(1, (v["max_new_tokens"] if v["max_new_tokens"] is not None else v["max_length"] - 1)
                            - forced_eos),
           "min_len": v["min_new_tokens"] if v["min_new_tokens"] is not None else max(0, v["min_length"] - 1),
           "no_repeat_ngram": v["no_repeat_ngram_size"]}
    if v["do_sample"]:
        out.update(sampling=True, temperature=float(v["temperature"]), top_k=v["top_k"], top_p=float(v["top_p"]))
    try:
        from aiayn.decode.config import TRANSLATE_DECODE
        replace(TRANSLATE_DECODE, **out)
    except ConfigError as exc:
        raise UserError(f"{name}: aiayn's search cannot take it: {exc}") from None
    _not_carried(g, name, pad, start)
    return out


def _not_carried(g: dict, name: str | Path, pad: int, start: int) -> None:
    """Log the settings of ``g`` that ``decode_settings`` does not carry and that change an output."""
    banned = [ids for ids in g.get("bad_words_ids") or [] if ids not in ([pad], [start])]  # aiayn's search bans these
    left = {k: x for k, x in g.items() if k not in GENERATE_DEFAULTS and k not in SAME_EFFECT
            and x not in (None, False, 0, 0.0, 1, 1.0, [], {})}
    major = {k: x for k, x in left.items() if k not in MINOR} | ({"bad_words_ids": banned} if banned else {})
    minor = {k: x for k, x in left.items() if k in MINOR}
    if g.get("do_sample") and g.get("num_beams", 1) > 1:
        major["num_beams with do_sample"] = "beam sampling: aiayn samples one path"
    if major:
        log.warning("%s: not carried (aiayn's search has no equivalent; outputs can differ): %s", name,
                    ", ".join(f"{k} {x}" for k, x in major.items()))
    if minor:
        log.info("%s: not carried (docs/import.md: they change close calls of a beam or the last token at the "
                 "maximum length): %s", name, ", ".join(f"{k} {x}" for k, x in minor.items()))


def import_hf(path: str | Path, opts: ImportConfig = ImportConfig()) -> dict:
    """The aiayn checkpoint dict of the Marian directory ``path`` (module docstring); refused with
    every difference named when aiayn's model cannot compute what Marian's does."""
    from aiayn.checkpoint import FORMAT
    from aiayn.config import to_dict
    from aiayn.model.config import check_limits
    from aiayn.train.config import RunConfig

    d = read_marian_dir(path)
    c = d.config
    refusals = marian_refusals(c) + weight_refusals(d)
    if refusals:
        raise UserError(f"{d.path}: cannot import: " + "; ".join(refusals))
    for stack in ("encoder", "decoder"):
        if c.get(f"{stack}_layerdrop"):
            log.warning("%s_layerdrop %s is not carried (it only drops layers in training)", stack,
                        c[f"{stack}_layerdrop"])
    enc, dec, out_w = _embeddings(d)
    src_order, tgt_order = id_orders(d, enc.size(0), dec.size(0))
    joint = aiayn_pieces(d.src_vocab, src_order) == aiayn_pieces(d.tgt_vocab, tgt_order)  # as joint_vocabulary
    bias = d.state.get("final_logits_bias")
    attn_biases = [t for k, t in d.state.items() if "attn." in k and k.endswith("_proj.bias")]
    try:
        cfg = model_config(c, len(src_order), None if joint else len(tgt_order),
                           tie_src_tgt=joint and torch.equal(enc[src_order], dec[tgt_order]),
                           tie_out=torch.equal(out_w, dec), bias=bias is not None and bool(bias.any()),
                           attn_bias=any(bool(t.any()) for t in attn_biases))
        check_limits(to_dict(cfg))  # what every load of the checkpoint checks
    except ConfigError as exc:
        raise UserError(f"{d.path}: cannot import: model_config.{exc}") from None
    model = Transformer(cfg)
    model.load_state_dict(aiayn_state(d, cfg, src_order, tgt_order, enc, dec, out_w))
    settings = exported_settings(d.path)
    if settings is None:
        settings = decode_settings(d.generation, d.generation_file, c["pad_token_id"], c["decoder_start_token_id"]) \
            if d.generation else {}
    log.info("imported %s: %d+%d layers, d_model %d, h %d, d_ff %d, activation %s, vocabulary %d%s, output bias %s, "
             "attention biases %s", d.path, cfg.n_layers, cfg.decoder_layers, cfg.d_model, cfg.n_heads, cfg.d_ff,
             cfg.activation, cfg.vocab_size, "" if joint else f"/{cfg.target_vocab_size}", cfg.output_bias,
             cfg.attn_bias)
    if settings:
        log.info("%s: translate decodes with %s unless told otherwise", d.generation_file.name,
                 ", ".join(f"{k} {x}" for k, x in settings.items()))
    return {"format": FORMAT, "run_config": to_dict(RunConfig(model=cfg)), "model_config": to_dict(cfg),
            "model": model.state_dict(), "tokenizers": _tokenizers(d, src_order, tgt_order, opts),
            **({"decode": settings} if settings else {}), "step": 0, "epoch": 0,
            "imported_from": {"format": "hf", "path": str(d.path), "generation_config": d.generation},
            "written_by": written_by()}
