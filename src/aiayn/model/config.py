"""ModelConfig and the paper's named configurations (Table 3, Table 4).

Presets are plain data: a dict of field overrides on top of ``base``. ``get_preset`` is the
one way to turn a name into a ``ModelConfig``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from aiayn.config import ConfigError, did_you_mean, param, replace

ACTIVATIONS = ("relu", "gelu", "swish")  # ModelConfig.activation (aiayn.model.layers.FeedForward)


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of the Transformer (§3, Table 3). Defaults are the base model."""

    vocab_size: int = param(37000, "size of the shared source-target vocabulary (§5.1: about 37,000 for WMT14 En-De); training takes the data directory's (aiayn prepare --vocab-size)")
    tgt_vocab_size: int | None = param(None, "target vocabulary size when vocabularies are separate (needs tie_src_tgt_embeddings=false); None means same as vocab_size; training takes the data directory's")
    n_layers: int = param(6, "N, identical layers in each of the encoder and decoder stacks (§3.1)")
    n_dec_layers: int | None = param(None, "decoder layers if different from n_layers (a deviation; None = n_layers)")
    d_model: int = param(512, "d_model, width of every sub-layer output and embedding (§3.1)")
    d_ff: int = param(2048, "d_ff, inner size of the position-wise feed-forward network (Eq. 2)")
    n_heads: int = param(8, "h, parallel attention heads (§3.2.2)")
    d_k: int = param(64, "d_k, query/key width per head; independent of d_model/h (Table 3 rows A, B)")
    d_v: int = param(64, "d_v, value width per head (§3.2.2)")
    p_drop: float = param(0.1, "P_drop, residual dropout on sub-layer outputs and on embeddings+positions (§5.4)")
    p_drop_attn: float = param(0.0, "dropout on attention weights (not in the paper; tensor2tensor and fairseq offer it)")
    p_drop_ffn: float = param(0.0, "dropout after the FFN ReLU (not in the paper; fairseq's activation_dropout)")
    activation: str = param("relu", "the FFN's nonlinearity: relu is Eq. 2's max(0, .); gelu (erf form) and swish "
                                    "(x * sigmoid(x), OPUS-MT's Marian models) are not in the paper (aiayn import)")
    pre_norm: bool = param(False, "pre-norm x + Dropout(F(LN(x))) plus a final LayerNorm per stack, instead of the paper's post-norm LN(x + Dropout(F(x))) (§3.1)")
    learned_positions: bool = param(False, "learned positional embeddings instead of sinusoids (Table 3 row E)")
    max_positions: int = param(1024, "longest sequence the positional encoding covers (a hard limit only for learned positions)")
    tie_embeddings: bool = param(True, "share the target embedding with the pre-softmax projection (§3.4)")
    attn_bias: bool = param(False, "biases on the attention projections W^Q, W^K, W^V, W^O; §3.2.2's are matrices (tensor2tensor has none), fairseq and Marian add them")
    output_bias: bool = param(False, "a learned bias on the pre-softmax projection (Marian's final_logits_bias); §3.4's has none")
    tie_src_tgt_embeddings: bool = param(True, "share source and target embeddings (§3.4; needs a shared vocabulary)")
    scale_embeddings: bool = param(True, "multiply embeddings by sqrt(d_model) (§3.4)")
    layer_norm_eps: float = param(1e-6, "epsilon inside LayerNorm (tensor2tensor uses 1e-6)")
    pad_id: int = param(0, "padding token id (never attended to, never predicted)")
    bos_id: int = param(2, "beginning-of-sentence id, the decoder's first input")
    eos_id: int = param(3, "end-of-sentence id")

    def __post_init__(self) -> None:
        if self.d_model <= 0 or self.n_heads <= 0 or self.d_k <= 0 or self.d_v <= 0:
            raise ConfigError("d_model, n_heads, d_k and d_v must be positive")
        for name in ("p_drop", "p_drop_attn", "p_drop_ffn"):  # (else torch's error at the first training step)
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 < self.layer_norm_eps < 1.0:  # (NaN or <= 0: LayerNorm's outputs NaN, silently)
            raise ConfigError(f"layer_norm_eps must be in (0, 1), got {self.layer_norm_eps}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.tgt_vocab_size is not None and self.tie_src_tgt_embeddings and self.tgt_vocab_size != self.vocab_size:
            raise ConfigError("separate vocabularies (tgt_vocab_size != vocab_size) need tie_src_tgt_embeddings=false")
        check_limits({f.name: getattr(self, f.name) for f in fields(self)})  # what every load of it checks

    @property
    def target_vocab_size(self) -> int:
        return self.tgt_vocab_size if self.tgt_vocab_size is not None else self.vocab_size

    @property
    def decoder_layers(self) -> int:
        return self.n_dec_layers if self.n_dec_layers is not None else self.n_layers


# Bounds on the fields that size allocations, checked on every configuration a checkpoint
# carries before any model is built from it (``check_limits``): far above any model of the
# paper (big: d_model 1024, d_ff 4096, 16 heads, 6 layers), far below what would exhaust memory.
LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (4, 1 << 21), "tgt_vocab_size": (4, 1 << 21), "n_layers": (1, 256), "n_dec_layers": (1, 256),
    "d_model": (1, 1 << 16), "d_ff": (1, 1 << 20), "n_heads": (1, 1024), "d_k": (1, 1 << 16), "d_v": (1, 1 << 16),
    "max_positions": (1, 1 << 20),
}
MAX_TABLE_VALUES = 1 << 28  # max_positions x d_model: the sinusoid table (1 GiB in float32), built, not stored


