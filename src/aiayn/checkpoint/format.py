"""The checkpoint file: sealed with a content checksum, written atomically, loaded without running
code (``weights_only``), gathered into an ensemble file, upgraded from older formats (averaged, §6.1:
``aiayn.checkpoint.average``).

A checkpoint is a torch file holding a dict of tensors and plain values only (docs/checkpoints.md):
the keys of ``contents.Contents`` plus ``sha256``, the checksum of everything else
(``content_sha256``), verified by every load. Files in a run directory: ckpt_step00001234.pt (kept:
the last K; 0 keeps all), last.pt, best.pt.

An ensemble file (``ensemble_checkpoint``) holds several models for translation only:
  format: "aiayn-ensemble-1"; members: a list of checkpoints as above, without training state
(all with the same tokenizers). Training, resuming, averaging and export take single checkpoints.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from aiayn.checkpoint.contents import CHECKSUM, FORMAT, with_defaults
from aiayn.checkpoint.foreign import (READS, checkpoint_kind, directory_hint, npz_hint, options_class_hint,
                                     safetensors_hint)
from aiayn.errors import UserError, WriteError
from aiayn.files import atomic_write

log = logging.getLogger(__name__)
ENSEMBLE_FORMAT = "aiayn-ensemble-1"
TRAINING_STATE = ("optimizer", "rank_optimizers", "scaler", "rng", "rank_rng", "sampler")
STEP_RE = re.compile(r"ckpt_step(\d+)\.pt$")
SAFE_TORCH = (2, 6)  # torch.load(weights_only=True) had a code-execution bypass before 2.6 (CVE-2025-32434)
UPGRADE_HINT = ("convert it once with `aiayn upgrade-checkpoint FILE` (it reads tensors, plain values and "
                "numpy arrays only, never code)")


def content_sha256(obj: Any) -> str:
    """SHA-256 of a checkpoint's contents, the file format aside: every tensor's dtype, shape and
    bytes, every plain value (None, bool, int, float, str, bytes) and the structure of the dicts,
    lists and tuples around them, in order. What ``torch.load`` gives back hashes as what was
    saved, so the check needs no second copy of the file; a type ``weights_only`` loading would
    refuse is a TypeError here, at save time."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)  # (N,)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(b"D%d" % len(obj))
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(b"L%d" % len(obj) if isinstance(obj, list) else b"U%d" % len(obj))
        for v in obj:
            _feed(h, v)
    elif obj is None or type(obj) is bool:
        h.update(repr(obj).encode())
    elif type(obj) is int:  # exact types: numpy's scalars subclass float but do not load
        h.update(b"I%d;" % obj)
    elif type(obj) is float:
        h.update(b"F" + float.hex(obj).encode() + b";")
    elif type(obj) is str:
        b = obj.encode("utf-8", "surrogatepass")
        h.update(b"S%d:" % len(b) + b)
    elif type(obj) is bytes:
        h.update(b"B%d:" % len(obj) + obj)
    else:
        raise TypeError(f"a checkpoint holds only tensors and plain values, not {type(obj).__name__}")


def sealed(obj: dict) -> dict:
    """``obj`` with its content checksum under ``CHECKSUM`` (any older one replaced)."""
    body = {k: v for k, v in obj.items() if k != CHECKSUM}
    return {**body, CHECKSUM: content_sha256(body)}


def atomic_save(obj: dict, path: str | Path) -> None:
    """``torch.save`` of ``sealed(obj)`` through ``atomic_write``: a kill at any moment leaves either
    the old file or the new one, never a torn file; a full disk is a UserError naming the file."""
    obj = sealed(obj)

    def write(f) -> None:
        try:
            torch.save(obj, f)
        except RuntimeError as exc:  # torch's writer wraps the OSError of a failed write
            cause = exc.__context__
            raise (cause if isinstance(cause, OSError) else exc)
    _write_or_explain(path, write)


def atomic_copy(src: str | Path, dst: str | Path) -> None:
    """Copy the file ``src`` to ``dst`` through ``atomic_write`` (a checkpoint written once, kept
    under a second name without serializing and hashing it again)."""
    def write(f) -> None:
        with open(src, "rb") as g:
            shutil.copyfileobj(g, f, 1 << 20)
    _write_or_explain(dst, write)


