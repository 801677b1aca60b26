"""What ``aiayn import`` reads of a Marian directory (``MarianDir``), checked before any of it is used.

The directory comes from elsewhere (a model hub, a download), so nothing in it is trusted: each
refusal is one ``UserError`` line naming the file, and no size that a file states is allocated
before it is checked.
- config.json: a JSON object. The fields that size aiayn's model are held to the limits every
  checkpoint load applies (``aiayn.model.config.check_limits``: one source), before the weights
  are read; the other fields the import reads must be of their kind (``CONFIG_KINDS``).
- the weights (``model.safetensors``, or ``pytorch_model.bin`` read with ``weights_only``): named
  floating-point tensors of the shapes config.json gives them (``weight_refusals``).
- vocab.json and target_vocab.json: objects of pieces to integer ids; tokenizer_config.json and
  generation_config.json: objects.
"""
from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from aiayn.config import ConfigError
from aiayn.errors import UserError
from aiayn.interop.hf_export import model_permutation
from aiayn.model.config import check_limits
from aiayn.model.positional import sinusoidal_table

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# config.json's fields that size the model -> the ModelConfig field whose limit applies (LIMITS)
SIZES = {"encoder_layers": "n_layers", "decoder_layers": "n_dec_layers", "d_model": "d_model",
         "encoder_ffn_dim": "d_ff", "decoder_ffn_dim": "d_ff", "encoder_attention_heads": "n_heads",
         "decoder_attention_heads": "n_heads", "vocab_size": "vocab_size", "decoder_vocab_size": "tgt_vocab_size",
         "max_position_embeddings": "max_positions"}
_KINDS = {"a number": lambda v: type(v) in (int, float), "a string": lambda v: type(v) is str,
          "a probability in [0, 1)": lambda v: type(v) in (int, float) and 0 <= v < 1,
          "true or false": lambda v: type(v) is bool, "an id (an integer >= 0)": lambda v: type(v) is int and v >= 0,
          "a list of strings": lambda v: v is None or (type(v) is list and all(type(x) is str for x in v))}
CONFIG_KINDS = {"dropout": "a probability in [0, 1)", "attention_dropout": "a probability in [0, 1)",
                "activation_dropout": "a probability in [0, 1)", "encoder_layerdrop": "a number",
                "decoder_layerdrop": "a number", "activation_function": "a string", "scale_embedding": "true or false",
                "share_encoder_decoder_embeddings": "true or false", "tie_word_embeddings": "true or false",
                "pad_token_id": "an id (an integer >= 0)", "eos_token_id": "an id (an integer >= 0)",
                "decoder_start_token_id": "an id (an integer >= 0)", "architectures": "a list of strings"}
EMBEDDING_KEYS = ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                  "lm_head.weight", "final_logits_bias")
POSITION_KEYS = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")
# What a position table computed in float32 elsewhere may differ by (sin and cos of angles up to
# max_position_embeddings radians, computed in single precision), besides the rounding to its dtype.
FP32_TABLE_ATOL = 1e-4
# generate's settings that config.json held before generation_config.json (transformers 4)
CONFIG_GENERATION_KEYS = ("num_beams", "length_penalty", "max_length", "min_length", "no_repeat_ngram_size",
                          "do_sample", "temperature", "top_k", "top_p", "bad_words_ids", "early_stopping",
                          "forced_eos_token_id", "renormalize_logits", "repetition_penalty")


