"""The model of §3. Shape glossary: B batch, S source length, T target length, D d_model,
H heads, K d_k, Dv d_v, V vocabulary, N decoding rows (sentences x beams)."""
from aiayn.model.config import PRESETS, ModelConfig, get_preset
from aiayn.model.transformer import (DecoderOutput, EncoderOutput, PreSoftmax, Transformer, count_parameters,
                                     count_preset_parameters)

__all__ = ["DecoderOutput", "EncoderOutput", "ModelConfig", "PRESETS", "PreSoftmax", "Transformer",
           "count_parameters", "count_preset_parameters", "get_preset"]