def _write_or_explain(path: str | Path, write) -> None:
    try:
        atomic_write(path, write)
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise WriteError(f"{path}: cannot write ({exc.strerror or exc}){'; free some space' if full else ''}; "
                         f"the files already there are intact") from exc


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu",
                    ensemble_ok: bool = False) -> dict:
    """The checkpoint dict of ``path``; an ensemble file only with ``ensemble_ok`` (translation).

    Read with ``weights_only``: a file that names anything but tensors and plain values (code a
    pickle would run) is refused before any of it runs. Its content checksum is verified: a
    damaged file is a UserError naming it."""
    path = Path(path)
    check_saved_file(path)
    check_torch()
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UserError(_refusal(path, str(exc))) from None
    except Exception as exc:  # a truncated or foreign file
        raise UserError(_unreadable(path, exc)) from exc
    check_archive_end(path)
    check_kind(ckpt, path, ensemble_ok)
    verify(ckpt, path)
    check_models(ckpt, path)
    return ckpt


def check_kind(ckpt: Any, path: str | Path, ensemble_ok: bool) -> None:
    """``ckpt`` an aiayn checkpoint dict, or an ensemble file with members where ``ensemble_ok``."""
    if isinstance(ckpt, dict) and ckpt.get("format") == ENSEMBLE_FORMAT:
        if not ensemble_ok:
            raise UserError(f"{path}: an ensemble of {len(ckpt.get('members', []))} models, which only translation "
                            f"reads (translate, evaluate, serve); training, resuming, averaging and export take "
                            f"single checkpoints")
        members = ckpt.get("members")
        if not members:
            raise UserError(f"{path}: an ensemble file without members")
        if not (isinstance(members, list) and all(isinstance(m, dict) for m in members)):
            raise UserError(f"{path}: not an aiayn ensemble file: its members are not a list of checkpoints "
                            f"(what aiayn ensemble writes)")
    elif not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        kind = checkpoint_kind(ckpt)
        if kind is not None:
            raise UserError(f"{path}: {kind}, not an aiayn checkpoint; {READS}")
        raise UserError(f"{path}: not an aiayn checkpoint (format {ckpt.get('format') if isinstance(ckpt, dict) else type(ckpt)})")


def check_models(ckpt: dict, path: str | Path) -> None:
    """Every model of ``ckpt`` (an ensemble file's members) with its model sections upgraded in place
    (``upgrade_model_sections``) and checked (``check_model_config``)."""
    ensemble = ckpt["format"] == ENSEMBLE_FORMAT
    for n, member in enumerate(ckpt["members"] if ensemble else [ckpt]):
        upgrade_model_sections(member)
        check_model_config(member, f"{path} (member {n})" if ensemble else str(path))


# Settings that checkpoints of older versions kept in their model sections: how a run computes, not
# what; they are the run's now (TrainConfig.fast_dropout, TrainConfig.attn_fp32; aiayn.execution).
EXECUTION_FIELDS = ("fast_dropout", "attn_fp32")


# The fields of ModelConfig's first version: a model section that names them all is a whole configuration
# (a checkpoint's, a run's config.json), not a recipe's changes to a preset.
FIRST_MODEL_FIELDS = frozenset(
    "vocab_size tgt_vocab_size n_layers n_dec_layers d_model d_ff n_heads d_k d_v p_drop p_drop_attn p_drop_ffn "
    "pre_norm learned_positions max_positions tie_embeddings tie_src_tgt_embeddings scale_embeddings "
    "layer_norm_eps pad_id bos_id eos_id".split())


def upgrade(section: dict) -> tuple[dict, dict]:
    """A model section as any version wrote it -> (its ModelConfig fields, the ``EXECUTION_FIELDS`` it held).
    A whole configuration written before ``attn_bias`` (``FIRST_MODEL_FIELDS``, without it) had biases on
    the attention projections (§3.2.2's have none, the default since): ``attn_bias`` true."""
    model = {k: v for k, v in section.items() if k not in EXECUTION_FIELDS}
    if "attn_bias" not in model and FIRST_MODEL_FIELDS <= model.keys():
        model["attn_bias"] = True
    return model, {k: v for k, v in section.items() if k in EXECUTION_FIELDS}


def upgrade_model_sections(ckpt: dict) -> None:
    """A checkpoint of an older version, in place (``load_checkpoint``): the execution settings its
    model sections held (``EXECUTION_FIELDS``) leave them, and join the run's training section where
    it does not set them itself."""
    if isinstance(ckpt.get("model_config"), dict):
        ckpt["model_config"] = upgrade(ckpt["model_config"])[0]
    run = ckpt.get("run_config")
    if isinstance(run, dict) and isinstance(run.get("model"), dict):
        run["model"], execution = upgrade(run["model"])
        if execution and isinstance(run.get("train"), dict):
            run["train"] = {**execution, **run["train"]}


