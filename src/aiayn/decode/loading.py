"""What a ``Translator`` (decode/translator.py) is made of: the models and tokenizers of checkpoints,
the device, the decoding copy of a model for a precision, the C kernels.

A checkpoint (``aiayn.checkpoint``) is self-contained: ``model_config``, ``model`` (state
dict) and ``tokenizers`` (the SentencePiece model bytes and their sha256). Loading checks that
the stored bytes match their hashes and that the vocabulary sizes match the model.
"""
from __future__ import annotations

import copy
import hashlib
import logging
from pathlib import Path
from typing import Sequence

import torch

from aiayn.config import ConfigError, from_dict, replace
from aiayn.data.vocab import Tokenizer
from aiayn.decode.config import CHECKPOINT_FIELDS, TRANSLATE_DECODE, DecodeConfig
from aiayn.decode.int8 import Int8Linear, int8_copy, require_int8_product
from aiayn.decode.packed import PackedLinear, packed_copy, resolve_library
from aiayn.errors import UserError
from aiayn.kernels.loader import Kernels, load as load_kernels
from aiayn.model import ModelConfig, Transformer
from aiayn.execution import pad_linear_rows
from aiayn.execution.linear import ROW_BITS

log = logging.getLogger(__name__)


def _tokenizer_from_checkpoint(toks: dict, side: str, path: Path) -> Tokenizer:
    data = toks.get(side)
    if not isinstance(data, (bytes, bytearray)):
        raise UserError(f"{path}: checkpoint has no {side} tokenizer model (tokenizers.{side})")
    digest = hashlib.sha256(data).hexdigest()
    if toks.get(f"{side}_sha256") not in (None, digest):
        raise UserError(f"{path}: the stored {side} tokenizer does not match its sha256 "
                        f"({digest[:12]} vs {str(toks[f'{side}_sha256'])[:12]}); the checkpoint is corrupt")
    return Tokenizer(bytes(data), name=f"{path}:tokenizers.{side}")


def _model_from_checkpoint(ckpt: dict, path: Path, device) -> tuple[Transformer, Tokenizer, Tokenizer]:
    for key in ("model_config", "model", "tokenizers"):
        if key not in ckpt:
            raise UserError(f"{path}: checkpoint has no {key!r} entry")
    try:
        cfg = from_dict(ModelConfig, ckpt["model_config"])
    except ConfigError as exc:
        raise UserError(f"{path}: bad model_config: {exc}") from exc
    src_tok = _tokenizer_from_checkpoint(ckpt["tokenizers"], "src", path)
    tgt_tok = _tokenizer_from_checkpoint(ckpt["tokenizers"], "tgt", path)
    if src_tok.vocab_size != cfg.vocab_size or tgt_tok.vocab_size != cfg.target_vocab_size:
        raise UserError(f"{path}: tokenizer vocabularies ({src_tok.vocab_size} source, {tgt_tok.vocab_size} "
                        f"target) do not match the model ({cfg.vocab_size}, {cfg.target_vocab_size})")
    with torch.random.fork_rng(devices=[]):  # the caller's RNG kept: these weights are replaced below
        model = Transformer(cfg)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        raise UserError(f"{path}: weights do not fit the model_config: {exc}") from exc
    return model.to(device).eval(), src_tok, tgt_tok


def load_model_for_inference(path: str | Path, device: str | torch.device = "cpu"
                             ) -> tuple[Transformer, Tokenizer, Tokenizer]:
    """Model (eval mode) and source/target tokenizers from a checkpoint, with consistency checks. The
    caller's random number generator is left as it was (the initial weights' draws are undone)."""
    from aiayn.checkpoint import load_checkpoint

    path = Path(path)
    return _model_from_checkpoint(load_checkpoint(path, map_location=device), path, device)


