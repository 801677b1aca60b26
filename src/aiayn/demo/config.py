"""The options of ``aiayn demo`` (``DemoConfig``) and the facts its recipes share: how long it
trains (``MINUTES``, the one place that says it) and how many tokens a step holds."""
from __future__ import annotations

from dataclasses import dataclass

from aiayn.config import ConfigError, param
from aiayn.train import config as train_config

MINUTES = 45  # the demo's training wall time: train.max_time_min of its CPU recipes and of parse-sample.json
QUICK_MINUTES = 4  # --quick's: multi30k-quick.json's train.max_time_min
RECIPES = train_config.RECIPES  # the recipes installed with aiayn (package data)
DEMO_STEP_TOKENS = 4096  # source and target tokens of one step of the demo's recipes (docs/recipe.md), on any process count
GPU_MEMBERS = 4  # --members 0 on one GPU with multi30k-gpu.json: its step leaves the device mostly idle (docs/gpu.md)
CUDA_PROCESS_BYTES = 1 << 30  # what a member's process holds on the GPU beside its training peak: CUDA's context, the allocator's slack
# The device's share of one step of multi30k-gpu.json, measured where the members were chosen: 4.0 ms of
# GPU work a step on an H200 whose 8192^3 bf16 matmul ran at 794 TFLOP/s (BENCHMARKS.md, GPU training and
# decoding). Another GPU's share is taken as that work at its own matmul rate (``stages.auto_members``).
GPU_STEP_DEVICE_S = 0.0040
GPU_STEP_MATMUL_TFLOPS = 794.0


@dataclass(frozen=True)
class DemoConfig:
    """Options of ``aiayn demo``; defaults are the full run (``MINUTES`` of training)."""

    train: tuple[str, ...] = param((), "your own parallel text instead of Multi30k: the train split's SOURCE and TARGET files (aligned, one sentence per line, plain or .gz; docs/own-data.md)")
    valid: tuple[str, ...] = param((), "with --train: the validation split's SOURCE and TARGET files (the length penalty is chosen on it)")
    test: tuple[str, ...] = param((), "with --train: the test split's SOURCE and TARGET files, translated and scored (sacreBLEU, chrF); none: no test scores")
    src_lang: str = param("", "source language; Multi30k: en or de (the other is the target), empty = en; --train: empty = the source file's suffix (train.en -> en)")
    tgt_lang: str = param("", "with --train: the target language; empty = the target file's suffix (train.de -> de)")
    data_root: str = param("", "Multi30k only: folder holding multi30k/{raw,tok}; empty = $AIAYN_SHARED_DATA, ../shared/data, the cache ($AIAYN_CACHE, else $XDG_CACHE_HOME/aiayn or ~/.cache/aiayn), else a download into the cache (docs/data.md)")
    out: str = param("", "output directory (relative paths are under the current directory; a re-run resumes); a folder holding anything the demo did not write is refused; empty = runs/demo for Multi30k, runs/demo-SRC-TGT with --train")
    overwrite: bool = param(False, "start afresh in --out: an earlier demo's files there are deleted (without it a re-run resumes)")
    minutes: float = param(0.0, f"training wall-time budget in minutes; 0 = the recipe's ({MINUTES:g} for the full run, {QUICK_MINUTES:g} for --quick)")
    max_steps: int = param(0, "also stop training after this many steps; 0 = only the time budget")
    threads: int = param(0, "CPU threads for training; 0 = the recipe's")
    members: int = param(0, f"train this many models at once, each on threads/members threads with seed train.seed + i, each averaged, translating as one ensemble (docs/training.md); 1 = one model on all the threads; 0 = up to {GPU_MEMBERS} on one GPU with the default recipe (recipes/multi30k-gpu.json, whose step leaves a fast GPU mostly idle): as many as the GPU serves while each reaches the recipe's steps in its minutes, the host's cores issue and its memory holds (docs/gpu.md), else 1")
    processes: int = param(0, "data-parallel processes training the one model, each on threads/processes threads (docs/training.md); 0 = one per GPU, or 2 on a CPU with 2 or more cores; 1 = one process")
    quick: bool = param(False, "the quick variant: a small model for a few minutes, to see it work")
    device: str = param("auto", "where the model translates and is scored: auto (CUDA when present, as training's train.device=auto, so the demo decodes where it trained), cpu, cuda or cuda:N")
    recipe: str = param("", "training recipe JSON; empty = the one sized to this machine on a CPU (recipes/multi30k-small.json or multi30k.json, by the training FLOPs it predicts in the minutes: docs/recipe.md), recipes/multi30k-gpu.json where CUDA is present, recipes/multi30k-quick.json with --quick")
    sets: str = param("", "overrides of the recipe, SECTION.FIELD=VALUE joined by commas (the CLI's repeatable --set, as in `aiayn train`); --minutes, --max-steps and --threads apply after them (one that a --set of its field contradicts is an error)")
    vocab_size: int = param(8000, "shared BPE vocabulary size")
    character_coverage: float = param(1.0, "share of the training text's characters the shared BPE model must cover; 1.0 keeps every one (below it, rare characters such as some digits become <unk>)")
    lowercase: bool = param(False, "train on lowercased text (as the published Multi30k baselines do): translations come out lowercase; sacreBLEU -lc is reported beside cased sacreBLEU (docs/recipe.md)")
    average_last: int = param(5, "average this many last checkpoints (§6.1: 5 for base)")
    beam_size: int = param(4, "beam size (§6.1: 4)")
    alphas: str = param("0.6,1.0,1.4,1.8", "length penalties α tried on the validation set; the first is the reference (§6.1's 0.6), kept unless validation prefers another (see --alpha-significance)")
    alpha_significance: float = param(0.05, "keep the first of --alphas (§6.1's 0.6) unless another scores higher on validation at this p-level of a paired bootstrap; 0 = the highest-scoring α (docs/recipe.md)")
    train_lines: int = param(0, "use only the first N training pairs (0 = all); for smoke runs")
    eval_lines: int = param(0, "use only the first N validation and test pairs (0 = all); for smoke runs")
    results_to: str = param("", "also write results.json to this file, e.g. bench/results/FOLDER/demo.json when the run is one BENCHMARKS.md cites; empty = only OUT/results.json")

    def __post_init__(self) -> None:
        if self.average_last < 1:  # (0 would take every checkpoint: [-0:])
            raise ConfigError(f"average_last must be >= 1, got {self.average_last}")
