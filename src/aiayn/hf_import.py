"""``aiayn import --format hf DIR --out FILE.pt``: a Hugging Face ``MarianMTModel`` as an aiayn checkpoint.

    aiayn import --format hf opus-mt-en-de --out runs/en-de/model.pt
    aiayn translate --checkpoint runs/en-de/model.pt --alpha 0 < input.en

DIR is what ``save_pretrained`` writes and OPUS-MT's models ship: ``config.json``, the weights in
``model.safetensors`` or ``pytorch_model.bin``, ``source.spm`` / ``target.spm`` and ``vocab.json``
(and ``target_vocab.json`` for separate vocabularies). The checkpoint translates, serves,
exports and fine-tunes (``train --init-from``) as one aiayn trained. It inverts ``aiayn.exporters.hf``:

- Marian is the paper's post-norm model with biases everywhere; its heads split d_model
  (d_k = d_v = d_model / h) and its positions are §3.5's sinusoids laid out in halves, which the
  inverse of ``hf.model_permutation`` turns into aiayn's interleaved ones in every weight;
- what Marian has and the paper lacks becomes a ``ModelConfig`` option: the FFN's activation
  (``activation``: OPUS-MT's swish, or gelu), the final-logits bias (``output_bias``), LayerNorm's
  epsilon 1e-5 (``layer_norm_eps``), unscaled embeddings (``scale_embeddings``), untied or
  unshared matrices (``tie_embeddings``, ``tie_src_tgt_embeddings``), unequal depths;
- ids and SentencePiece models are mapped as ``aiayn.marian_vocab`` says; a joint vocabulary
  with two SentencePiece models keeps one shared embedding (the checkpoint's two tokenizers
  then number the same pieces alike: ``aiayn.data.vocab.joint_vocabulary``);
- refused, with every difference named (``marian_refusals``): a model other than MarianMTModel,
  unequal head counts or FFN widths of the two stacks, another activation, an odd d_model,
  positional weights that are not the sinusoids, weights Marian does not have or lacks.
Not carried: LayerDrop (training only; a warning) and the generation settings (beam size,
length penalty, banned tokens beyond <pad>): aiayn's search takes its own (``DecodeConfig``).
With ``--alpha 0`` (transformers' ``length_penalty=0``) greedy outputs are transformers'
token for token; beams can differ on close calls (``aiayn.exporters.hf``'s module docstring).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from aiayn.errors import UserError
from aiayn.exporters.hf import MARIAN_LAYER_NORM_EPS, model_permutation
from aiayn.marian_vocab import Specials, aiayn_pieces, id_order, segmenter
from aiayn.model import ModelConfig, Transformer
from aiayn.model.positional import sinusoidal_table

log = logging.getLogger(__name__)
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}  # transformers' name -> aiayn's
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass
class MarianDir:
    """What an import reads from a Marian directory."""
    path: Path
    config: dict  # MarianConfig.to_dict(): transformers' defaults filled in
    state: dict[str, Tensor]  # the weights as saved (float32)
    src_vocab: dict[str, int]
    tgt_vocab: dict[str, int]  # src_vocab itself unless the vocabularies are separate
    spm: dict[str, bytes]  # "src", "tgt": source.spm, target.spm
    tokens: dict[str, str]  # "unk", "eos", "pad": MarianTokenizer's special pieces


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: cannot read ({exc})") from exc


def _weights(path: Path) -> dict[str, Tensor]:
    for name in WEIGHT_FILES:
        f = path / name
        if f.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                state = load_file(f)
            else:
                state = torch.load(f, map_location="cpu", weights_only=True)  # no code from the file runs
            return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    raise UserError(f"{path}: no weights ({' or '.join(WEIGHT_FILES)}; sharded weights are not read)")


def _token(value, default: str) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        return value.get("content", default)
    return value if isinstance(value, str) else default


def read_marian_dir(path: str | Path) -> MarianDir:
    """Config (transformers' ``MarianConfig``, for its defaults), weights, vocabularies, SentencePiece models."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: no config.json (a directory that MarianMTModel.save_pretrained wrote?)")
    try:
        from transformers import MarianConfig
    except ImportError as exc:
        raise UserError("aiayn import --format hf needs transformers: pip install transformers (aiayn[hf])") from exc
    raw = _read_json(path / "config.json")
    if raw.get("model_type") != "marian":
        raise UserError(f"{path}: a {raw.get('model_type')!r} model; aiayn imports Marian models (MarianMTModel)")
    config = MarianConfig.from_pretrained(str(path)).to_dict()
    tok_cfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    tokens = {k: _token(tok_cfg.get(f"{k}_token"), d) for k, d in (("unk", "<unk>"), ("eos", "</s>"), ("pad", "<pad>"))}
    files = {"src": path / "source.spm", "tgt": path / "target.spm", "vocab": path / "vocab.json"}
    missing = [f.name for f in files.values() if not f.is_file()]
    if missing:
        raise UserError(f"{path}: no {', '.join(missing)} (MarianTokenizer's files)")
    src_vocab = _read_json(files["vocab"])
    separate = bool(tok_cfg.get("separate_vocabs")) or not config.get("share_encoder_decoder_embeddings", True)
    tgt_vocab = src_vocab
    if separate and (path / "target_vocab.json").is_file():
        tgt_vocab = _read_json(path / "target_vocab.json")
    return MarianDir(path, config, _weights(path), src_vocab, tgt_vocab,
                     {"src": files["src"].read_bytes(), "tgt": files["tgt"].read_bytes()}, tokens)


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
                 bias: bool) -> ModelConfig:
    """aiayn's ``ModelConfig`` of the Marian config ``c`` (``marian_refusals`` empty), vocabularies in
    aiayn's ids (``tgt_size`` None: one vocabulary, joint)."""
    h = c["encoder_attention_heads"]
    return ModelConfig(
        vocab_size=src_size, tgt_vocab_size=tgt_size,
        n_layers=c["encoder_layers"],
        n_dec_layers=None if c["decoder_layers"] == c["encoder_layers"] else c["decoder_layers"],
        d_model=c["d_model"], d_ff=c["encoder_ffn_dim"], n_heads=h, d_k=c["d_model"] // h, d_v=c["d_model"] // h,
        p_drop=float(c["dropout"]), p_drop_attn=float(c["attention_dropout"]),
        p_drop_ffn=float(c["activation_dropout"]), activation=ACTIVATIONS[c["activation_function"]],
        max_positions=c["max_position_embeddings"], tie_embeddings=tie_out, output_bias=bias,
        tie_src_tgt_embeddings=tie_src_tgt, scale_embeddings=bool(c["scale_embedding"]),
        layer_norm_eps=MARIAN_LAYER_NORM_EPS)


