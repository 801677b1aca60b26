"""Hand-written C kernels for decoding on the CPU, compiled on first use: the attention of a beam-search
step (Eq. 1, one query per row) and the passes around an int8 product; and one for training, the
label-smoothed loss over the logits (``cross_entropy.c``, used by train/objective.py).

Why: at a beam step each (sentence, head) pair is a product of g beam queries with a few dozen keys.
PyTorch's ``scaled_dot_product_attention`` takes far longer on such small products than reading
their keys and values takes (BENCHMARKS.md §3, "What each decoding choice is worth"), and with shared beam
slots (``DecoderCache.ancestors``) it also multiplies each query with the other beams' slots and
masks them out. ``beam_attention.c`` does, per (sentence, head) and beam row, one pass over that
row's own keys (the ancestor table picks the slot at each position), a float32 softmax and one
pass over the values; encoder-decoder attention is the same loop over the source positions, with
source padding skipped. float32 and bfloat16 tensors. With AVX-512 (or AVX2 + FMA), beam 4 and d_k = d_v of 32 or
64, the rows' queries and accumulators are kept in registers and the softmax runs 16 (8) scores at a time,
so each key and value is read once for the four rows (``bench/beam_attention_ab.sh``, BENCHMARKS.md §3). The
self-attention call also appends the step's keys and values to the cache (each work item copies its rows'
into their slots before reading them), which PyTorch's strided copy in ``DecoderCache.append`` did as a
separate pass. At the end of the step the search wants each beam's few best tokens by log-probability;
PyTorch writes the (N, V) log-probabilities, masks the banned tokens and reads them again for topk;
``logits_topk.c`` finds the k best and the log-normalizer in two passes over each row of logits, writing
only (N, k). Around each int8 product (``Int8Linear``,
decode/int8.py) PyTorch spends six or so small operations quantizing the input rows and rescaling
the result; ``int8_rows.c`` does each in one loop, with the same roundings (bit-identical, tested). On
CPUs without VNNI, where oneDNN's int8 product is a slow reference loop or (held to AVX2) saturates,
``int8_gemm.c`` is the product itself, exact (int16 pair sums), with the rescaling in the same pass.
In training, the label-smoothed loss reads the (N, V) logits forward and writes their gradient backward;
PyTorch's operations passed over each block six or seven times; ``cross_entropy.c`` reads each row once
forward and once backward and writes the gradient once (``train.c_kernels``; BENCHMARKS.md §2, "The demo's
training step"). Training's attention over whole sequences
(``seq_attention.c``, forward and backward; ``aiayn.execution.use_attention_kernels``, also ``train.c_kernels``): each
(batch row, head) of ``aiayn demo``'s training is a few dozen queries against a few dozen keys of 32 values, where
PyTorch's fused attention ran far below the CPU's FLOP rate (and copied to float32 and back under bf16
autocast); the AVX-512 path keeps each (batch row, head) in float32 scratch, no copies (BENCHMARKS.md §2,
"The demo's training step"). Its plain loops (other builds and head sizes) are slower than PyTorch's, so the model takes the
kernel only where the AVX-512 path is (``Kernels.seq_attention_fast``).

How it is built: the first ``load()`` of a process compiles the seven C files with the system's C compiler
(``$CC``, else ``cc``) for this CPU (``-march=native``; ``$AIAYN_KERNELS_MARCH`` names another target, e.g.
``x86-64-v3`` for the AVX2 + FMA loops a CPU without AVX-512 runs, or ``x86-64`` for the portable ones) into
the cache directory
(``$AIAYN_CACHE_DIR``, else ``$XDG_CACHE_HOME/aiayn`` or ``~/.cache/aiayn``), under a name that
hashes the sources, the flags, the CPU and the compiler's target (its version and the instruction sets the
-march enables; a named target this CPU lacks one of is not built: kernels/target.py), written
atomically with the SHA-256 of its bytes beside it; later loads reuse the file only if it is this
user's, writable by no one else, and its bytes match (``load``; else it is built again; a cache
directory shared between users gets a private folder per user; kernels/build_cache.py says how no step
follows a symbolic link or a name others could swap). Without a compiler (or if compiling fails)
``load()`` logs why once and returns None, and decoding and training use PyTorch's operations: the
same numbers up to rounding for attention and log-probabilities, identical for int8
(``tests/kernels/``, a file per kernel, checks both kinds of attention step against
``attention_explicit`` in float32 and bfloat16, the top-k log-probabilities against PyTorch's
log_softmax and topk, the int8 passes against PyTorch's, all of them also built without
-march=native (the portable loops), and beam search with and without the kernels; the loss against the
PyTorch path of train/objective.py, and a model's gradients with and without it; training's attention against
``attention_explicit``'s autograd, forward and backward, and a model's gradients with and without it).
``DecodeConfig.c_kernels`` turns the decoding kernels off, ``TrainConfig.c_kernels`` training's.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from aiayn.errors import UserError
from aiayn.host.isa import cpu_flags
from aiayn.kernels.build_cache import NOT_BUILT, CacheFolder, cache_dir
from aiayn.kernels.target import compiler_target, missing_flags

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("beam_attention.c", "int8_rows.c", "int8_gemm.c", "logits_topk.c", "cross_entropy.c",
                             "seq_attention.c", "team.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("bf16.h", "lanes.h", "split.h", "vexp.h"))  # included; in the cache key too
# no FMA contraction: int8_rows.c must round as PyTorch's separate operations do (beam_attention.c asks for fmaf)
_FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


MARCH_ENV = "AIAYN_KERNELS_MARCH"


def _march() -> str:
    """The -march the kernels are built for: ``$AIAYN_KERNELS_MARCH``, else ``native``. Lets one CPU
    build and test what another runs (x86-64-v3: AVX2 and FMA, no AVX-512)."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not all(c.isalnum() or c in "-_." for c in march):
        raise UserError(f"{MARCH_ENV}={march!r}: not a compiler target name (e.g. x86-64-v3)")
    return march


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc.split()[0]) and cc