def check_model_config(ckpt: dict, label: str) -> None:
    """A checkpoint's model configuration within ``aiayn.model.config.LIMITS`` and describing the
    tensors it stores (the model is built on the meta device: no memory), and those tensors finite
    floating point values, checked before any model is built from it: a UserError naming the file
    and the field."""
    from aiayn.config import ConfigError, from_dict
    from aiayn.model import ModelConfig, Transformer
    from aiayn.model.config import check_limits

    where = [("model_config", ckpt.get("model_config"))]
    if isinstance(ckpt.get("run_config"), dict):
        where.append(("run_config.model", ckpt["run_config"].get("model")))
    for key, data in where:
        if data is None and key == "run_config.model":
            continue
        if not isinstance(data, dict):
            raise UserError(f"{label}: {key} is not a configuration ({type(data).__name__})")
        try:
            check_limits(data)
        except ConfigError as exc:
            raise UserError(f"{label}: {key}.{exc}") from None
    state = ckpt.get("model")
    if not isinstance(state, dict):
        return
    try:
        cfg = from_dict(ModelConfig, ckpt["model_config"])
        with torch.device("meta"):
            wanted = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    except ConfigError as exc:
        raise UserError(f"{label}: model_config: {exc}") from None
    stored = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    differ = [f"{k} {stored.get(k, 'missing')} stored, {shape} by model_config" for k, shape in wanted.items()
              if stored.get(k) != shape] + [f"{k} stored, not in the model" for k in stored if k not in wanted]
    if differ:
        raise UserError(f"{label}: model_config does not describe the stored weights: " + "; ".join(differ[:3])
                        + (f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""))
    for k, v in state.items():  # what training writes, and what load_state_dict would cast in silently
        if not (isinstance(v, torch.Tensor) and v.is_floating_point()):
            raise UserError(f"{label}: model.{k} holds {getattr(v, 'dtype', type(v).__name__)} values, not "
                            f"floating point weights")
        if not bool(v.isfinite().all()):
            raise UserError(f"{label}: model.{k} holds NaN or infinite values (training never writes them); "
                            f"use another copy or an earlier checkpoint")


def check_torch(version: str | None = None) -> None:
    """Refuse to read checkpoints with a torch whose ``weights_only`` loading can run code."""
    version = version or torch.__version__
    found = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if found < SAFE_TORCH:
        raise UserError(f"torch {version} can run code hidden in a checkpoint while loading it (its weights_only "
                        f"loading had a bypass before 2.6); install torch>={SAFE_TORCH[0]}.{SAFE_TORCH[1]}")


def verify(ckpt: dict, path: str | Path) -> None:
    """Check ``ckpt``'s content checksum (what ``atomic_save`` stored) against its contents."""
    want = ckpt.get(CHECKSUM)
    if want is None:
        raise UserError(f"{path}: the checkpoint carries no checksum (written by an older aiayn); {UPGRADE_HINT}")
    try:
        got = content_sha256({k: v for k, v in ckpt.items() if k != CHECKSUM})
    except TypeError as exc:
        raise UserError(f"{path}: not an aiayn checkpoint ({exc})") from None
    if got != want:
        raise UserError(f"{path}: damaged: its contents do not match the checksum written with them "
                        f"(sha256 {got[:16]}... != {str(want)[:16]}...); use another copy or an earlier checkpoint")


TORCH_SAVE_STARTS = (b"PK\x03\x04", b"\x80")  # torch.save's zip archive; the pickle of torch before 1.6


def check_saved_file(path: Path) -> None:
    """``path`` is a file that begins as ``torch.save`` writes one and, a zip archive, is not cut short
    (``_has_archive_end``), else a UserError saying what it is."""
    if path.is_dir():
        raise UserError(f"{path}: {directory_hint(path)}")
    try:
        with open(path, "rb") as f:
            head = f.read(10)
    except FileNotFoundError:
        raise UserError(f"{path}: checkpoint not found") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    if not head:
        raise UserError(f"{path}: empty, not a checkpoint")
    if not head.startswith(TORCH_SAVE_STARTS):
        raise UserError(f"{path}: {safetensors_hint(head) or f'not a checkpoint: it begins {head[:4]!r}, not as torch.save writes a file'}")
    if head.startswith(TORCH_SAVE_STARTS[0]) and not _has_archive_end(path):
        raise UserError(f"{path}: not a readable checkpoint (its zip archive has no end record in its last 64 KiB: "
                        f"cut short by a copy, a download or a write that stopped early, or followed by other "
                        f"bytes); use another copy or an earlier checkpoint")


