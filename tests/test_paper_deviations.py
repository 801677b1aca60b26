"""docs/paper-deviations.md against the code: every field of ``ModelConfig``, ``TrainConfig`` and
``DecodeConfig`` is either one the paper fixes, whose default is the paper's number; a named
deviation, which is a row of the document's table and whose default is the one the document gives;
or one that changes nothing the paper specifies (the same math computed faster, the length and
bookkeeping of a run, what the paper leaves open). A new field is classified here, so a departure
from the paper cannot arrive without its row.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from aiayn.decode.config import DecodeConfig
from aiayn.model.config import ModelConfig
from aiayn.train.config import TrainConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "paper-deviations.md"
CONFIGS = {"model": ModelConfig, "train": TrainConfig, "decode": DecodeConfig}

# The paper's numbers, as the defaults must be.
PAPER = {
    "model": {"vocab_size": 37_000,  # §5.1: a shared vocabulary of about 37,000
              "n_layers": 6, "d_model": 512,  # §3.1
              "d_ff": 2048,  # §3.3
              "n_heads": 8, "d_k": 64, "d_v": 64,  # §3.2.2: d_k = d_v = d_model / h = 512 / 8
              "p_drop": 0.1},  # §5.4
    "train": {"adam_beta1": 0.9, "adam_beta2": 0.98, "adam_eps": 1e-9, "warmup_steps": 4000,  # §5.3, Eq. 3
              "eps_ls": 0.1,  # §5.4
              "max_steps": 100_000,  # §5.2: base, 100K steps
              "save_every_min": 10.0,  # §6.1: checkpoints written at 10-minute intervals
              "keep_last": 20,  # §6.1: big averages the last 20
              "valid_beam": 4},  # §6.1
    "decode": {"beam_size": 4, "alpha": 0.6,  # §6.1
               "max_len_a": 1.0, "max_len_b": 50},  # §6.1: input length + 50
}

# Named deviations: the default each has (the paper's computation, but for the batch, whose
# default is 4,096 + 4,096 tokens per device, one batch a step, and train.attn_fp32, the same math).
DEVIATIONS = {
    "model": {"n_dec_layers": None, "tgt_vocab_size": None, "p_drop_attn": 0.0, "p_drop_ffn": 0.0,
              "activation": "relu", "pre_norm": False, "learned_positions": False, "tie_embeddings": True,
              "tie_src_tgt_embeddings": True, "output_bias": False, "attn_bias": False,
              "scale_embeddings": True},
    "train": {"lr_scale": 1.0, "lr_decay_frac": 0.0, "lr_decay_by_time": False, "lr_schedule_by_time": False,
              "weight_decay": 0.0, "clip_norm": 0.0, "local_sgd_period": 0, "attn_fp32": True,
              "bpe_dropout": 0.0, "bpe_dropout_target": True, "rdrop_alpha": 0.0, "ema_decay": 0.0,
              "max_src_tokens": 4096, "max_tgt_tokens": 4096, "accum_steps": 1},
    "decode": {"length_norm": "gnmt", "min_len": 0, "no_repeat_ngram": 0, "mbr": False, "sampling": False},
}

# Fields that change nothing the paper specifies.
UNCHANGED = {
    # what the paper leaves open; special ids; the positions a model covers
    "model": {"layer_norm_eps", "max_positions", "pad_id", "bos_id", "eos_id"},
    # the same math, faster or in another arithmetic (docs/training.md, docs/kernels.md, docs/gpu.md);
    # the length of a run, its checkpoints, validation, logging and machine
    "train": {"fused_adam", "c_kernels", "fused_loss", "cpu_row_bits", "fast_dropout", "cast_weights_once", "compile",
              "tf32", "cudnn_attention", "precision", "max_epochs", "max_time_min", "max_flops", "save_every_steps",
              "save_every_frac", "validate_every_steps", "validate_at_save", "patience", "valid_bleu",
              "valid_bleu_max_lines", "best_metric", "seed", "device", "threads", "dist_timeout_s",
              "log_every_steps", "max_bad_steps"},
    # sampling's own settings (nothing without decode.sampling); the same search, faster or in another
    # arithmetic (docs/decoding.md); how many hypotheses come back; input limits
    "decode": {"temperature", "top_k", "top_p", "seed", "nbest", "batch_tokens", "precision", "cpu_row_bits",
               "workers", "c_kernels", "packed_weights", "packed_library", "cuda_graphs", "max_input_tokens",
               "long_lines"},
}


def _table_options() -> set[tuple[str, str]]:
    """The ``section.field`` settings the first column of the named deviations' table names
    (``DecodeConfig.mbr`` read as ``decode.mbr``)."""
    text = DOC.read_text(encoding="utf-8").split("## Named deviations", 1)[1].split("\n## ", 1)[0]
    cells = [line.split("|")[1] for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    named = set()
    for cell in cells:
        named.update(re.findall(r"`(model|train|decode)\.(\w+)`", cell))
        named.update(("decode", f) for f in re.findall(r"`DecodeConfig\.(\w+)`", cell))
    return named


def test_every_field_is_classified_once():
    for section, cls in CONFIGS.items():
        groups = [set(PAPER[section]), set(DEVIATIONS[section]), UNCHANGED[section]]
        assert sum(len(g) for g in groups) == len(set().union(*groups)), section  # none in two groups
        assert set().union(*groups) == {f.name for f in dataclasses.fields(cls)}, section


def test_defaults_are_the_papers_numbers():
    for section, cls in CONFIGS.items():
        default = cls()
        for name, value in {**PAPER[section], **DEVIATIONS[section]}.items():
            assert getattr(default, name) == value, f"{section}.{name}"


def test_every_deviation_is_a_row_of_the_document():
    named = _table_options()
    missing = [f"{s}.{f}" for s, fields in DEVIATIONS.items() for f in fields if (s, f) not in named]
    assert missing == []
