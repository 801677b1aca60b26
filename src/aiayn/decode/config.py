"""DecodeConfig: how a checkpoint turns source sentences into translations (§6.1).

Defaults are the paper's: beam size 4, length penalty α = 0.6, maximum output length
= input length + 50, terminating early when possible.
"""
from __future__ import annotations

from dataclasses import dataclass

from aiayn.config import ConfigError, param, replace
from aiayn.model.linear import ROW_BITS


PACKED_LIBRARIES = ("mkl", "onednn")  # DecodeConfig.packed_library besides "auto" (decode/packed.py)
LONG_LINES = ("truncate", "skip", "error")  # DecodeConfig.long_lines


@dataclass(frozen=True)
class DecodeConfig:
    """Search, length and batching settings for translation (§6.1)."""

    beam_size: int = param(4, "beam size K (§6.1: 4 for translation, 21 for parsing §6.3); 1 = greedy search")
    alpha: float = param(0.6, "length penalty α of the GNMT form lp(Y) = ((5 + |Y|) / 6)^α, score = sum log p / lp(Y); |Y| counts EOS as tensor2tensor does (§6.1: 0.6; parsing 0.3); 0 = no normalization")
    max_len_a: float = param(1.0, "maximum output length = floor(a * |x| + b) tokens, EOS included; |x| = non-pad source tokens as fed to the encoder (§6.1: |x| + 50)")
    max_len_b: int = param(50, "b of the maximum output length a * |x| + b (§6.1: 50; parsing §6.3: 300)")
    min_len: int = param(0, "EOS is forbidden until this many tokens have been generated (min_len = max length forces a fixed output length, for benchmarks)")
    no_repeat_ngram: int = param(0, "no n-gram of this many tokens occurs twice in an output (not in the paper; fairseq's, CTranslate2's and transformers' no_repeat_ngram_size; decode/ngram.py): at each step a hypothesis may not take a token that would complete an n-gram it already holds; a forced target prefix counts among what it holds, its own tokens are never banned; greedy search, beam search and sampling; 0 = off")
    nbest: int = param(1, "hypotheses returned per sentence, best first (at most beam_size; with sampling, the number of samples)")
    mbr: bool = param(False, "minimum Bayes risk choice (not in the paper, which outputs the best-scoring hypothesis; decode/mbr.py): beam search keeps beam_size finished hypotheses and returns first the one with the highest expected sentence-BLEU against all of them, weighted by their model probabilities; the n-best list is in that order")
    sampling: bool = param(False, "sample each token instead of searching (ancestral sampling with temperature / top-k / top-p)")
    temperature: float = param(1.0, "sampling: divide logits by this before the softmax")
    top_k: int = param(0, "sampling: keep only the k most probable tokens (0 = all)")
    top_p: float = param(1.0, "sampling: keep the smallest set of most probable tokens whose mass reaches p (nucleus; 1.0 = all)")
    seed: int = param(0, "sampling: random seed (sampled outputs depend on it and on batch composition)")
    batch_tokens: int = param(4096, "source tokens per batch, counting padding (sentences are sorted by length into batches; output keeps input order)")
    precision: str = param("fp32", "weights and activations while decoding: fp32 (exact), bf16 (the model cast to bfloat16: faster on CPUs with bf16 instructions and on GPUs; log-probabilities still in float32), int8 (CPU: every linear map, the output projection included, with int8 weights per output channel and int8 inputs per row, int32 products; decode/int8.py) or int8-bf16 (CPU: the same int8 linear maps, everything between them, the attention core included, in bfloat16; for CPUs with bf16 instructions)")
    cpu_row_bits: int = param(ROW_BITS, "precision bf16 on the CPU: pad the rows of every linear map with zero rows (dropped again: the same outputs) to a count that keeps this many leading bits, so that oneDNN keeps kernels for a bounded set of row counts and a long-running translator or service does not grow with every new batch shape (aiayn/model/linear.py); products of fewer than 2^bits rows are never padded; 0 = off")
    workers: int = param(1, "decoding processes (CPU): the length-sorted batches are shared among this many worker processes, each with its own copy of the model and threads/workers of the CPU threads (as CTranslate2's inter_threads; decode/workers.py); 1 = decode in this process")
    c_kernels: bool = param(True, "hand-written C kernels on the CPU (kernels/loader.py; compiled with the system's C compiler on first use): beam search's attention (each beam reads only its own keys, one pass, float32 softmax: the same Eq. 1 up to rounding) and, for precision int8 / int8-bf16, the row quantization and rescaling around each int8 product (bit-identical); false, or no C compiler, = PyTorch's operations (scaled_dot_product_attention)")
    packed_weights: bool = param(True, "precision fp32 on the CPU: the linear maps multiply from weights laid out once for the library's kernels (decode/packed.py) instead of PyTorch's default sgemm, which lays them out at every call; the same products up to the order of float32 additions; false = PyTorch's linear")
    packed_library: str = param("auto", "whose packed weights packed_weights uses: mkl (MKL's packed sgemm), onednn (oneDNN's blocked format) or auto (MKL on Intel CPUs, oneDNN on others; docs/decoding.md)")
    max_input_tokens: int = param(1024, "the longest source line, in subword tokens with EOS; also capped by the model's max_positions; a longer line is handled as long_lines says")
    long_lines: str = param("error", "a source line over max_input_tokens: error (stop with an error naming its line), truncate (translate its first max_input_tokens - 1 tokens) or skip (an empty line out); truncate and skip warn, naming the line. translate and evaluate default to truncate, the library, serve and parse to error")

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ConfigError(f"beam_size must be >= 1, got {self.beam_size}")
        if self.alpha < 0:
            raise ConfigError(f"alpha must be >= 0 (the early-stop bound assumes it), got {self.alpha}")
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
        if self.precision not in ("fp32", "bf16", "int8", "int8-bf16"):
            raise ConfigError(f"precision must be fp32, bf16, int8 or int8-bf16, got {self.precision!r}")
        if self.packed_library not in ("auto", *PACKED_LIBRARIES):
            raise ConfigError(f"packed_library must be auto, mkl or onednn, got {self.packed_library!r}")
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.long_lines not in LONG_LINES:
            raise ConfigError(f"long_lines must be {', '.join(LONG_LINES)}, got {self.long_lines!r}")
        if self.batch_tokens < 1 or self.max_input_tokens < 1:
            raise ConfigError("batch_tokens and max_input_tokens must be >= 1")


# The defaults of `aiayn translate` and `aiayn evaluate`: a job goes on past an overlong line, as
# fairseq's and Marian's do (the line truncated, with a warning naming it).
TRANSLATE_DECODE = replace(DecodeConfig(), long_lines="truncate")


def add_device_argument(p) -> None:
    """``--device`` of the commands that translate (translate, evaluate, serve, parse): resolved by
    ``loading.inference_device``."""
    p.add_argument("--device", default="auto", help="auto (CUDA when present, else the CPU), cpu, cuda or cuda:N "
                                                    "(default: auto)")