@dataclass
class MarianDir:
    """What an import reads from a Marian directory."""
    path: Path
    config: dict  # MarianConfig.to_dict(): transformers' defaults filled in
    state: dict[str, Tensor]  # the weights as saved, in float32
    dtypes: dict[str, torch.dtype]  # each weight's dtype in the file
    weights_file: Path
    src_vocab: dict[str, int]
    tgt_vocab: dict[str, int]  # src_vocab itself unless the vocabularies are separate
    spm: dict[str, bytes]  # "src", "tgt": source.spm, target.spm
    tokens: dict[str, str]  # "unk", "eos", "pad": MarianTokenizer's special pieces
    generation: dict  # generate's settings: generation_config.json, else config.json's ({} when none)
    generation_file: Path  # the file they came from


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (what a foreign library raises may span several)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def read_json(path: Path) -> dict:
    """The JSON object of ``path``: anything else (unreadable, not JSON, a list) is refused."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: cannot read ({one_line(exc)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a JSON {type(data).__name__}, not the object (key: value) it should hold")
    return data


def read_vocab(path: Path) -> dict[str, int]:
    """vocab.json / target_vocab.json: an object of pieces to integer ids."""
    vocab = read_json(path)
    bad = next(((p, i) for p, i in vocab.items() if type(i) is not int), None)
    if bad is not None:
        raise UserError(f"{path}: the piece {bad[0]!r} has the id {bad[1]!r}, not an integer")
    return vocab


def check_config(c: dict, path: Path) -> None:
    """config.json's sizes within ``check_limits`` (each named by its Marian field) and the other
    fields the import reads of their kind (``CONFIG_KINDS``); absent fields pass."""
    for field, name in SIZES.items():
        if field not in c or (c[field] is None and field == "decoder_vocab_size"):  # None: vocab_size's
            continue
        try:
            if c[field] is None:  # which check_limits passes for n_dec_layers (aiayn's None: n_layers)
                raise ConfigError(f"{name} = None: not an integer")
            check_limits({name: c[field]})
        except ConfigError as exc:
            raise UserError(f"{path}: {field}: {exc} (aiayn's limit on {name})") from None
    if "max_position_embeddings" in c and "d_model" in c:
        try:
            check_limits({"max_positions": c["max_position_embeddings"], "d_model": c["d_model"]})
        except ConfigError as exc:
            raise UserError(f"{path}: max_position_embeddings: {exc}") from None
    for field, kind in CONFIG_KINDS.items():
        if field in c and not _KINDS[kind](c[field]):
            raise UserError(f"{path}: {field} = {c[field]!r}: not {kind}")


def read_config(path: Path) -> tuple[dict, dict]:
    """config.json as written and with transformers' ``MarianConfig`` defaults filled in, checked
    (``check_config``) before and after (a transformers that validates nothing passes whatever the
    file says)."""
    name = path / "config.json"
    raw = read_json(name)
    if "model_type" not in raw:
        run = (path / "last.pt").is_file() or (path / "train_log.jsonl").is_file()
        raise UserError(f"{name}: no model_type: not a Hugging Face model's configuration"
                        + ("; an aiayn run directory's model is its best.pt or last.pt, which needs no import"
                           if run else "; aiayn imports Marian models (MarianMTModel)"))
    if raw["model_type"] != "marian":
        raise UserError(f"{path}: a {raw['model_type']!r} model; aiayn imports Marian models (MarianMTModel)")
    check_config(raw, name)
    try:
        from transformers import MarianConfig
    except ImportError as exc:
        raise UserError("aiayn import --format hf needs transformers: pip install transformers (aiayn[hf])") from exc
    try:
        config = MarianConfig.from_pretrained(str(path)).to_dict()
    except Exception as exc:  # transformers' own validation, whatever it raises
        raise UserError(f"{name}: transformers' MarianConfig refuses it ({one_line(exc)})") from None
    check_config(config, name)
    return raw, config


def read_weights(path: Path) -> tuple[dict[str, Tensor], dict[str, torch.dtype], Path]:
    """The weights (float32), each one's dtype in the file, and the file: a dict of named
    floating-point tensors, read without running code, or refused."""
    for name in WEIGHT_FILES:
        f = path / name
        if not f.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                state = load_file(f)
            else:
                state = torch.load(f, map_location="cpu", weights_only=True)  # no code from the file runs
        except pickle.UnpicklingError as exc:  # weights_only's refusal of what would run code
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            raise UserError(f"{f}: refused: it names {found.group(1) if found else 'an object'}, which loading would "
                            f"call (weights are tensors only)") from None
        except Exception as exc:  # a damaged file, random bytes
            raise UserError(f"{f}: not readable weights ({one_line(exc)})") from None
        if not isinstance(state, dict):
            raise UserError(f"{f}: holds a {type(state).__name__}, not a dict of named tensors")
        bad = next((k for k, v in state.items() if not (isinstance(k, str) and isinstance(v, Tensor)
                                                       and v.is_floating_point())), None)
        if bad is not None:
            raise UserError(f"{f}: {bad!r} is a {type(state[bad]).__name__}"
                            f"{' of ' + str(state[bad].dtype) if isinstance(state[bad], Tensor) else ''}, "
                            f"not a floating-point tensor")
        return {k: v.float() for k, v in state.items()}, {k: v.dtype for k, v in state.items()}, f
    raise UserError(f"{path}: no weights ({' or '.join(WEIGHT_FILES)}; sharded weights are not read)")


def _token(value, default: str) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content", default)
    return value if isinstance(value, str) else default


def read_marian_dir(path: str | Path) -> MarianDir:
    """Config (transformers' ``MarianConfig``, for its defaults), weights, vocabularies,
    SentencePiece models and generation settings, each checked as the module docstring says."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: {'not a directory' if path.exists() else 'not found'} (the folder that "
                        f"MarianMTModel.save_pretrained writes)")
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: no config.json (a directory that MarianMTModel.save_pretrained wrote?)")
    raw, config = read_config(path)  # its sizes checked before anything is read or allocated from them
    tok_cfg = read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    tokens = {k: _token(tok_cfg.get(f"{k}_token"), d) for k, d in (("unk", "<unk>"), ("eos", "</s>"), ("pad", "<pad>"))}
    files = {"src": path / "source.spm", "tgt": path / "target.spm", "vocab": path / "vocab.json"}
    missing = [f.name for f in files.values() if not f.is_file()]
    if missing:
        raise UserError(f"{path}: no {', '.join(missing)} (MarianTokenizer's files)")
    src_vocab = read_vocab(files["vocab"])
    separate = bool(tok_cfg.get("separate_vocabs")) or not config.get("share_encoder_decoder_embeddings", True)
    tgt_vocab = src_vocab
    if separate and (path / "target_vocab.json").is_file():
        tgt_vocab = read_vocab(path / "target_vocab.json")
    elif tok_cfg.get("separate_vocabs"):  # MarianTokenizer cannot load it; vocab.json would number the wrong side
        raise UserError(f"{path}: tokenizer_config.json sets separate_vocabs but there is no target_vocab.json "
                        f"(the target side's vocabulary)")
    gen = path / "generation_config.json"
    if gen.is_file():
        generation = read_json(gen)
    else:
        gen, generation = path / "config.json", {k: raw[k] for k in CONFIG_GENERATION_KEYS if k in raw}
    state, dtypes, weights_file = read_weights(path)
    return MarianDir(path, config, state, dtypes, weights_file, src_vocab, tgt_vocab,
                     {"src": files["src"].read_bytes(), "tgt": files["tgt"].read_bytes()}, tokens, generation, gen)