def stored_settings(paths: list[str]) -> dict:
    """The decoding settings the checkpoints ``paths`` carry (their ``decode`` entries, of
    ``CHECKPOINT_FIELDS``: the α the demo chose, an imported model's generation settings), {} for
    none. Several checkpoints (or an ensemble file's members) give theirs where every one carries
    the same; where they differ, none, with a warning: no one member's α is the ensemble's. Only
    those entries are read (the tensors are mapped, not read); the Translator's load then verifies
    the whole files."""
    entries = [entry for p in paths for entry in _decode_entries(p)]
    settings = [s for _, s in entries]
    if not entries or all(s is None for s in settings):
        return {}
    if any(s != settings[0] for s in settings[1:]):
        log.warning("the checkpoints carry different decoding settings (%s); their ensemble decodes with "
                    "aiayn's defaults where no option is given",
                    "; ".join(f"{where}: {s or 'none'}" for where, s in entries))
        return {}
    return checked_settings(settings[0], f"{entries[0][0]}: its decode entry")


def _decode_entries(path: str) -> list[tuple[str, dict | None]]:
    """(where, its ``decode`` entry or None) of the checkpoint ``path``; of an ensemble file, its own
    entry where it has one (the α ``aiayn demo --members N`` chose for the ensemble, which replaces
    those its members were tuned with alone), else each member's; [] where it is no file or not a
    checkpoint (the Translator's load says which)."""
    from aiayn.checkpoint import check_torch
    if not Path(path).is_file():
        return []
    check_torch()
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a checkpoint, or an older file format
        return []
    if not isinstance(ckpt, dict):
        return []
    if isinstance(ckpt.get("members"), list) and ckpt.get("decode") is None:
        return [(f"{path} (member {k})", m.get("decode") if isinstance(m, dict) else None)
                for k, m in enumerate(ckpt["members"])]
    return [(path, ckpt.get("decode"))]


def checked_settings(settings, where: str) -> dict:
    """``settings`` (a checkpoint's or an export's ``decode`` entry) as DecodeConfig fields a checkpoint
    may carry (``CHECKPOINT_FIELDS``) of their types and within their bounds; else a UserError
    beginning with ``where``."""
    kinds = {f: DecodeConfig.__dataclass_fields__[f].type for f in CHECKPOINT_FIELDS}
    ok = {"int": lambda v: type(v) is int, "float": lambda v: type(v) in (int, float),
          "bool": lambda v: type(v) is bool, "str": lambda v: type(v) is str}
    bad = ([f"{k} = {v!r}" for k, v in settings.items() if k not in kinds or not ok[kinds[k]](v)]
           if isinstance(settings, dict) else [repr(settings)])
    if bad:
        raise UserError(f"{where} holds {', '.join(bad[:3])}, not settings of {', '.join(kinds)}")
    try:
        replace(TRANSLATE_DECODE, **settings)
    except ConfigError as exc:
        raise UserError(f"{where}: {exc}") from None
    return settings


def inference_device(spec: str | torch.device) -> torch.device:
    """The device to translate on: ``auto`` is the current CUDA device when CUDA is present, else the
    CPU; anything else as torch reads it (cpu, cuda, cuda:N), refused clearly when CUDA is absent."""
    if isinstance(spec, torch.device):
        return spec
    if spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise UserError(f"--device {spec!r}: not a device (auto, cpu, cuda or cuda:N)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {spec}: CUDA is not available here; use --device cpu or auto")
    return device


def load_models_for_inference(paths: str | Path | Sequence[str | Path], device: str | torch.device = "cpu"
                              ) -> tuple[list[Transformer], Tokenizer, Tokenizer]:
    """The models of one or more checkpoints or ensemble files (in order) and their shared tokenizers,
    on ``device`` (``inference_device``: "auto" is CUDA when present)."""
    from aiayn.checkpoint import checkpoint_members

    device = inference_device(device)

    models: list[Transformer] = []
    toks: tuple[Tokenizer, Tokenizer] | None = None
    for label, member in checkpoint_members([paths] if isinstance(paths, (str, Path)) else list(paths), device):
        model, src_tok, tgt_tok = _model_from_checkpoint(member, Path(label), device)
        toks = toks or (src_tok, tgt_tok)
        models.append(model)
    if toks is None:
        raise UserError("no checkpoint given")
    return models, toks[0], toks[1]