def _compile(cc: str, out: Path, archs: tuple[list[str], ...] | None = None) -> str | None:
    """Compile SOURCES into ``out``, in a directory private to the caller (``load`` passes a fresh
    mkdtemp one, never the cache), with the first of ``archs`` that works (some compilers or CPUs have no
    -march=native; without it the portable loops are built); None on success, else why."""
    errors = []
    march = _march()
    # -march=native may be missing (an old compiler, an unknown CPU): the portable loops then; a target
    # the user named is built as named, or refused
    given = march != "native"
    for arch in archs if archs is not None else ([f"-march={march}"],) + (() if given else ([],)):
        cmd = cc.split() + [*_FLAGS, *arch, *map(str, SOURCES), "-o", str(out), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            done, err = None, str(e)
        if done is not None and done.returncode == 0:
            return None
        out.unlink(missing_ok=True)
        errors.append(err if done is None else (done.stderr.strip().splitlines() or ["exit status %d" % done.returncode])[-1])
    if given and archs is None and done is not None:  # a target the user named that the compiler refuses
        _refuse_target(march, done.stderr)
    return "; ".join(errors)


def _refuse_target(march: str, stderr: str) -> None:
    """A UserError where the compiler's ``stderr`` names the target ``march`` (it refused it)."""
    if march in stderr:
        said = next(line for line in stderr.splitlines() if march in line).strip()
        raise UserError(f"{MARCH_ENV}={march}: the compiler refuses it ({said}); name a target it knows "
                        f"(x86-64-v3, x86-64-v4, native) or unset it")


def check_target() -> None:
    """``$AIAYN_KERNELS_MARCH`` checked before a command's work, as ``load`` would refuse it at its first
    build (the same UserError): a target name, and one the compiler knows (asked with -E, no build).
    ``native``, or no compiler (PyTorch's operations then), passes; so does a target this CPU lacks
    instructions of, which ``load`` declines with a warning (kernels/target.py)."""
    march, cc = _march(), _compiler()
    if march == "native" or cc is None:
        return
    cmd = [*cc.split(), f"-march={march}", "-dM", "-E", "-x", "c", os.devnull]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return  # the build says why, if it fails too
    if done.returncode != 0:
        _refuse_target(march, done.stderr)


class Kernels:
    """The compiled library. ``self_attention`` and ``cross_attention`` return (N, H*Dv): the heads
    concatenated, in the input's dtype, ready for W^O; ``log_softmax_topk`` is the search's selection
    from the logits; ``quantize_rows`` and ``rescale`` are the two halves of ``Int8Linear``'s work
    around ``torch._int_mm``, and ``pack_int8`` with ``int8_linear`` its product without VNNI. Copying or
    pickling one (a decoding copy of a model holds it) gives the loaded library of the receiving process."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        p, i64, i64p = ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
        self._attend = lib.aiayn_beam_attention_append
        self._attend.argtypes = [p, p, p, p, p, p, p, p, i64p, i64p, ctypes.c_float, ctypes.c_int, ctypes.c_int]
        self._attend.restype = ctypes.c_int
        self._quantize = lib.aiayn_quantize_rows
        self._quantize.argtypes = [p, i64, i64, i64, ctypes.c_int, p, p]
        self._quantize.restype = None
        self._rescale = lib.aiayn_rescale
        self._rescale.argtypes = [p, i64, i64, p, p, p, ctypes.c_int, p]
        self._rescale.restype = None
        self._pack_int8 = lib.aiayn_int8_pack
        self._pack_int8.argtypes = [p, i64, i64, p]
        self._pack_int8.restype = None
        self._int8_gemm = lib.aiayn_int8_gemm
        self._int8_gemm.argtypes = [p, i64, i64, p, i64, p, p, p, ctypes.c_int, p, ctypes.c_int]
        self._int8_gemm.restype = ctypes.c_int
        self.int8_vector = bool(lib.aiayn_int8_gemm_vector())  # int8_gemm.c's AVX2 tile loop, not the plain loops
        self._topk = lib.aiayn_log_softmax_topk
        self._topk.argtypes = [p, i64, i64, i64, ctypes.c_int, i64, p, i64, p, p, ctypes.c_int]
        self._topk.restype = None
        self._ce_forward = lib.aiayn_ce_forward
        self._ce_forward.argtypes = [p, i64, i64, i64, ctypes.c_int, p, p, ctypes.c_int]
        self._ce_forward.restype = None
        self._ce_backward = lib.aiayn_ce_backward
        self._ce_backward.argtypes = [p, i64, i64, i64, ctypes.c_int, p, p, p, p, p, i64, p, ctypes.c_int]
        self._ce_backward.restype = None
        self._sa_forward = lib.aiayn_seq_attention_forward
        self._sa_forward.argtypes = [p, p, p, p, i64p, i64p, ctypes.c_int, ctypes.c_float, ctypes.c_int, p, p,
                                     ctypes.c_int]
        self._sa_forward.restype = ctypes.c_int
        self._sa_backward = lib.aiayn_seq_attention_backward
        self._sa_backward.argtypes = [p, p, p, p, i64p, i64p, ctypes.c_int, ctypes.c_float, ctypes.c_int, p, p, p,
                                      p, p, ctypes.c_int]
        self._sa_backward.restype = ctypes.c_int
        self._sa_fast = lib.aiayn_seq_attention_fast
        self._sa_fast.argtypes = [i64, i64]
        self._sa_fast.restype = ctypes.c_int
        self._use_team = lib.aiayn_use_team
        self._use_team.argtypes = [p, p, p]
        self._use_team.restype = None
        self.team = False  # whose threads run the kernels' work: use_team
        self.use_team(True)

    def use_team(self, on: bool) -> bool:
        """Run the kernels' work on PyTorch's own OpenMP threads (``on``, where ``openmp_team`` finds
        them), else on threads the kernels start (split.h says why the team); the same results either
        way. Returns whether the team is in use."""
        entries = openmp_team() if on else None
        self._use_team(*(entries or (None, None, None)))
        self.team = entries is not None
        return self.team

    def __reduce__(self):
        return load, ()

    def __deepcopy__(self, memo) -> "Kernels":
        return self

    # -- the passes around an int8 product (decode/int8.py) ------------------------------------------

    @staticmethod
    def supports_rows(x: Tensor) -> bool:
        """quantize_rows' cases: a CPU (N, I) float32 or bfloat16 tensor with contiguous rows."""
        return x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() == 2 and x.stride(1) == 1

    def quantize_rows(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``int8.quantize_rows`` in one pass per row: x (N, I) -> (x_q (N, I) int8, s (N, 1) float32)."""
        if not self.supports_rows(x):
            raise ValueError("quantize_rows: a CPU (N, I) float32 or bfloat16 tensor with contiguous rows")
        N, I = x.shape
        q = torch.empty(N, I, dtype=torch.int8)
        s = torch.empty(N, 1, dtype=torch.float32)
        self._quantize(x.data_ptr(), N, I, x.stride(0), _DTYPES[x.dtype], q.data_ptr(), s.data_ptr())
        return q, s

    def rescale(self, acc: Tensor, s_x: Tensor, s_w: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
        """(acc * s_w) * s_x (+ bias) in float32, then out_dtype, as ``Int8Linear`` computes it: acc (N, O)
        int32 contiguous, s_x (N, 1), s_w (O,), bias (O,) float32 contiguous -> (N, O)."""
        N, O = acc.shape
        if not (acc.dtype == torch.int32 and acc.is_contiguous() and s_x.is_contiguous() and s_w.is_contiguous()
                and (bias is None or bias.is_contiguous()) and out_dtype in _DTYPES):
            raise ValueError("rescale: int32 contiguous products, contiguous float32 scales, float32 or bfloat16 out")
        y = torch.empty(N, O, dtype=out_dtype)
        self._rescale(acc.data_ptr(), N, O, s_x.data_ptr(), s_w.data_ptr(),
                      None if bias is None else bias.data_ptr(), _DTYPES[out_dtype], y.data_ptr())
        return y

    # -- the int8 product itself, for CPUs without VNNI (int8_gemm.c; decode/int8.py) -------------------

    @staticmethod
    def packed_int8_shape(O: int, I: int) -> tuple[int, int, int, int]:
        """The shape of ``pack_int8``'s result for W_q (O, I): blocks of 16 outputs, pairs of inputs."""
        return (O + 15) // 16, (I + 1) // 2, 16, 2

    def pack_int8(self, w_q: Tensor) -> Tensor:
        """W_q (O, I) int8 -> the int16 copy ``int8_mm`` and ``int8_linear`` multiply by, laid out once
        (int8_gemm.c): (ceil(O/16), ceil(I/2), 16, 2), zeros past O and I."""
        if w_q.dtype != torch.int8 or w_q.dim() != 2 or w_q.device.type != "cpu":
            raise ValueError("pack_int8: a CPU (O, I) int8 weight")
        w_q = w_q.contiguous()
        packed = torch.empty(self.packed_int8_shape(*w_q.shape), dtype=torch.int16)
        self._pack_int8(w_q.data_ptr(), w_q.size(0), w_q.size(1), packed.data_ptr())
        return packed

    def int8_mm(self, x_q: Tensor, w_packed: Tensor, O: int) -> Tensor:
        """x_q (N, I) int8 · W_qᵀ, exactly: (N, O) int32, W_q (O, I) packed by ``pack_int8``."""
        return self._gemm(x_q, w_packed, O, None, None, None, torch.int32)

    def int8_linear(self, x_q: Tensor, s_x: Tensor, w_packed: Tensor, s_w: Tensor, bias: Tensor | None,
                    out_dtype: torch.dtype) -> Tensor:
        """``rescale(int8_mm(x_q, w_packed, O), s_x, s_w, bias, out_dtype)`` in one pass, bit for bit:
        x_q (N, I) int8, s_x (N, 1), s_w (O,), bias (O,) float32 -> (N, O) float32 or bfloat16."""
        O = s_w.numel()
        if not (s_x.dtype == s_w.dtype == torch.float32 and s_x.is_contiguous() and s_w.is_contiguous()
                and s_x.numel() == x_q.size(0) and out_dtype in _DTYPES
                and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == O))):
            raise ValueError("int8_linear: contiguous float32 scales (N, 1) and (O,), float32 (O,) bias, "
                             "float32 or bfloat16 out")
        return self._gemm(x_q, w_packed, O, s_x, s_w, bias, out_dtype)

    def _gemm(self, x_q, w_packed, O, s_x, s_w, bias, out_dtype) -> Tensor:
        if not (x_q.dtype == torch.int8 and x_q.dim() == 2 and x_q.is_contiguous() and x_q.device.type == "cpu"
                and w_packed.dtype == torch.int16 and w_packed.is_contiguous()
                and w_packed.shape == self.packed_int8_shape(O, x_q.size(1))):
            raise ValueError(f"int8 product: a contiguous CPU int8 x_q (N, I) and a packed (O, I) weight, got "
                             f"x_q {tuple(x_q.shape)} {x_q.dtype}, packed {tuple(w_packed.shape)} for O = {O}")
        N, I = x_q.shape
        y = torch.empty(N, O, dtype=out_dtype)
        out = 2 if out_dtype == torch.int32 else _DTYPES[out_dtype]
        status = self._int8_gemm(x_q.data_ptr(), N, I, w_packed.data_ptr(), O,
                                 None if s_x is None else s_x.data_ptr(), None if s_w is None else s_w.data_ptr(),
                                 None if bias is None else bias.data_ptr(), out, y.data_ptr(), torch.get_num_threads())
        if status:
            raise MemoryError("int8 product: out of memory")
        return y

    # -- the end of a beam-search step -----------------------------------------------------------------

    def log_softmax_topk(self, logits: Tensor, k: int, banned: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's k best tokens by log-probability, best first, never one of ``banned``: the values
        and indices of ``topk(log_softmax(logits).index_fill(1, banned, -inf), k)`` up to rounding (the
        exponentials; among equal values the lower id first), without the (N, V) log-probabilities.
        logits (N, V) CPU float32 or bfloat16 with contiguous rows, banned (nb,) int64 -> (N, k) float32,
        (N, k) int64."""
        if not self.supports_rows(logits) or banned.dtype != torch.int64 or not banned.is_contiguous():
            raise ValueError("log_softmax_topk: (N, V) CPU float32 or bfloat16 logits with contiguous rows, "
                             "int64 banned ids")
        N, V = logits.shape
        if not 0 < k <= V:
            raise ValueError(f"log_softmax_topk: k = {k} for {V} tokens")
        val = torch.empty(N, k, dtype=torch.float32)
        idx = torch.empty(N, k, dtype=torch.int64)
        self._topk(logits.data_ptr(), N, V, logits.stride(0), _DTYPES[logits.dtype], k, banned.data_ptr(),
                   banned.numel(), val.data_ptr(), idx.data_ptr(), torch.get_num_threads())
        return val, idx

    # -- the label-smoothed loss of training (train/objective.py) -----------------------------------------

    def cross_entropy_forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Per row of the logits z (N, V) (CPU float32 or bfloat16, contiguous rows): log Z = logsumexp(z)
        and sum_v z_v, both (N,) float32, in one read of each row (cross_entropy.c)."""
        if not self.supports_rows(z):
            raise ValueError("cross_entropy_forward: (N, V) CPU float32 or bfloat16 logits with contiguous rows")
        N, V = z.shape
        log_z = torch.empty(N, dtype=torch.float32)
        sum_z = torch.empty(N, dtype=torch.float32)
        self._ce_forward(z.data_ptr(), N, V, z.stride(0), _DTYPES[z.dtype], log_z.data_ptr(), sum_z.data_ptr(),
                         torch.get_num_threads())
        return log_z, sum_z

    def cross_entropy_backward(self, z: Tensor, log_z: Tensor, a: Tensor, c: Tensor, e: Tensor, gold: Tensor,
                               pad_id: int) -> Tensor:
        """d loss / d z (N, V) in z's dtype: a * softmax(z) - c on every column, then + c at ``pad_id``
        and - e at each row's ``gold`` id; log_z, a, c, e (N,) float32 and gold (N,) int64, contiguous."""
        N, V = z.shape
        rows = (log_z, a, c, e)
        if not (self.supports_rows(z) and all(t.dtype == torch.float32 and t.is_contiguous() and t.numel() == N
                                              for t in rows)
                and gold.dtype == torch.int64 and gold.is_contiguous() and gold.numel() == N and 0 <= pad_id < V
                and (N == 0 or 0 <= int(gold.min()) and int(gold.max()) < V)):
            raise ValueError("cross_entropy_backward: (N, V) CPU float32 or bfloat16 logits with contiguous rows, "
                             "(N,) float32 row terms, (N,) int64 gold ids, a pad id below V")
        g = torch.empty(N, V, dtype=z.dtype)
        self._ce_backward(z.data_ptr(), N, V, z.stride(0), _DTYPES[z.dtype], log_z.data_ptr(), a.data_ptr(),
                          c.data_ptr(), e.data_ptr(), gold.data_ptr(), pad_id, g.data_ptr(), torch.get_num_threads())
        return g

    # -- the attention of training: whole sequences, forward and backward (seq_attention.c) --------------

    @staticmethod
    def supports_heads(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
        """seq_attention's cases: q (B,H,T,K), k (B,H,S,K), v (B,H,S,Dv) CPU float32 or bfloat16 views of
        (B, L, H*d)-shaped rows (heads adjacent, the last dimension contiguous: a projection's output split
        into heads, or a slice of a fused one), and mask None or bool (B|1, 1, 1, S)."""
        if not Kernels.supports(q, k, v) or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return False
        B, H, _, K = q.shape
        if k.shape[:2] != (B, H) or v.shape[:3] != k.shape[:3] or k.size(-1) != K:
            return False
        if any(t.size(1) > 1 and t.stride(1) != t.size(-1) for t in (q, k, v)):
            return False
        return mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1:3] == (1, 1)
                                and mask.size(0) in (1, B) and mask.size(-1) == k.size(2))

    @functools.lru_cache(maxsize=None)
    def seq_attention_fast(self, d_k: int, d_v: int) -> bool:
        """Whether seq_attention.c has its AVX-512 path for these head sizes (d_k = d_v = 32 or 64) on this
        build; its plain loops compute the same but are slower than PyTorch's attention."""
        return bool(self._sa_fast(d_k, d_v))

    def _seq_args(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None):
        B, H, T, K = q.shape
        S, Dv = k.size(2), v.size(-1)
        if mask is not None:
            mask = mask.reshape(mask.size(0), S).expand(B, S).to(torch.uint8).contiguous()  # (B,S)
        dims = (ctypes.c_int64 * 6)(B, H, T, S, K, Dv)
        strides = (ctypes.c_int64 * 7)(q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2),
                                       S)
        return mask, dims, strides

    def seq_attention_forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool
                              ) -> tuple[Tensor, Tensor]:
        """Eq. 1 over whole sequences (``supports_heads``' cases): (out (B,T,H*Dv) in q's dtype, the heads
        concatenated; lse (B,H,T) float32, each query's log-normalizer, for the backward). ``mask`` True =
        may attend; ``causal``: query i sees keys j <= i + S - T."""
        if not self.supports_heads(q, k, v, mask):
            raise ValueError(f"seq_attention: unsupported q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
        B, H, T, K = q.shape
        m, dims, strides = self._seq_args(q, k, v, mask)
        out = torch.empty(B, T, H * v.size(-1), dtype=q.dtype)
        lse = torch.empty(B, H, T, dtype=torch.float32)
        status = self._sa_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), m.data_ptr() if m is not None else None,
                                  dims, strides, int(causal), 1.0 / math.sqrt(K), _DTYPES[q.dtype], out.data_ptr(),
                                  lse.data_ptr(), torch.get_num_threads())
        if status:
            raise MemoryError("seq_attention forward: out of memory")
        return out, lse

    def seq_attention_backward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, lse: Tensor,
                               dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The gradients of ``seq_attention_forward``'s out for dout (B,T,H*Dv): dq, dk, dv shaped and
        strided as views (B,H,L,d) of (B,L,H*d) tensors, in q's dtype."""
        B, H, T, K = q.shape
        S, Dv = k.size(2), v.size(-1)
        if (not self.supports_heads(q, k, v, mask) or lse.shape != (B, H, T) or lse.dtype != torch.float32
                or dout.shape != (B, T, H * Dv)):
            raise ValueError(f"seq_attention backward: bad shapes q {tuple(q.shape)} k {tuple(k.shape)} "
                             f"v {tuple(v.shape)} lse {tuple(lse.shape)} dout {tuple(dout.shape)}")
        m, dims, strides = self._seq_args(q, k, v, mask)
        dout = dout.to(q.dtype).contiguous()
        lse = lse.contiguous()
        dq = torch.empty(B, T, H, K, dtype=q.dtype)
        dk = torch.empty(B, S, H, K, dtype=q.dtype)
        dv = torch.empty(B, S, H, Dv, dtype=q.dtype)
        status = self._sa_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), m.data_ptr() if m is not None else None,
                                   dims, strides, int(causal), 1.0 / math.sqrt(K), _DTYPES[q.dtype], lse.data_ptr(),
                                   dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                   torch.get_num_threads())
        if status:
            raise MemoryError("seq_attention backward: out of memory")
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    # -- the attention of a beam-search step ----------------------------------------------------------

    @staticmethod
    def supports(*tensors: Tensor) -> bool:
        """The attention kernel's cases: CPU tensors of one dtype, float32 or bfloat16, last dimension contiguous."""
        dtype = tensors[0].dtype
        return dtype in _DTYPES and all(t.device.type == "cpu" and t.dtype == dtype and t.stride(-1) == 1
                                        for t in tensors)

    def self_attention(self, q: Tensor, k: Tensor, v: Tensor, ancestors: Tensor, g: int,
                       new_k: Tensor | None = None, new_v: Tensor | None = None) -> Tensor:
        """Shared beam slots (``DecoderCache``): q (N,H,1,K) with N = Bs*g rows (beams of a sentence
        adjacent); k (Bs,H,n*g,K), v (Bs,H,n*g,Dv) the filled slots of n positions; ancestors
        (Bs,g,>=n-1) int64, the slot of each earlier position of each row's prefix. With new_k (N,H,1,K)
        and new_v (N,H,1,Dv), the step's own keys and values, the kernel first writes row s*g + r's into
        slot r of position n-1 of k and v (what ``DecoderCache.append`` copies there; ``DecoderCache.slots``
        gives k and v without the copy), as it attends."""
        N, H, _, K = q.shape
        if ancestors.dtype != torch.int64 or ancestors.stride(-1) != 1:
            raise ValueError("ancestors must be int64 with a contiguous last dimension")
        anc = (ancestors.data_ptr(), ancestors.stride(0), ancestors.stride(1))
        new = None
        if new_k is not None or new_v is not None:
            if (new_k is None or new_v is None or new_k.shape != (N, H, 1, K) or new_v.shape != (N, H, 1, v.size(-1))
                    or not self.supports(k, new_k, new_v)):
                raise ValueError(f"beam attention: new keys/values {None if new_k is None else tuple(new_k.shape)}, "
                                 f"{None if new_v is None else tuple(new_v.shape)} for q {tuple(q.shape)}")
            new = (new_k, new_v)
        return self._run(q, k, v, g, anc, None, new)

    def cross_attention(self, q: Tensor, k: Tensor, v: Tensor, src_pad: Tensor, g: int) -> Tensor:
        """Encoder-decoder attention: q (N,H,1,K), rows s*g..s*g+g-1 attend to sentence s of k (Bs,H,S,K),
        v (Bs,H,S,Dv), except where src_pad (Bs,S) bool is True."""
        if src_pad.dtype != torch.bool or src_pad.stride(-1) != 1:
            raise ValueError("src_pad must be bool with a contiguous last dimension")
        return self._run(q, k, v, g, None, src_pad, None)

    def _run(self, q, k, v, g, anc, pad, new) -> Tensor:
        """The beam attention kernel on q (N,H,1,K), k and v of Bs = N / g sentences: with ``anc``
        (ancestors' pointer and strides), self-attention over shared slots (k holds n*g of them);
        with ``pad``, cross-attention over the n = S source positions; ``new``: the step's own keys
        and values, or None."""
        N, H, t, K = q.shape
        Bs, Dv = k.size(0), v.size(-1)
        n, kt, vt = k.size(2) // g if anc is not None else k.size(2), k.stride(2), v.stride(2)
        if t != 1 or N != Bs * g or k.size(0) != Bs or v.size(0) != Bs or k.size(1) != H or k.size(-1) != K:
            raise ValueError(f"beam attention: bad shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {g}")
        out = torch.empty(N, H * Dv, dtype=q.dtype)
        nk, nv = new if new is not None else (None, None)
        dims = (ctypes.c_int64 * 6)(Bs, H, g, n, K, Dv)
        strides = (ctypes.c_int64 * 16)(
            g * q.stride(0), q.stride(1), q.stride(0), k.stride(0), k.stride(1), kt, v.stride(0), v.stride(1), vt,
            anc[1] if anc else 0, anc[2] if anc else 0, pad.stride(0) if pad is not None else 0,
            *((nk.stride(0), nk.stride(1), nv.stride(0), nv.stride(1)) if new is not None else (0, 0, 0, 0)))
        status = self._attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), anc[0] if anc else None,
                              pad.data_ptr() if pad is not None else None,
                              nk.data_ptr() if nk is not None else None, nv.data_ptr() if nv is not None else None,
                              dims, strides, 1.0 / math.sqrt(K), _DTYPES[q.dtype], torch.get_num_threads())
        if status:
            raise MemoryError("beam attention kernel: out of memory")
        return out


