"""Validation while training (§6.1: the development set's loss, and its BLEU with ``train.valid_bleu``):
``validate`` and ``valid_bleu`` score a split, and ``Validator`` holds the run's validation split,
checked once, and keeps the bests and the count of validations without a gain
(``train.best_metric``, ``train.patience``).
"""
from __future__ import annotations

import logging
import math
import time
from typing import NamedTuple

import numpy as np
import torch

from aiayn.data.batching import TokenBatchSampler, TokenBounds, collate
from aiayn.data.dataset import DataDir
from aiayn.data.stream import check_positions, to_device
from aiayn.execution.attention import attention_backends
from aiayn.train import runtime as rt
from aiayn.model.config import ModelConfig
from aiayn.kernels.loader import for_training
from aiayn.train.config import TrainConfig
from aiayn.train.objective import label_smoothed_loss
from aiayn.checkpoint.run import best_merit, merit

log = logging.getLogger(__name__)


def valid_caps(t: TrainConfig) -> tuple[int, int]:
    """The most source and target ids of a validation pair that ``validate`` reads: a pair fills at
    most one batch of the token bounds (with its EOS or BOS), so a line however long costs no more
    memory than a training batch. Longer pairs are cut (``warn_long_pairs`` says so, once)."""
    return max(t.max_src_tokens - 1, 1), max(t.max_tgt_tokens - 1, 1)


def warn_long_pairs(name: str, data, t: TrainConfig) -> None:
    """One warning naming the pairs of ``data`` that ``validate`` cuts to ``valid_caps``."""
    if data is None or len(data) == 0:
        return
    src_cap, tgt_cap = valid_caps(t)
    long = np.flatnonzero((data.src_lens > src_cap) | (data.tgt_lens > tgt_cap))  # (n_long,)
    if len(long):
        shown = ", ".join(str(i + 1) for i in long[:5]) + (", ..." if len(long) > 5 else "")
        log.warning("%s: %d pair(s) longer than one batch (train.max_src_tokens=%d, train.max_tgt_tokens=%d) "
                    "are cut to %d source and %d target tokens for validation: pair(s) %s", name, len(long),
                    t.max_src_tokens, t.max_tgt_tokens, src_cap, tgt_cap, shown)


class Bleu(NamedTuple):
    """What ``valid_bleu`` scores against: the (source, target) tokenizers and the raw reference
    lines (``DataDir.references``; None: the detokenized reference ids)."""
    tokenizers: tuple
    references: list[str] | None = None


@torch.no_grad()
def validate(model, data, t: TrainConfig, place: rt.Place, bleu: Bleu | None = None) -> dict:
    """Label-smoothed loss, NLL and per-token perplexity on a split (no dropout), batched by the training
    section ``t``; with ``train.valid_bleu`` and ``bleu``, its sacreBLEU too (``valid_bleu``); and the
    seconds each took."""
    device, precision = place.device, place.precision
    t0 = time.monotonic()
    model.eval()
    src_cap, tgt_cap = valid_caps(t)
    sampler = TokenBatchSampler(np.minimum(data.src_lens, src_cap) + 1, np.minimum(data.tgt_lens, tgt_cap) + 1,
                                TokenBounds(t.max_src_tokens, t.max_tgt_tokens), shuffle=False)
    m = model.cfg
    kernels = for_training(t.c_kernels, device)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss, nll, tokens: read once at the end
    for idx in sampler:
        b = to_device(collate([(data.src(i)[:src_cap], data.tgt(i)[:tgt_cap]) for i in idx], m.pad_id, m.bos_id,
                               m.eos_id), device)
        with attention_backends(device, t.cudnn_attention), rt.autocast(device, precision):
            logits = model(b.src, b.tgt_in, src_padded=b.src_padded)
        sums = label_smoothed_loss(logits, b.tgt_out, t.eps_ls, m.pad_id, kernels)
        totals += torch.stack([sums.loss.double(), sums.nll.double(), sums.n_tokens.double()])
    loss, nll, n = totals.tolist()
    n = max(n, 1)
    out = {"valid_loss": loss / n, "valid_nll": nll / n, "valid_ppl": math.exp(min(nll / n, 50))}
    if t.valid_bleu and bleu is not None:
        t1 = time.monotonic()
        out["valid_bleu"] = valid_bleu(model, data, bleu, t.valid_bleu_max_lines, src_cap, t.valid_beam, place.dist)
        out["valid_bleu_seconds"] = time.monotonic() - t1
    model.train()
    out["valid_seconds"] = time.monotonic() - t0
    return out