def layer_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """The names and shapes of MarianMTModel's layer weights under config ``c`` (within its limits)."""
    D = c["d_model"]
    out: dict[str, tuple[int, ...]] = {}

    def attn(prefix: str) -> None:
        for p in ("q", "k", "v", "out"):
            out[f"{prefix}.{p}_proj.weight"], out[f"{prefix}.{p}_proj.bias"] = (D, D), (D,)

    def norm(prefix: str) -> None:
        out[f"{prefix}.weight"], out[f"{prefix}.bias"] = (D,), (D,)

    def ffn(prefix: str, F: int) -> None:
        out[f"{prefix}.fc1.weight"], out[f"{prefix}.fc1.bias"] = (F, D), (F,)
        out[f"{prefix}.fc2.weight"], out[f"{prefix}.fc2.bias"] = (D, F), (D,)
        norm(f"{prefix}.final_layer_norm")

    for i in range(c["encoder_layers"]):
        p = f"model.encoder.layers.{i}"
        attn(f"{p}.self_attn"), norm(f"{p}.self_attn_layer_norm"), ffn(p, c["encoder_ffn_dim"])
    for i in range(c["decoder_layers"]):
        p = f"model.decoder.layers.{i}"
        attn(f"{p}.self_attn"), norm(f"{p}.self_attn_layer_norm"), attn(f"{p}.encoder_attn")
        norm(f"{p}.encoder_attn_layer_norm"), ffn(p, c["decoder_ffn_dim"])
    return out