ZIP_END = b"PK\x05\x06"  # the zip archive's end record, 22 bytes where no comment follows (torch.save writes none)
ZIP_END_SEARCH = 22 + 0xFFFF  # where a zip reader looks for the end record: the record and the longest comment


def _has_archive_end(path: Path) -> bool:
    """Whether ``path``'s last ``ZIP_END_SEARCH`` bytes hold a whole zip end record (22 bytes): a file
    cut short has none, nor one followed by more than 64 KiB (torch.load's errors then name no cause:
    "Invalid argument", "failed finding central directory")."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - ZIP_END_SEARCH))
        tail = f.read()
    found = tail.rfind(ZIP_END)
    return found >= 0 and len(tail) - found >= 22


def check_archive_end(path: Path) -> None:
    """A file torch.save wrote as a zip archive (and torch.load read) ends with the archive's end
    record: bytes after it (appended, or the tail of a longer file written over) are a UserError."""
    with open(path, "rb") as f:
        if f.read(4) != TORCH_SAVE_STARTS[0]:
            return  # the pickle of torch before 1.6 (older files aiayn upgrade-checkpoint reads)
        size = f.seek(0, 2)
        f.seek(max(0, size - 22))
        if f.read(4) != ZIP_END:
            raise UserError(f"{path}: damaged: bytes follow the end of its archive (appended to, or written over "
                            f"a longer file); use another copy or an earlier checkpoint")


def _refusal(path: Path, message: str) -> str:
    """The error for a file ``weights_only`` loading refused, naming what it would have run."""
    found = re.search(r"GLOBAL ([\w.]+)", message)
    if found is None:
        return f"{path}: not a readable checkpoint (not what torch.save writes)"
    name = found.group(1)
    if name.startswith("numpy"):
        return f"{path}: a checkpoint in the older format (its RNG state holds numpy objects); {UPGRADE_HINT}"
    if options_class_hint(name) is not None:
        return f"{path}: {options_class_hint(name)}"
    return (f"{path}: refused: it is not plain data but names {name}, which loading would call "
            f"(checkpoints hold only tensors and plain values)")


def _unreadable(path: Path, exc: Exception) -> str:
    """The error for a file torch.load could not read: a numpy archive is named, else torch's reason."""
    return f"{path}: {npz_hint(path) or f'not a readable checkpoint ({exc.__class__.__name__}: {exc})'}"


