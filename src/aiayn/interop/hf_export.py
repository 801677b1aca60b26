"""``aiayn export --format hf``: a checkpoint as a Hugging Face ``MarianMTModel`` directory.

    aiayn export --format hf --checkpoint runs/demo/model.pt --out runs/demo/hf

then ``MarianMTModel.from_pretrained(DIR)`` and ``MarianTokenizer.from_pretrained(DIR)`` (or
``pipeline("translation", model=DIR)``) load it. Every weight is copied; nothing is re-trained.

Marian (transformers' ``MarianMTModel``) is the paper's architecture with these conventions,
each checked here:
- post-norm layers (§3.1) with biases everywhere (zeros for the attention projections of a model
  without them, §3.2.2's, ``attn_bias`` false), no final LayerNorm per stack: a pre-norm
  model (``pre_norm``) cannot be written; the FFN's activation is Eq. 2's ReLU or the model's
  ``activation`` (gelu, swish: Marian's names too);
- attention splits d_model across the heads (head size d_model / h): a model whose d_k or d_v
  is not d_model / h (Table 3 rows A, B) cannot be written;
- sinusoidal positions only (a model with learned positions, Table 3 row E, cannot be written),
  starting at position 0 as ours, with the same frequencies 10000^(-2i/d_model) but laid out
  concatenated (sin in the first half of the dimensions, cos in the second) where §3.5 and
  aiayn interleave them (sin on even, cos on odd dimensions). A permutation of the d_model
  dimensions maps one onto the other, and every layer is equivariant to it (the embeddings, the
  input columns and output rows of each linear map, the LayerNorm gains and biases are
  permuted alike; LayerNorm's mean and variance do not depend on the order), so the exported
  model computes the same function with Marian's table (``model_permutation``);
- embeddings scaled by sqrt(d_model) (§3.4) or not (``scale_embedding``), the pre-softmax
  projection tied to the target embedding (§3.4) or the model's own (``tie_embeddings`` false:
  Marian's ``lm_head`` with ``tie_word_embeddings`` false) plus Marian's
  final-logits bias: the model's ``output_bias``, or zeros; one shared vocabulary with one
  shared matrix (§3.4), or separate source and target vocabularies or matrices
  (``share_encoder_decoder_embeddings`` false, ``target_vocab.json``);
- LayerNorm epsilon: Marian's is fixed at PyTorch's 1e-5 (aiayn's default 1e-6, tensor2tensor's);
  the exported model's logits differ from aiayn's by about 1e-5 (measured in the test), which
  changes no translation of the tested model;
- ids: aiayn's SentencePiece ids are kept (<pad> 0, <unk> 1, <s> 2, </s> 3); the decoder starts
  from <s> (``decoder_start_token_id``), the source ends with </s> (MarianTokenizer appends it);
  pad and <s> are never generated (``bad_words_ids``), as in aiayn's search.
Search differences: transformers divides a beam's log-probability by |Y|^length_penalty, aiayn by
the GNMT ((5 + |Y|) / 6)^α, so scores agree only at α = length_penalty = 0; transformers keeps K
live beams after one finishes (top 2K candidates) where aiayn refills from the live ones, so beam
outputs can differ on close calls; greedy outputs are the same.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from aiayn.errors import UserError
from aiayn.interop.export_dir import RECORD, ExportDir
from aiayn.model import ModelConfig, Transformer

log = logging.getLogger(__name__)
MARIAN_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which MarianMTModel uses


def require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise UserError("aiayn export --format hf needs transformers: pip install transformers") from exc
    return transformers


def marian_refusals(cfg: ModelConfig) -> list[str]:
    """Why Marian cannot express ``cfg`` (empty when it can)."""
    out = []
    if cfg.d_k * cfg.n_heads != cfg.d_model or cfg.d_v != cfg.d_k:
        out.append(f"Marian's heads split d_model (d_k = d_v = d_model / h); this model has d_model {cfg.d_model}, "
                   f"h {cfg.n_heads}, d_k {cfg.d_k}, d_v {cfg.d_v}")
    if cfg.pre_norm:
        out.append("Marian is post-norm (LN(x + F(x)), §3.1) without a final LayerNorm per stack; this model is "
                   "pre-norm (pre_norm)")
    if cfg.learned_positions:
        out.append("Marian has sinusoidal positions only; this model learned its positions (learned_positions)")
    return out


def model_permutation(d_model: int) -> torch.Tensor:
    """The order of aiayn's d_model dimensions in the exported model: even ones (sin) then odd ones
    (cos), which turns §3.5's interleaved table into Marian's concatenated one. (D,) int64."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def marian_config(cfg: ModelConfig, **special_ids):
    """The ``MarianConfig`` of ``cfg`` (``marian_refusals`` must be empty); ``special_ids`` replace the
    pad / BOS / EOS / decoder-start / forced-EOS ids taken from ``cfg`` (bench/marian.py passes Marian's own)."""
    from transformers import MarianConfig

    shared = cfg.tie_src_tgt_embeddings
    ids = dict(pad_token_id=cfg.pad_id, bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id,
               decoder_start_token_id=cfg.bos_id, forced_eos_token_id=None)
    ids.update(special_ids)
    return MarianConfig(
        vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.target_vocab_size, d_model=cfg.d_model,
        encoder_layers=cfg.n_layers, decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, activation_function=cfg.activation,
        dropout=cfg.p_drop, attention_dropout=cfg.p_drop_attn, activation_dropout=cfg.p_drop_ffn,
        max_position_embeddings=cfg.max_positions, scale_embedding=cfg.scale_embeddings,
        share_encoder_decoder_embeddings=shared, tie_word_embeddings=cfg.tie_embeddings, **ids)