@torch.no_grad()
def valid_bleu(model, data, bleu: Bleu, max_lines: int = 0, src_cap: int | None = None, beam: int = 4,
               dist=None) -> float:
    """sacreBLEU of the first ``max_lines`` validation pairs (0 = all) translated as ``aiayn
    translate`` would (§6.1: beam search of ``beam``, alpha 0.6, max length |x| + 50), against
    ``bleu.references`` (the raw target lines) or, without them, the detokenized reference ids,
    case-insensitively (-lc) where the target tokenizer lowercases (its translations are lowercase);
    sources cut to ``src_cap`` ids (``valid_caps``). In a data-parallel
    run (``dist``) each rank translates every G-th line and the translations are gathered, so
    every rank scores the same text in 1/G of the time."""
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.translator import Translator
    from aiayn.evaluate.bleu import sacre_bleu
    (src_tok, tgt_tok), references = bleu
    n = min(len(data), max_lines) if max_lines else len(data)
    translator = Translator(model, src_tok, tgt_tok, DecodeConfig(beam_size=beam))
    rank, world = (dist.rank, dist.world_size) if dist is not None and dist.enabled else (0, 1)
    ids = [list(map(int, data.src(i)[:src_cap])) + [model.cfg.eos_id] if len(data.src(i)) else []
           for i in range(rank, n, world)]
    out = [tgt_tok.decode(h[0].tokens) if h else "" for h in translator.translate_ids(ids)]
    if world > 1:
        parts: list = [None] * world
        torch.distributed.all_gather_object(parts, out)
        out = [""] * n
        for r, part in enumerate(parts):
            out[r::world] = part
    refs = references[:n] if references is not None else [tgt_tok.decode(list(map(int, data.tgt(i))))
                                                        for i in range(n)]
    return sacre_bleu(out, refs, lowercase=tgt_tok.lowercases).score  # a lowercasing model: -lc


class Validator:
    """The run's validation split (None without one), checked once: positions (``check_positions``)
    and pairs longer than a batch (``warn_long_pairs``, the main rank's warning alone); with
    ``train.valid_bleu`` its raw references. Called with the model and the run's ``TrainState``:
    ``validate``, then the bests and the count of validations without a gain in ``train.best_metric``,
    logged through ``log_scalars``."""

    def __init__(self, data: DataDir, t: TrainConfig, m: ModelConfig, place: rt.Place):
        self.t, self.place = t, place
        self.data = data.split("valid") if "valid" in data.splits else None
        references = None
        if self.data is not None and t.valid_bleu:
            references = data.references("valid")
            if references is None and place.dist.is_main:  # (every rank reads the same files: said once)
                log.warning("%s: the validation target file prepare read is gone or changed; valid_bleu scores "
                            "against the detokenized reference ids instead", data.path)
        self.bleu = Bleu((data.src_tokenizer, data.tgt_tokenizer), references)
        if place.dist.is_main:
            warn_long_pairs("valid", self.data, t)
        check_positions(m, {"valid": self.data})

    def __call__(self, learner, state, log_scalars) -> dict | None:
        """Validate ``learner``'s weights (its moving average's, where it keeps one: ``Learner.averaged``)."""
        if self.data is None:
            return None
        with learner.averaged():
            valid = validate(learner.model, self.data, self.t, self.place, self.bleu)
        track(valid, state, self.t.best_metric)
        log_scalars(valid)
        log.info("step %d: valid loss %.4f nll %.4f ppl %.2f%s (%.1f s)", state.step, valid["valid_loss"],
                 valid["valid_nll"], valid["valid_ppl"],
                 f" BLEU {valid['valid_bleu']:.2f}" if "valid_bleu" in valid else "", valid["valid_seconds"])
        return valid


def track(valid: dict, state, best_metric: str) -> None:
    """The run's seconds of validation, its bests, and the validations in a row without a gain in
    ``best_metric`` (``train.patience``), after ``valid``."""
    state.valid_seconds += valid["valid_seconds"]
    state.valid_bleu_seconds += valid.get("valid_bleu_seconds", 0.0)
    gained = merit(valid, best_metric) > best_merit(state, best_metric)
    state.best_valid_loss = min(state.best_valid_loss, valid["valid_loss"])
    state.best_valid_bleu = max(state.best_valid_bleu, valid.get("valid_bleu", -math.inf))
    state.bad_validations = 0 if gained else state.bad_validations + 1
