"""DecodeConfig: how a checkpoint turns source sentences into translations (§6.1).

Defaults are the paper's: beam size 4, length penalty α = 0.6, maximum output length
= input length + 50, terminating early when possible.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from aiayn.config import ConfigError, param, replace
from aiayn.execution.linear import MAX_ROW_BITS, ROW_BITS


PACKED_LIBRARIES = ("mkl", "onednn")  # DecodeConfig.packed_library besides "auto" (decode/packed.py)
LONG_LINES = ("truncate", "skip", "error")  # DecodeConfig.long_lines
LENGTH_NORMS = ("gnmt", "power")  # DecodeConfig.length_norm (decode/search.py: length_penalty)


@dataclass(frozen=True)
class DecodeConfig:
    """Search, length and batching settings for translation (§6.1)."""

    beam_size: int = param(4, "beam size K (§6.1: 4 for translation, 21 for parsing §6.3); 1 = greedy search")
    alpha: float = param(0.6, "length penalty α of the GNMT form lp(Y) = ((5 + |Y|) / 6)^α, score = sum log p / lp(Y); |Y| counts EOS as tensor2tensor does (§6.1: 0.6; parsing 0.3); 0 = no normalization")
    length_norm: str = param("gnmt", "the form of the length penalty lp(Y) that alpha is the exponent of: gnmt, ((5 + |Y|) / 6)^α (§6.1), or power, |Y|^α (transformers' length_penalty = α; an imported Marian model's setting, docs/import.md)")
    max_len_a: float = param(1.0, "maximum output length = floor(a * |x| + b) tokens, EOS included; |x| = non-pad source tokens as fed to the encoder (§6.1: |x| + 50)")
    max_len_b: int = param(50, "b of the maximum output length a * |x| + b (§6.1: 50; parsing §6.3: 300)")
    min_len: int = param(0, "EOS is forbidden until this many tokens have been generated (min_len = max length forces a fixed output length, for benchmarks)")
    no_repeat_ngram: int = param(0, "no n-gram of this many tokens occurs twice in an output (not in the paper; fairseq's no_repeat_ngram_size; a forced prefix counts, its own tokens are never banned; docs/decoding.md); 0 = off")
    nbest: int = param(1, "hypotheses returned per sentence, best first (at most beam_size; with sampling, the number of samples)")
    mbr: bool = param(False, "minimum Bayes risk (not in the paper): of beam_size finished hypotheses, first the one of highest expected sentence-BLEU against the others, by model probability (docs/decoding.md)")
    sampling: bool = param(False, "sample each token instead of searching (ancestral sampling with temperature / top-k / top-p)")
    temperature: float = param(1.0, "sampling: divide logits by this before the softmax")
    top_k: int = param(0, "sampling: keep only the k most probable tokens (0 = all)")
    top_p: float = param(1.0, "sampling: keep the smallest set of most probable tokens whose mass reaches p (nucleus; 1.0 = all)")
    seed: int = param(0, "sampling: random seed (sampled outputs depend on it and on batch composition)")
    batch_tokens: int = param(4096, "source tokens per batch, counting padding (sentences are sorted by length into batches; output keeps input order)")
    precision: str = param("fp32", "fp32 (exact), bf16 (the model in bfloat16, log-probabilities in float32), fp16 (CUDA: the model in float16, for GPUs without native bf16 such as the T4 and V100), int8 (CPU: int8 linear maps) or int8-bf16 (CPU: int8 linear maps, bfloat16 between them); docs/decoding.md")
    cpu_row_bits: int = param(ROW_BITS, "precision bf16 on the CPU, and fp32's packed weights on oneDNN: pad each linear map's rows with zero rows to a count that keeps this many leading bits, so a long-running translator's memory stays flat (docs/training.md); 0 = off, at most 62")
    workers: int = param(1, "decoding processes on the CPU sharing the length-sorted batches, each with its own copy of the model and threads/workers threads (docs/decoding.md); 1 = decode in this process")
    c_kernels: bool = param(True, "C kernels on the CPU (docs/kernels.md): beam search's attention and top-k (the same up to rounding), the int8 row passes (bit-identical); false, or no C compiler, = PyTorch's operations")
    packed_weights: bool = param(True, "precision fp32 on the CPU: linear maps from weights packed once for the library's kernels instead of at every call; the same products up to rounding (docs/decoding.md); false = PyTorch's")
    packed_library: str = param("auto", "whose packed weights packed_weights uses: mkl (MKL's packed sgemm), onednn (oneDNN's blocked format) or auto (MKL on Intel CPUs, oneDNN on others; docs/decoding.md)")
    cuda_graphs: bool = param(False, "CUDA: each decoding step replayed as a CUDA graph over buffers of fixed size, so the host issues one launch a step instead of hundreds of operations; the same search up to the order of sums (docs/gpu.md); the CPU decodes as without it")
    max_input_tokens: int = param(1024, "the longest source line, in subword tokens with EOS (at least 2); also capped by the model's max_positions; a longer line is handled as long_lines says")
    long_lines: str = param("error", "a source line over max_input_tokens: error (naming its line), truncate (to max_input_tokens - 1 tokens) or skip (an empty line out), with a warning; docs/translate.md")

    def __post_init__(self) -> None:
        for f in fields(self):  # NaN passes every bound below and would reach the scores (NaN alpha: empty outputs)
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}")
        if self.beam_size < 1:
            raise ConfigError(f"beam_size must be >= 1, got {self.beam_size}")
        if self.alpha < 0:
            raise ConfigError(f"alpha must be >= 0 (the early-stop bound assumes it), got {self.alpha}")
        if self.length_norm not in LENGTH_NORMS:
            raise ConfigError(f"length_norm must be {' or '.join(LENGTH_NORMS)}, got {self.length_norm!r}")
        if self.nbest < 1 or (not self.sampling and self.nbest > self.beam_size):
            raise ConfigError(f"nbest must be in [1, beam_size={self.beam_size}], got {self.nbest}")
        if self.max_len_a < 0 or self.max_len_b < 0 or (self.max_len_a == 0 and self.max_len_b < 1):
            raise ConfigError("max_len_a and max_len_b must be >= 0 and allow at least one token")
        if self.min_len < 0:
            raise ConfigError(f"min_len must be >= 0, got {self.min_len}")
        if self.no_repeat_ngram < 0:
            raise ConfigError(f"no_repeat_ngram must be >= 0 (0 = off), got {self.no_repeat_ngram}")
        if self.mbr and self.sampling:
            raise ConfigError("mbr chooses among beam search's hypotheses; it does not combine with sampling")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_k must be >= 0 and top_p in (0, 1]")
        if not 0 <= self.seed < 1 << 63:  # torch.Generator.manual_seed's range, as train.seed's
            raise ConfigError(f"seed must be in [0, 2^63), got {self.seed}")
        if self.precision not in ("fp32", "bf16", "fp16", "int8", "int8-bf16"):
            raise ConfigError(f"precision must be fp32, bf16, fp16, int8 or int8-bf16, got {self.precision!r}")
        if self.packed_library not in ("auto", *PACKED_LIBRARIES):
            raise ConfigError(f"packed_library must be auto, mkl or onednn, got {self.packed_library!r}")
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.long_lines not in LONG_LINES:
            raise ConfigError(f"long_lines must be {', '.join(LONG_LINES)}, got {self.long_lines!r}")
        if self.batch_tokens < 1:
            raise ConfigError(f"batch_tokens must be >= 1, got {self.batch_tokens}")
        if self.max_input_tokens < 2:  # one for EOS: a limit of 1 keeps no token of any line, truncated or not
            raise ConfigError(f"max_input_tokens must be >= 2 (a source token and EOS), got {self.max_input_tokens}")
        if not 0 <= self.cpu_row_bits <= MAX_ROW_BITS:
            raise ConfigError(f"cpu_row_bits must be in [0, {MAX_ROW_BITS}] (0 = off), got {self.cpu_row_bits}")


# The defaults of `aiayn translate` and `aiayn evaluate`: a job goes on past an overlong line, as
# fairseq's and Marian's do (the line truncated, with a warning naming it).
TRANSLATE_DECODE = replace(DecodeConfig(), long_lines="truncate")

# The DecodeConfig fields a checkpoint may carry (its ``decode`` entry: an imported Marian model's
# generation settings, aiayn/interop/hf_import.py), which `aiayn translate` decodes with unless given as flags.
CHECKPOINT_FIELDS = ("beam_size", "alpha", "length_norm", "max_len_a", "max_len_b", "min_len", "no_repeat_ngram",
                     "sampling", "temperature", "top_k", "top_p")


def add_device_argument(p) -> None:
    """``--device`` of the commands that translate (translate, evaluate, serve, parse): resolved by
    ``loading.inference_device``."""
    p.add_argument("--device", default="auto", help="auto (CUDA when present, else the CPU), cpu, cuda or cuda:N "
                                                    "(default: auto)")