def marian_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """``model``'s weights under MarianMTModel's names, d_model dimensions permuted (``model_permutation``)."""
    cfg = model.cfg
    P = model_permutation(cfg.d_model)
    hk = cfg.n_heads * cfg.d_k
    out: dict[str, torch.Tensor] = {}

    def linear(name: str, weight: torch.Tensor, bias: torch.Tensor, d_in: bool, d_out: bool) -> None:
        w, b = weight, bias
        if d_in:
            w = w[:, P]  # input columns in the exported order
        if d_out:
            w, b = w[P], b[P]
        out[f"{name}.weight"], out[f"{name}.bias"] = w, b

    def bias(lin: torch.nn.Linear) -> torch.Tensor:  # Marian's maps all have one: zeros for a matrix alone
        return lin.bias if lin.bias is not None else torch.zeros(lin.out_features)

    def norm(name: str, ln: torch.nn.LayerNorm) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = ln.weight[P], ln.bias[P]

    def attention(name: str, q: tuple, k: tuple, v: tuple, o: torch.nn.Linear) -> None:
        for proj, (w, b) in zip("qkv", (q, k, v)):
            linear(f"{name}.{proj}_proj", w, b, d_in=True, d_out=False)
        linear(f"{name}.out_proj", o.weight, bias(o), d_in=False, d_out=True)

    def self_attention(name: str, mha) -> None:
        w, b = mha.qkv_proj.weight, bias(mha.qkv_proj)  # q, k, v stacked (self-attention's fused projection)
        attention(name, (w[:hk], b[:hk]), (w[hk:2 * hk], b[hk:2 * hk]), (w[2 * hk:], b[2 * hk:]), mha.out_proj)

    def ffn(name: str, layer) -> None:
        linear(f"{name}.fc1", layer.ffn.w1.weight, layer.ffn.w1.bias, d_in=True, d_out=False)
        linear(f"{name}.fc2", layer.ffn.w2.weight, layer.ffn.w2.bias, d_in=False, d_out=True)

    for i, layer in enumerate(model.encoder_layers):
        name = f"model.encoder.layers.{i}"
        self_attention(f"{name}.self_attn", layer.self_attn)
        norm(f"{name}.self_attn_layer_norm", layer.conn_attn.norm)
        ffn(name, layer)
        norm(f"{name}.final_layer_norm", layer.conn_ffn.norm)
    for i, layer in enumerate(model.decoder_layers):
        name = f"model.decoder.layers.{i}"
        self_attention(f"{name}.self_attn", layer.self_attn)
        norm(f"{name}.self_attn_layer_norm", layer.conn_self.norm)
        ca = layer.cross_attn
        kw, kb = ca.kv_proj.weight, bias(ca.kv_proj)
        attention(f"{name}.encoder_attn", (ca.q_proj.weight, bias(ca.q_proj)), (kw[:hk], kb[:hk]),
                  (kw[hk:], kb[hk:]), ca.out_proj)
        norm(f"{name}.encoder_attn_layer_norm", layer.conn_cross.norm)
        ffn(name, layer)
        norm(f"{name}.final_layer_norm", layer.conn_ffn.norm)
    src, tgt = model.src_embed.weight[:, P], model.tgt_embed.weight[:, P]
    if cfg.tie_src_tgt_embeddings:
        out["model.shared.weight"] = src
    out["model.encoder.embed_tokens.weight"] = src
    out["model.decoder.embed_tokens.weight"] = out["lm_head.weight"] = tgt
    if model.out_proj is not None:  # untied (tie_embeddings false): Marian's lm_head of its own
        out["lm_head.weight"] = model.out_proj.weight[:, P]
    bias = model.out_bias if model.out_bias is not None else torch.zeros(cfg.target_vocab_size)
    out["final_logits_bias"] = bias[None]  # (1, V)
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def marian_model(model: Transformer):
    """A ``MarianMTModel`` (eval mode) computing what ``model`` computes (module docstring)."""
    from transformers import MarianMTModel

    refusals = marian_refusals(model.cfg)
    if refusals:
        raise UserError("cannot export to Marian: " + "; ".join(refusals))
    hf = MarianMTModel(marian_config(model.cfg))
    state = marian_state_dict(model)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if "embed_positions" not in k]
    if missing or unexpected:
        raise RuntimeError(f"Marian weights not matched: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def _vocab(tokenizer) -> dict[str, int]:
    return {tokenizer.piece(i): i for i in range(tokenizer.vocab_size)}


def export_hf(model: Transformer, src_tok, tgt_tok, out: str | Path, *, overwrite: bool = False,
              files: dict[str, bytes] | None = None) -> Path:
    """Write ``model`` and its tokenizers as a Hugging Face Marian directory ``out``
    (``ExportDir``: an earlier export there is replaced only with ``overwrite``),
    with ``files`` (name -> bytes) beside them."""
    require_transformers()
    cfg = model.cfg
    if cfg.layer_norm_eps != MARIAN_LAYER_NORM_EPS:
        log.warning("LayerNorm epsilon: Marian's is %g, this model's %g; the logits differ slightly (about 1e-5)",
                    MARIAN_LAYER_NORM_EPS, cfg.layer_norm_eps)
    hf = marian_model(model)
    files = {RECORD: (json.dumps({"format": "hf", "decode": {}}) + "\n").encode(), **(files or {})}  # aiayn's defaults
    with ExportDir(out, overwrite) as tmp:
        _write_hf(hf, cfg, src_tok, tgt_tok, tmp)
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
    return Path(out)


def _write_hf(hf, cfg, src_tok, tgt_tok, out: Path) -> None:
    """The Marian model ``hf``, its generation settings and the tokenizers' files into the folder ``out``."""
    from transformers import GenerationConfig, MarianTokenizer

    hf.generation_config = GenerationConfig(
        decoder_start_token_id=cfg.bos_id, bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id, pad_token_id=cfg.pad_id,
        bad_words_ids=[[cfg.pad_id], [cfg.bos_id]], num_beams=4, max_length=cfg.max_positions)
    hf.save_pretrained(out)
    (out / "source.spm").write_bytes(src_tok.model_bytes)
    (out / "target.spm").write_bytes(tgt_tok.model_bytes)
    separate = not cfg.tie_src_tgt_embeddings
    (out / "vocab.json").write_text(json.dumps(_vocab(src_tok), ensure_ascii=False), encoding="utf-8")
    if separate:
        (out / "target_vocab.json").write_text(json.dumps(_vocab(tgt_tok), ensure_ascii=False), encoding="utf-8")
    tok = MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json"),
                          target_vocab_file=str(out / "target_vocab.json") if separate else None,
                          separate_vocabs=separate, model_max_length=cfg.max_positions)
    tok.save_pretrained(out)