def check_limits(data: dict) -> None:
    """A ConfigError naming the first field of ``data`` (a ModelConfig as a dict, from a file)
    outside ``LIMITS``, or a positional table over ``MAX_TABLE_VALUES``; absent fields pass."""
    for name, (lo, hi) in LIMITS.items():
        value = data.get(name)
        if value is None and name in ("tgt_vocab_size", "n_dec_layers"):
            continue
        if name in data and not (type(value) is int and lo <= value <= hi):
            why = "outside" if isinstance(value, (int, float)) and not lo <= value <= hi else "expected an int in"
            raise ConfigError(f"{name} = {value!r}: {why} [{lo:,}, {hi:,}]")
    vocab = min(data.get("vocab_size", 4), data.get("tgt_vocab_size") or data.get("vocab_size", 4))
    for name in ("pad_id", "bos_id", "eos_id"):
        if name in data and not (type(data[name]) is int and 0 <= data[name] < vocab):
            raise ConfigError(f"{name} = {data[name]!r}: not an id of the vocabulary of {vocab}")
    positions, width = data.get("max_positions", 1), data.get("d_model", 1)
    if positions * width > MAX_TABLE_VALUES:
        raise ConfigError(f"max_positions = {positions:,}: its table of max_positions x d_model = "
                          f"{positions * width:,} values exceeds {MAX_TABLE_VALUES:,}")


# Table 3 of the paper: each row changes base in the columns it fills. "big" is the last row;
# "parsing" is §6.3 (4 layers, d_model 1024, "all other parameters" as base: d_ff 2048, h 8, d_k = d_model/h
# as in row C5). "tiny" is ours, for smoke runs and tests. "multi30k" is ours: the small, heavily regularized
# model ``aiayn demo`` trains on Multi30k on a CPU (docs/recipe.md), with the attention biases it was measured with.
PRESETS: dict[str, dict] = {
    "base": {},
    "A1": {"n_heads": 1, "d_k": 512, "d_v": 512},
    "A2": {"n_heads": 4, "d_k": 128, "d_v": 128},
    "A3": {"n_heads": 16, "d_k": 32, "d_v": 32},
    "A4": {"n_heads": 32, "d_k": 16, "d_v": 16},
    "B1": {"d_k": 16},
    "B2": {"d_k": 32},
    "C1": {"n_layers": 2},
    "C2": {"n_layers": 4},
    "C3": {"n_layers": 8},
    "C4": {"d_model": 256, "d_k": 32, "d_v": 32},
    "C5": {"d_model": 1024, "d_k": 128, "d_v": 128},
    "C6": {"d_ff": 1024},
    "C7": {"d_ff": 4096},
    "D1": {"p_drop": 0.0},
    "D2": {"p_drop": 0.2},
    "D3": {},  # eps_ls = 0.0: a training setting (TrainConfig.eps_ls), same model as base
    "D4": {},  # eps_ls = 0.2: a training setting
    "E": {"learned_positions": True},
    "big": {"d_model": 1024, "d_ff": 4096, "n_heads": 16, "d_k": 64, "d_v": 64, "p_drop": 0.3},
    "parsing": {"n_layers": 4, "d_model": 1024, "d_k": 128, "d_v": 128, "vocab_size": 16000},
    "tiny": {"n_layers": 2, "d_model": 64, "d_ff": 256, "n_heads": 4, "d_k": 16, "d_v": 16},
    "multi30k": {"n_layers": 3, "d_model": 256, "d_ff": 1024, "n_heads": 4, "d_k": 64, "d_v": 64,
                 "p_drop": 0.3, "pre_norm": True, "vocab_size": 8000, "attn_bias": True},
}

# Training settings that Table 3 rows change (label smoothing in D3/D4, steps in big); the
# training recipe reads these so that `--preset D3` means the whole row.
PRESET_TRAIN: dict[str, dict] = {
    "D3": {"eps_ls": 0.0},
    "D4": {"eps_ls": 0.2},
    "big": {"max_steps": 300_000},
}

# The paper's parameter counts (Table 3, millions) for the rows that give one.
PAPER_PARAMS_M: dict[str, float] = {
    "base": 65, "big": 213, "B1": 58, "B2": 60, "C1": 36, "C2": 50, "C3": 80,
    "C4": 28, "C5": 168, "C6": 53, "C7": 90,
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """The ModelConfig of a named configuration, with field overrides (unknown fields are errors)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}{did_you_mean(name, PRESETS)}")
    return replace(ModelConfig(), **{**PRESETS[name], **overrides})