@functools.lru_cache(maxsize=None)
def openmp_team() -> tuple[int, int, int] | None:
    """The addresses of GOMP_parallel, omp_get_thread_num and omp_get_num_threads in the OpenMP runtime
    PyTorch's CPU operations run on, where its parallel backend is OpenMP and the process can see them
    (PyTorch loads its runtime into the global namespace); else None."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        process = ctypes.CDLL(None)
        entries = tuple(ctypes.cast(getattr(process, name), ctypes.c_void_p).value
                        for name in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads"))
    except (AttributeError, OSError):
        return None
    return entries if all(entries) else None


def for_training(c_kernels: bool, device: torch.device) -> Kernels | None:
    """The kernels for training's loss and attention where ``train.c_kernels`` asks for them (CPU only), or
    None for PyTorch's operations."""
    return load() if c_kernels and device.type == "cpu" else None


@functools.lru_cache(maxsize=None)
def load() -> Kernels | None:
    """The kernels, compiled on first use (module docstring); None, logged once, if they cannot be had.

    A cached library is loaded only if it is this user's, writable by no one else, in a folder that
    is too, and its bytes hash to the SHA-256 recorded beside it when it was built
    (``CacheFolder.load``); anything else (a damaged file, a build cut short, a file another user could
    have written, a symbolic link) is built again. A cache directory that is a symbolic link, or a folder
    of this user's that another user owns or could write, is refused (``CacheFolder.open``)."""
    cc = _compiler()
    if cc is None:
        log.info("no C compiler (%s): decoding and the training loss use PyTorch's operations",
                 os.environ.get("CC") or "cc")
        return None
    march = _march()
    target = compiler_target(cc, march)
    missing = missing_flags(target, cpu_flags()) if march != "native" else []
    if missing:  # its code would stop at the first of these instructions (kernels/target.py)
        log.warning("%s=%s: this CPU lacks %s, which code built for that target may use: decoding and the "
                    "training loss use PyTorch's operations", MARCH_ENV, march, " ".join(missing))
        return None
    texts = [src.read_text() for src in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\n".join([*texts, cc, " ".join(_FLAGS), march, _cpu_signature(), target]).encode())
    name = f"aiayn-kernels-{key.hexdigest()[:16]}.so"
    try:
        cache = CacheFolder.open(cache_dir())
    except OSError as e:
        log.warning("kernel cache refused (%s): decoding and the training loss use PyTorch's operations", e)
        return None
    path, what = cache.path / name, "compile"
    with cache:
        try:
            cache.remove_leftovers()
            lib, why = cache.load(name)
            if lib is None:
                if why != NOT_BUILT:
                    log.warning("%s: %s; building it again", path, why)
                with tempfile.TemporaryDirectory(prefix="aiayn-kernels-") as tmp:  # 0700: the compiler's alone
                    reason = _compile(cc, Path(tmp) / name)
                    if reason is None:
                        cache.install(name, Path(tmp) / name)
                if reason is None:
                    what = "load"
                    lib, reason = cache.load(name)
        except OSError as e:  # e.g. the cache folder cannot be written, or its disk is full
            lib, reason = None, f"{cache.path}: {e}"
    if lib is None:
        log.warning("could not %s %s (%s): decoding and the training loss use PyTorch's operations",
                    what, " ".join(src.name for src in SOURCES), reason)
        return None
    try:
        return Kernels(lib, path)
    except AttributeError as e:
        log.warning("could not load %s (%s): decoding and the training loss use PyTorch's operations", path, e)
        return None