def _layer_keys(c: dict) -> set[str]:
    """The names of MarianMTModel's layer weights under config ``c``."""
    def attn(prefix: str) -> list[str]:
        return [f"{prefix}.{p}_proj.{w}" for p in ("q", "k", "v", "out") for w in ("weight", "bias")]

    def sub(prefix: str, names: list[str]) -> list[str]:
        return [f"{prefix}.{n}.{w}" for n in names for w in ("weight", "bias")]

    keys: list[str] = []
    for i in range(c["encoder_layers"]):
        p = f"model.encoder.layers.{i}"
        keys += attn(f"{p}.self_attn") + sub(p, ["self_attn_layer_norm", "fc1", "fc2", "final_layer_norm"])
    for i in range(c["decoder_layers"]):
        p = f"model.decoder.layers.{i}"
        keys += attn(f"{p}.self_attn") + attn(f"{p}.encoder_attn") + sub(
            p, ["self_attn_layer_norm", "encoder_attn_layer_norm", "fc1", "fc2", "final_layer_norm"])
    return set(keys)


EMBEDDING_KEYS = ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                  "lm_head.weight", "final_logits_bias")
POSITION_KEYS = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")


def weight_refusals(d: MarianDir) -> list[str]:
    """Weights the Marian config does not account for, or lacks; positions that are not its sinusoids."""
    c, state = d.config, d.state
    layers = _layer_keys(c)
    out = []
    missing = sorted(layers - set(state))
    if missing:
        out.append(f"{len(missing)} weights missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    extra = sorted(set(state) - layers - set(EMBEDDING_KEYS) - set(POSITION_KEYS))
    if extra:
        out.append(f"weights MarianMTModel does not have: {', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}")
    D = c["d_model"]
    for key in POSITION_KEYS:
        if key in state and D % 2 == 0:
            table = sinusoidal_table(state[key].size(0), D)[:, model_permutation(D)]
            if state[key].shape != table.shape or not torch.allclose(state[key], table, atol=1e-4):
                out.append(f"{key} is not Marian's sinusoidal table (learned positions?)")
    return out


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
    if tie_out:
        return enc, dec, dec
    if "lm_head.weight" not in s:
        raise UserError(f"{d.path}: tie_word_embeddings is false and there is no lm_head.weight")
    return enc, dec, s["lm_head.weight"]


def id_orders(d: MarianDir, src_rows: int, tgt_rows: int) -> tuple[list[int], list[int]]:
    """The Marian id of each aiayn id, source and target side (``marian_vocab.id_order``)."""
    c, t = d.config, d.tokens
    for side, vocab in (("vocab.json", d.src_vocab), ("target vocabulary", d.tgt_vocab)):
        if t["unk"] not in vocab or t["eos"] not in vocab:
            raise UserError(f"{d.path}: {side} lacks {t['unk']} or {t['eos']}")
    tgt = Specials(pad=c["pad_token_id"], unk=d.tgt_vocab[t["unk"]], start=c["decoder_start_token_id"],
                   eos=c["eos_token_id"])
    tgt_order = id_order(d.tgt_vocab, tgt, tgt_rows, f"{d.path}: the target vocabulary")
    if d.src_vocab is d.tgt_vocab:
        if d.src_vocab[t["eos"]] != tgt.eos:
            raise UserError(f"{d.path}: the tokenizer ends a source with {t['eos']} = {d.src_vocab[t['eos']]}, "
                            f"the model's eos_token_id is {tgt.eos}")
        return tgt_order, tgt_order
    pad = d.src_vocab.get(t["pad"], c["pad_token_id"])
    start = {i: p for p, i in d.tgt_vocab.items()}.get(tgt.start)  # a source never holds it: its row, if any
    src = Specials(pad=pad, unk=d.src_vocab[t["unk"]], start=d.src_vocab.get(start, pad), eos=d.src_vocab[t["eos"]])
    return id_order(d.src_vocab, src, src_rows, f"{d.path}: vocab.json"), tgt_order


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


def _tokenizers(d: MarianDir, src_order: list[int], tgt_order: list[int]) -> dict:
    """The checkpoint's ``tokenizers`` entry: each side's SentencePiece model in aiayn's ids (``marian_vocab``)."""
    models = {}
    for side, vocab, order, source in (("src", d.src_vocab, src_order, True), ("tgt", d.tgt_vocab, tgt_order, False)):
        name = f"{d.path / ('source.spm' if source else 'target.spm')}"
        seg = segmenter(d.spm[side], aiayn_pieces(vocab, order), source=source, name=name)
        if seg.dropped:
            log.warning("%s: %d of its pieces are not in the vocabulary (transformers writes <unk> for them; aiayn "
                        "segments around them), e.g. %s", name, len(seg.dropped), ", ".join(seg.dropped[:5]))
        log.info("%s: %d pieces in aiayn's ids, %d of them only the other side produces", name, len(order), seg.foreign)
        models[side] = seg.model
    from aiayn.data.vocab import Tokenizer
    toks = {side: Tokenizer(m) for side, m in models.items()}
    return {"src": models["src"], "tgt": models["tgt"], "src_sha256": toks["src"].sha256,
            "tgt_sha256": toks["tgt"].sha256, "shared": models["src"] == models["tgt"]}


def _generation_notes(d: MarianDir) -> None:
    """Say which of transformers' generation settings the checkpoint does not carry."""
    path = d.path / "generation_config.json"
    g = _read_json(path) if path.is_file() else {}
    aiayns = ([d.config["pad_token_id"]], [d.config["decoder_start_token_id"]])  # aiayn's search bans these
    banned = [ids for ids in g.get("bad_words_ids") or d.config.get("bad_words_ids") or [] if ids not in aiayns]
    if banned:
        log.warning("%s bans %s besides <pad>: aiayn's search does not (it bans <pad> and the decoder's start)",
                    path.name, banned)
    if g:
        log.info("transformers' generation settings (not carried): num_beams %s, length_penalty %s, max_length %s; "
                 "aiayn translate's --alpha 0 is length_penalty 0", g.get("num_beams", 1), g.get("length_penalty", 1.0),
                 g.get("max_length"))


def import_hf(path: str | Path) -> dict:
    """The aiayn checkpoint dict of the Marian directory ``path`` (module docstring); refused with
    every difference named when aiayn's model cannot compute what Marian's does."""
    from aiayn.checkpoint import FORMAT
    from aiayn.config import to_dict
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
    cfg = model_config(c, len(src_order), None if joint else len(tgt_order),
                       tie_src_tgt=joint and torch.equal(enc[src_order], dec[tgt_order]),
                       tie_out=torch.equal(out_w, dec), bias=bias is not None and bool(bias.any()))
    model = Transformer(cfg)
    model.load_state_dict(aiayn_state(d, cfg, src_order, tgt_order, enc, dec, out_w))
    _generation_notes(d)
    log.info("imported %s: %d+%d layers, d_model %d, h %d, d_ff %d, activation %s, vocabulary %d%s, output bias %s",
             d.path, cfg.n_layers, cfg.decoder_layers, cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.activation,
             cfg.vocab_size, "" if joint else f"/{cfg.target_vocab_size}", cfg.output_bias)
    return {"format": FORMAT, "run_config": to_dict(RunConfig(model=cfg)), "model_config": to_dict(cfg),
            "model": model.state_dict(), "tokenizers": _tokenizers(d, src_order, tgt_order),
            "step": 0, "epoch": 0, "imported_from": {"format": "hf", "path": str(d.path)}}