def step_checkpoints(run_dir: str | Path) -> list[Path]:
    """Step checkpoints of a run directory, oldest first."""
    found = []
    for p in Path(run_dir).glob("ckpt_step*.pt"):
        m = STEP_RE.search(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def prune(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` step checkpoints; 0 keeps them all."""
    if keep_last <= 0:
        return
    ckpts = step_checkpoints(run_dir)
    for p in ckpts[: max(0, len(ckpts) - keep_last)]:
        p.unlink(missing_ok=True)


def tokenizer_hashes(tokenizers: dict | None) -> tuple:
    """The source and target tokenizer models' SHA-256 of a checkpoint's ``tokenizers`` entry: what
    says two checkpoints (or a checkpoint and a data directory, ``aiayn.checkpoint.run.tokenizer_payload``)
    share their vocabularies. Where the entry lacks a hash (loading accepts that), the model bytes'
    own; None where it has neither."""
    toks = tokenizers or {}

    def digest(side: str) -> str | None:
        data = toks.get(side)
        stored = toks.get(f"{side}_sha256")
        if stored is not None or not isinstance(data, (bytes, bytearray)):
            return stored
        return hashlib.sha256(data).hexdigest()
    return digest("src"), digest("tgt")


def checkpoint_members(paths: list[str | Path], map_location: str | torch.device = "cpu") -> list[tuple[str, dict]]:
    """(label, checkpoint dict) of every model in ``paths`` (checkpoints or ensemble files), in
    order; the members of an ensemble file are labelled "PATH (member N)". Their tokenizers must
    be the same (``tokenizer_hashes``): the models of an ensemble predict over one vocabulary.
    """
    out: list[tuple[str, dict]] = []
    for p in paths:
        ckpt = load_checkpoint(p, map_location=map_location, ensemble_ok=True)
        is_ensemble = ckpt["format"] == ENSEMBLE_FORMAT
        for n, m in enumerate(ckpt["members"] if is_ensemble else [ckpt]):
            label = f"{p} (member {n})" if is_ensemble else str(p)
            if out:
                first_label, first = out[0]
                if tokenizer_hashes(m.get("tokenizers")) != tokenizer_hashes(first.get("tokenizers")):
                    raise UserError(f"{label}: its tokenizers differ from those of {first_label}; "
                                    f"the models of an ensemble must share one vocabulary")
            out.append((label, m))
    return out


def ensemble_checkpoint(paths: list[str | Path]) -> dict:
    """One file holding the models of ``paths`` (checkpoints or ensemble files), to translate with
    their ensemble (``aiayn.decode.adapter.EnsembleDecoder``). Their tokenizers must be the same
    (the members predict over one vocabulary); training state is left out.
    """
    if not paths:
        raise UserError("no checkpoints to put in an ensemble")
    members = checkpoint_members(paths)
    return {"format": ENSEMBLE_FORMAT, "members": [{k: v for k, v in m.items() if k not in (*TRAINING_STATE, CHECKSUM)}
                                                   for _, m in members],
            "ensembled_from": [label for label, _ in members]}


def upgrade_checkpoint(path: str | Path, out: str | Path) -> dict:
    """A checkpoint or ensemble file of an older aiayn, rewritten in today's format into ``out``:
    numpy RNG states become tensors (``rng_state_from_legacy``), the keys a training checkpoint of
    its time lacked are added at their defaults (``contents.with_defaults``) and the checksum is added.
    It is read with ``weights_only`` plus numpy's array reconstruction only: still no code runs.
    A file that carries a checksum is verified first: a damaged or edited file is refused, not
    sealed again (a new seal would make it verify). The converted checkpoint passes every check of
    ``load_checkpoint`` before a byte of ``out`` is written: a refused file leaves ``out`` (and an
    input converted in place) as it was."""
    import numpy as np

    path = Path(path)
    check_saved_file(path)
    check_torch()
    rebuild = _numpy_reconstruct()
    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), rebuild,
               (rebuild, "numpy.core.multiarray._reconstruct")]  # the name numpy 1 wrote
    try:
        with torch.serialization.safe_globals(allowed):
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UserError(_refusal(path, str(exc)).replace(UPGRADE_HINT, "it cannot be converted")) from None
    except Exception as exc:
        raise UserError(_unreadable(path, exc)) from exc
    check_archive_end(path)
    check_kind(ckpt, path, ensemble_ok=True)
    if CHECKSUM in ckpt:
        verify(ckpt, path)
    for c in ckpt.get("members") or [ckpt]:
        if isinstance(c.get("rng"), dict) and isinstance(c["rng"].get("numpy"), tuple):
            c["rng"] = rng_state_from_legacy(c["rng"])
    if "members" not in ckpt:
        ckpt = with_defaults(ckpt)  # the keys an older training checkpoint lacks (``contents.Contents``)
    check_models(ckpt, path)  # what load_checkpoint would refuse, refused before anything is written
    try:
        ckpt = sealed(ckpt)
    except TypeError as exc:  # a value weights_only loading would refuse
        raise UserError(f"{path}: cannot be converted: {exc}") from None
    atomic_save(ckpt, out)
    return ckpt


def rng_state_from_legacy(state: dict) -> dict:
    """``rng_state()``'s layout from that of checkpoints written before it (numpy's state as
    numpy's tuple, Python's as its tuple, CUDA's as a list over devices): what
    ``aiayn upgrade-checkpoint`` converts."""
    import numpy as np

    name, keys, pos, has_gauss, gauss = state["numpy"]
    version, words, py_gauss = state["python"]
    out = {"torch": state["torch"],
           "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
                     "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
           "python": {"version": int(version), "words": torch.tensor(words, dtype=torch.int64), "gauss": py_gauss}}
    cuda = state.get("cuda")
    if cuda is not None:
        out["cuda"] = cuda[0] if isinstance(cuda, (list, tuple)) else cuda
    return out


def _numpy_reconstruct():
    import numpy as np
    core = getattr(np, "_core", None) or np.core
    return core.multiarray._reconstruct
