"""A checkpoint as a CTranslate2 model, for serving with its C++ runtime (``aiayn export``).

    aiayn export --checkpoint runs/demo/model.pt --out runs/demo/ct2 [--quantization int8]

then, in Python (``pip install ctranslate2``, or ``aiayn[ct2]``):

    translator = ctranslate2.Translator("runs/demo/ct2")
    pieces = sp.encode(line, out_type=str) + ["</s>"]        # sp: the model's SentencePiece
    out = translator.translate_batch([pieces], beam_size=4, length_penalty=1.4)

The mapping (CTranslate2's ``TransformerSpec``; every weight copied, nothing re-trained):
- embeddings scaled by sqrt(d_model) (§3.4) and our own positional table, sinusoids interleaved
  as §3.5 writes them (sin on even, cos on odd dimensions) or learned (Table 3 row E);
  CTranslate2's default sinusoids are laid out differently, so the table is always written;
- self-attention as one fused QKV projection, encoder-decoder attention as Q plus fused KV,
  then W^O (§3.2.2), with their biases or zero ones (``attn_bias`` false: §3.2.2's matrices alone);
  FFN (Eq. 2); LayerNorm epsilon from the model;
- post-norm (the paper) or pre-norm with a final LayerNorm per stack (``pre_norm``);
- the FFN's activation (Eq. 2's ReLU, or ``activation`` gelu / swish);
- the pre-softmax projection is the target embedding when tied (§3.4), with the model's
  ``output_bias`` or a zero bias.
- vocabulary: the SentencePiece pieces, ids unchanged (<pad> 0, <unk> 1, <s> 2, </s> 3); the
  decoder starts from <s> (BOS) and the source ends with </s> (EOS), as in aiayn's batches.
The folder is built beside ``--out`` and put in place whole; an existing ``--out`` must be empty
or, with ``--overwrite``, an earlier export (``ExportDir``). Limits: d_k = d_v = d_model / h (CTranslate2 splits d_model across heads), one vocabulary
(shared) or two (separate); ``tests/interop/test_ct2_export.py`` checks that CTranslate2's greedy and beam
outputs equal aiayn's.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from aiayn.errors import UserError
from aiayn.interop.export_dir import ExportDir
from aiayn.model import Transformer

log = logging.getLogger(__name__)


def _require_ct2():
    try:
        import ctranslate2  # noqa: F401
    except ImportError as exc:
        raise UserError("aiayn export needs CTranslate2: pip install ctranslate2 (or aiayn[ct2])") from exc
    return ctranslate2


def _np(t: torch.Tensor):
    return t.detach().to(torch.float32).cpu().contiguous().numpy()


def _linear(spec, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    spec.weight = _np(weight)
    spec.bias = _np(bias if bias is not None else torch.zeros(weight.size(0)))


def _norm(spec, ln: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _np(ln.weight), _np(ln.bias)


def _attention(spec, projections: list[torch.nn.Linear], conn) -> None:
    """An attention sub-layer: its projections in CTranslate2's order (fused QKV, W^O; or Q,
    fused KV, W^O) and the LayerNorm of its residual connection."""
    for linear_spec, lin in zip(spec.linear, projections, strict=True):
        _linear(linear_spec, lin.weight, lin.bias)
    _norm(spec.layer_norm, conn.norm)


def _ffn(spec, ffn, conn) -> None:
    """The FFN sub-layer (Eq. 2) and the LayerNorm of its residual connection."""
    _linear(spec.linear_0, ffn.w1.weight, ffn.w1.bias)
    _linear(spec.linear_1, ffn.w2.weight, ffn.w2.bias)
    _norm(spec.layer_norm, conn.norm)


def transformer_spec(model: Transformer, src_tokens: list[str], tgt_tokens: list[str]):
    """CTranslate2 ``TransformerSpec`` holding ``model``'s weights (module docstring)."""
    from ctranslate2.specs import common_spec, transformer_spec as ts

    cfg = model.cfg
    if cfg.d_k * cfg.n_heads != cfg.d_model or cfg.d_v != cfg.d_k:
        raise UserError(f"CTranslate2 needs d_k = d_v = d_model / h; this model has d_model {cfg.d_model}, "
                        f"h {cfg.n_heads}, d_k {cfg.d_k}, d_v {cfg.d_v}")
    spec = ts.TransformerSpec.from_config((cfg.n_layers, cfg.decoder_layers), cfg.n_heads,
                                          pre_norm=cfg.pre_norm, activation=getattr(common_spec.Activation, {
                                              "relu": "RELU", "gelu": "GELU", "swish": "SWISH"}[cfg.activation]))
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    enc, dec = spec.encoder, spec.decoder
    n_pos = cfg.max_positions
    enc.embeddings[0].weight = _np(model.src_embed.weight)
    dec.embeddings.weight = _np(model.tgt_embed.weight)
    enc.scale_embeddings = dec.scale_embeddings = bool(cfg.scale_embeddings)
    enc.position_encodings.encodings = _np(model.src_pos(0, n_pos))  # (n_pos, D), as the model adds them
    dec.position_encodings.encodings = _np(model.tgt_pos(0, n_pos))
    if cfg.pre_norm:
        _norm(enc.layer_norm, model.encoder_norm)
        _norm(dec.layer_norm, model.decoder_norm)
    for layer_spec, layer in zip(enc.layer, model.encoder_layers):
        _attention(layer_spec.self_attention, [layer.self_attn.qkv_proj, layer.self_attn.out_proj], layer.conn_attn)
        _ffn(layer_spec.ffn, layer.ffn, layer.conn_ffn)
    for layer_spec, layer in zip(dec.layer, model.decoder_layers):
        sa, ca = layer.self_attn, layer.cross_attn
        _attention(layer_spec.self_attention, [sa.qkv_proj, sa.out_proj], layer.conn_self)
        _attention(layer_spec.attention, [ca.q_proj, ca.kv_proj, ca.out_proj], layer.conn_cross)
        _ffn(layer_spec.ffn, layer.ffn, layer.conn_ffn)
    out_weight = model.tgt_embed.weight if model.out_proj is None else model.out_proj.weight
    _linear(dec.projection, out_weight, model.out_bias)
    spec.register_source_vocabulary(src_tokens)
    spec.register_target_vocabulary(tgt_tokens)
    return spec


def write_ct2(model: Transformer, src_tokens: list[str], tgt_tokens: list[str], folder: str | Path,
              quantization: str | None = None) -> None:
    """CTranslate2's model files for ``model`` in the existing folder ``folder`` (what its
    converter does, without its deletion of the folder first)."""
    _require_ct2()
    with torch.no_grad():
        spec = transformer_spec(model, src_tokens, tgt_tokens)
    spec.validate()
    spec.optimize(quantization=quantization)
    spec.save(str(folder))


def export_ct2(model: Transformer, src_tokens: list[str], tgt_tokens: list[str], out: str | Path,
               quantization: str | None = None, *, overwrite: bool = False,
               files: dict[str, bytes] | None = None) -> Path:
    """Write ``model`` as a CTranslate2 model directory ``out`` (``ExportDir``: an earlier export
    there is replaced only with ``overwrite``), with ``files`` (name -> bytes) beside its own."""
    _require_ct2()
    with ExportDir(out, overwrite) as tmp:
        write_ct2(model, src_tokens, tgt_tokens, tmp, quantization)
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
    return Path(out)


def pieces(tokenizer) -> list[str]:
    """The tokenizer's vocabulary as piece strings, by id."""
    return [tokenizer.piece(i) for i in range(tokenizer.vocab_size)]
