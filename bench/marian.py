"""The rivals, built from the same ``aiayn.ModelConfig`` as the aiayn model they race.

- Hugging Face ``MarianMTModel`` (transformers): random weights, same d_model, layers, heads,
  d_ff, vocabulary and dropout; post-norm, shared and tied embeddings, sinusoidal positions,
  scaled embeddings (Marian's own conventions: pad = last id, EOS = 0, the decoder starts from
  the zero pad embedding).
- CTranslate2: the same Marian model saved with ``save_pretrained`` and converted by
  CTranslate2's own ``TransformersConverter``; the converter's tokenizer is replaced by the
  plain vocabulary list (no sentencepiece model, no downloads), since we feed token strings.

Differences in architecture that do not change the arithmetic: Marian has a final-logits bias
(V adds per token) and no pre-norm option (the aiayn "multi30k" preset is pre-norm: one extra
LayerNorm per stack).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from aiayn import ModelConfig

MARIAN_EOS, MARIAN_UNK = 0, 1


def marian_pad(cfg: ModelConfig) -> int:
    return cfg.vocab_size - 1  # Marian convention: pad is the last id


def marian_config(cfg: ModelConfig):
    """A MarianConfig with the shapes of ``cfg`` (d_k = d_model / heads must hold for Marian): the
    exporter's (``aiayn.interop.hf_export.marian_config``) with Marian's own special ids."""
    from aiayn.interop.hf_export import marian_config as exported

    if cfg.n_heads * cfg.d_k != cfg.d_model or cfg.d_k != cfg.d_v:
        raise ValueError(f"Marian needs d_k = d_v = d_model / n_heads; got d_k={cfg.d_k}, d_v={cfg.d_v}")
    pad = marian_pad(cfg)
    return exported(cfg, pad_token_id=pad, bos_token_id=None, eos_token_id=MARIAN_EOS, decoder_start_token_id=pad,
                    forced_eos_token_id=MARIAN_EOS)


def build_marian(cfg: ModelConfig, seed: int = 0):
    """MarianMTModel with random weights; the pad row of the shared embedding zeroed (the
    decoder starts from it, and CTranslate2 assumes a zero start embedding)."""
    from transformers import MarianMTModel

    torch.manual_seed(seed)
    model = MarianMTModel(marian_config(cfg))
    with torch.no_grad():
        model.model.shared.weight[marian_pad(cfg)].zero_()
    return model


def marian_tokens(cfg: ModelConfig) -> list[str]:
    """Token strings of the Marian vocabulary: w<i>, with </s>, <unk> and <pad> at their ids."""
    toks = [f"w{i}" for i in range(cfg.vocab_size)]
    toks[MARIAN_EOS], toks[MARIAN_UNK], toks[marian_pad(cfg)] = "</s>", "<unk>", "<pad>"
    return toks


class _VocabOnly:
    """What the converter's Marian loader reads from a tokenizer: the vocabulary and two tokens."""

    eos_token, unk_token = "</s>", "<unk>"

    def __init__(self, tokens: list[str]):
        self.tokens = tokens

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}


def convert_to_ct2(model, cfg: ModelConfig, workdir: Path, quantization: str | None = None) -> Path:
    """save_pretrained + ctranslate2.converters.TransformersConverter -> a CTranslate2 model dir."""
    import ctranslate2

    tokens = marian_tokens(cfg)

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return _VocabOnly(tokens)

    hf_dir, ct2_dir = workdir / "hf", workdir / "ct2"
    shutil.rmtree(hf_dir, ignore_errors=True)
    model.save_pretrained(hf_dir)
    Converter(str(hf_dir)).convert(str(ct2_dir), quantization=quantization, force=True)
    return ct2_dir