def rounding_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) of rounding a real number to ``dtype``: |fl(x) - x| <= u |x| with the unit
    roundoff u = eps / 2 for normal numbers, and at most half the subnormal spacing
    (smallest_normal * eps / 2 = smallest_normal * u) below them."""
    info = torch.finfo(dtype)
    u = info.eps / 2
    return u, info.smallest_normal * u


def _position_refusal(key: str, stored: Tensor, dtype: torch.dtype, D: int) -> str | None:
    """Why ``stored`` (float32, saved as ``dtype``) is not Marian's sinusoidal table: it must equal the
    float64 table within the rounding to ``dtype`` (``rounding_tolerance``) and ``FP32_TABLE_ATOL``."""
    table = sinusoidal_table(stored.size(0), D, torch.float64)[:, model_permutation(D)]
    rtol, atol = rounding_tolerance(dtype)
    if torch.allclose(stored.double(), table, rtol=rtol, atol=atol + FP32_TABLE_ATOL):
        return None
    return f"{key} is not Marian's sinusoidal table (learned positions?)"


def _shape_refusals(state: dict[str, Tensor], c: dict) -> list[str]:
    """The weights whose shapes are not those config.json ``c`` gives them (``layer_shapes``, the
    position tables (max_position_embeddings, d_model)), embeddings without d_model columns."""
    D, P = c["d_model"], c["max_position_embeddings"]
    wanted = {**layer_shapes(c), **{k: (P, D) for k in POSITION_KEYS}}
    out = [f"{k} {tuple(state[k].shape)} where config.json's sizes make it {s}" for k, s in wanted.items()
           if k in state and tuple(state[k].shape) != s]
    out += [f"{k} {tuple(state[k].shape)} without d_model {D} columns" for k in EMBEDDING_KEYS[:4]
            if k in state and (state[k].dim() != 2 or state[k].size(1) != D)]
    bias = state.get("final_logits_bias")
    if bias is not None and (bias.dim() != 2 or bias.size(0) != 1):
        out.append(f"final_logits_bias {tuple(bias.shape)}, not (1, vocabulary)")
    V = c["vocab_size"]
    V_dec = c.get("decoder_vocab_size") or V  # None: vocab_size's (transformers' reading)
    rows = {EMBEDDING_KEYS[0]: ("vocab_size", V), EMBEDDING_KEYS[1]: ("vocab_size", V),
            EMBEDDING_KEYS[2]: ("decoder_vocab_size", V_dec), EMBEDDING_KEYS[3]: ("decoder_vocab_size", V_dec)}
    out += [f"{k} {tuple(state[k].shape)} where config.json's {field} makes it {n} rows"
            for k, (field, n) in rows.items() if k in state and state[k].dim() == 2 and state[k].size(0) != n]
    if bias is not None and bias.dim() == 2 and bias.size(1) != V_dec:
        out.append(f"final_logits_bias {tuple(bias.shape)} where config.json's decoder_vocab_size makes it (1, {V_dec})")
    return out


def weight_refusals(d: MarianDir) -> list[str]:
    """Weights the Marian config does not account for, lacks or shapes otherwise; embeddings
    without d_model columns; positions that are not its sinusoids."""
    c, state = d.config, d.state
    names = set(layer_shapes(c))
    out = []
    missing = sorted(names - set(state))
    if missing:
        out.append(f"{len(missing)} weights missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    extra = sorted(set(state) - names - set(EMBEDDING_KEYS) - set(POSITION_KEYS))
    if extra:
        out.append(f"weights MarianMTModel does not have: {', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}")
    differ = _shape_refusals(state, c)
    if differ:
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        out.append(f"{d.weights_file.name}: " + "; ".join(differ[:3]) + more)
    elif c["d_model"] % 2 == 0:
        out += [r for k in POSITION_KEYS
                if k in state and (r := _position_refusal(k, state[k], d.dtypes[k], c["d_model"]))]
    return out