def model_for_precision(model: Transformer, precision: str, kernels: Kernels | None = None,
                        packed: bool = False, library: str = "auto", row_bits: int = ROW_BITS) -> Transformer:
    """The model to decode with: itself (fp32), a copy whose linear maps use packed weights (fp32 with
    ``packed``, a float32 model on a CPU whose PyTorch has ``library``'s packed linear maps, "auto" as
    ``resolve_library`` picks it; decode/packed.py), or a copy cast to bfloat16 or (on CUDA) float16, or made
    int8 (int8-bf16: int8 linear maps, bfloat16 between them; decode/int8.py; ``kernels`` do the passes
    around the int8 products, and the products themselves on CPUs without VNNI, where int8 is refused
    without them), so the caller's model is left as it was. The bfloat16 copy, and the packed copy on
    oneDNN, pad the rows of their linear maps to keep ``row_bits`` leading bits (``aiayn.execution.linear``,
    decode/packed.py)."""
    if any(isinstance(m, (Int8Linear, PackedLinear)) for m in model.modules()):
        return model  # already a decoding copy (the service passes its Translator's models on)
    if precision == "bf16":
        if next(model.parameters()).dtype == torch.bfloat16:
            return model  # already a bfloat16 decoding copy (as above; casting a copy again changes nothing)
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        pad_linear_rows(bf16, row_bits)  # a bounded set of oneDNN kernels (aiayn/execution/linear.py)
        return bf16
    if precision == "fp16":
        require_cuda_for_fp16(model)
        if next(model.parameters()).dtype == torch.float16:
            return model  # already a float16 decoding copy
        return copy.deepcopy(model).to(torch.float16)
    if precision in ("int8", "int8-bf16"):
        require_int8_product(precision, kernels)  # slower than fp32 without VNNI or the C kernels
    if precision == "int8":
        return int8_copy(model, kernels=kernels)
    if precision == "int8-bf16":
        return int8_copy(model, torch.bfloat16, kernels)
    p = next(model.parameters())
    if packed and p.dtype == torch.float32 and p.device.type == "cpu":
        chosen = resolve_library(library)
        if chosen is not None:
            return packed_copy(model, chosen, row_bits)
    return model


def require_cuda_for_fp16(model: Transformer) -> None:
    """Refuse precision fp16 off CUDA: it is for GPUs without native bf16 (the T4, the V100), where
    float16 is the fast 16-bit type; a CPU computes float16 products slowly, or not natively."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise UserError(f"precision fp16 runs on CUDA (GPUs without native bf16: T4, V100), not on {device.type}; "
                        "on a CPU use bf16 (with AVX512-BF16 or AMX) or fp32")


def require_precision(cfg: DecodeConfig, model: Transformer) -> None:
    """Refuse ``cfg.precision`` where ``model_for_precision`` would: fp16 off CUDA, int8 where its products
    would be slower than fp32's (``require_int8_product``). For a Translator to say so at once, not at
    its first batch, nor in each of its worker processes."""
    if cfg.precision == "fp16":
        require_cuda_for_fp16(model)
    elif cfg.precision in ("int8", "int8-bf16"):
        require_int8_product(cfg.precision, decoding_kernels(cfg, model))


def decoding_kernels(cfg: DecodeConfig, model: Transformer) -> Kernels | None:
    """The C kernels (kernels/loader.py: beam-step attention, the int8 passes) when ``cfg.c_kernels`` asks
    for them and the model is on the CPU; None (PyTorch's operations) otherwise or without a C compiler."""
    if not cfg.c_kernels or next(model.parameters()).device.type != "cpu":
        return None
    return load_kernels()
