"""``aiayn demo``: Multi30k (Elliott et al. 2016) from raw text to scored translations and an
attention plot, on whatever machine it runs on (docs/recipe.md).

Steps (each skipped when its output already exists, so a re-run resumes):
  1. prepare   shared BPE over both languages, binarized corpus      OUT/data
  2. train     the recipe sized to this machine (aiayn.demo_sizing: multi30k-small.json or
               multi30k.json by the FLOPs it trains in the minutes; multi30k-gpu.json where CUDA is
               present), bounded by --minutes                                          OUT/run
               with its 4,096 + 4,096-token steps on any process count (train.accum_steps)
               (--processes P: one model, P data-parallel processes, each on 1/P of the threads;
               --members N: N models at once, OUT/run/memberI, each on 1/N of the threads)
  3. average   the last --average-last checkpoints (§6.1)              OUT/model.pt
               (--members N: each member's, then one ensemble file of the N averages)
  4. tune α    length penalty chosen on the validation set (never on test)
  5. translate test_2016 with beam search                              OUT/test_2016.hyp
  6. score     sacreBLEU + chrF on raw cased text; Multi30k tokenized BLEU (lowercased,
               Moses-tokenized, the published baselines' metric); the paper's compound-split BLEU
  7. examples  a few sentences translated, one attention plot           OUT/plots
The last three lines printed are ``model: PATH``, ``translations: PATH`` and ``plots: PATH``.

Your own parallel text: ``--train SRC TGT --valid SRC TGT [--test SRC TGT]`` runs the same steps
on it (``aiayn.demo_own``; docs/own-data.md), into runs/demo-SRC-TGT.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aiayn.config import param
from aiayn.data.multi30k import find_multi30k, read_text
from aiayn.errors import UserError
from aiayn.evaluate.alpha import choose_alpha, tune_alpha
from aiayn.files import claim_folder
from aiayn.progress import progress_bar

log = logging.getLogger(__name__)

DEMO_FILES = ("subset", "data", "sizing.json", "run", "model.pt", "test_2016.hyp", "plots", "results.json")  # all it writes in --out
RECIPES = Path(__file__).resolve().parent / "recipes"  # package data (recipes/ in the checkout links here)
LANGS = ("en", "de")
EXAMPLES = {
    "en": ["A man in a blue shirt is riding a bicycle down the street.",
           "Two dogs are playing in the snow.",
           "A little girl in a pink dress is eating an ice cream cone."],
    "de": ["Ein Mann in einem blauen Hemd fährt mit dem Fahrrad die Straße hinunter.",
           "Zwei Hunde spielen im Schnee.",
           "Ein kleines Mädchen in einem rosa Kleid isst ein Eis."],
}


@dataclass(frozen=True)
class DemoConfig:
    """Options of ``aiayn demo``; defaults are the full run (45 minutes of training)."""

    train: tuple[str, ...] = param((), "your own parallel text instead of Multi30k: the train split's SOURCE and TARGET files (aligned, one sentence per line, plain or .gz; docs/own-data.md)")
    valid: tuple[str, ...] = param((), "with --train: the validation split's SOURCE and TARGET files (the length penalty is chosen on it)")
    test: tuple[str, ...] = param((), "with --train: the test split's SOURCE and TARGET files, translated and scored (sacreBLEU, chrF); none: no test scores")
    src_lang: str = param("", "source language; Multi30k: en or de (the other is the target), empty = en; --train: empty = the source file's suffix (train.en -> en)")
    tgt_lang: str = param("", "with --train: the target language; empty = the target file's suffix (train.de -> de)")
    data_root: str = param("", "Multi30k only: folder holding multi30k/{raw,tok}; empty = $AIAYN_SHARED_DATA, ../shared/data, the cache ($AIAYN_CACHE, else ~/.cache/aiayn), else a download into the cache (docs/data.md)")
    out: str = param("", "output directory (relative paths are under the current directory; a re-run resumes); a folder holding anything the demo did not write is refused; empty = runs/demo for Multi30k, runs/demo-SRC-TGT with --train")
    overwrite: bool = param(False, "start afresh in --out: an earlier demo's files there are deleted (without it a re-run resumes)")
    minutes: float = param(0.0, "training wall-time budget in minutes; 0 = the recipe's (45 for the full run, 4 for --quick)")
    max_steps: int = param(0, "also stop training after this many steps; 0 = only the time budget")
    threads: int = param(0, "CPU threads for training; 0 = the recipe's")
    members: int = param(1, "train this many models at once, each on threads/members threads with seed train.seed + i, each averaged, translating as one ensemble (docs/training.md); 1 = one model on all the threads")
    processes: int = param(0, "data-parallel processes training the one model, each on threads/processes threads (docs/training.md); 0 = one per GPU, or 2 on a CPU with 2 or more cores; 1 = one process")
    quick: bool = param(False, "the quick variant: a small model for a few minutes, to see it work")
    device: str = param("auto", "where the model translates and is scored: auto (CUDA when present, as training's train.device=auto, so the demo decodes where it trained), cpu, cuda or cuda:N")
    recipe: str = param("", "training recipe JSON; empty = the one sized to this machine on a CPU (recipes/multi30k-small.json or multi30k.json, by the training FLOPs it predicts in the minutes: docs/recipe.md), recipes/multi30k-gpu.json where CUDA is present, recipes/multi30k-quick.json with --quick")
    sets: str = param("", "overrides of the recipe, SECTION.FIELD=VALUE joined by commas (the CLI's repeatable --set, as in `aiayn train`); --minutes, --max-steps and --threads apply after them")
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





def _score_entry(score) -> dict:
    """A score for results.json; BLEU scores also carry their length ratio."""
    from aiayn.evaluate.bleu import BleuResult
    entry = {"score": round(score.score, 2), "signature": score.signature}
    if isinstance(score, BleuResult):
        entry["length_ratio"] = round(score.length_ratio, 3)
    return entry


DEMO_STEP_TOKENS = 4096  # source and target tokens of one step of the demo's recipes (docs/recipe.md), on any process count


def step_sets(train_cfg, processes: int, step_tokens: int) -> list[str]:
    """Overrides that keep a step at ``step_tokens`` + ``step_tokens`` tokens on ``processes``
    synchronous data-parallel processes: processes x train.accum_steps x the per-process batch =
    ``step_tokens``, the recipe's per-process batch kept where it fits (multi30k.json's 2,048: 2
    processes, or 1 process accumulating 2 batches), else cut to ``step_tokens`` / processes.
    None where ``step_tokens`` is 0 or under local SGD (each process then steps on its own)."""
    if not step_tokens or (train_cfg.local_sgd_period and processes > 1):
        return []
    share = max(1, step_tokens // processes)  # tokens each process adds to a step
    accum = max(1, share // train_cfg.max_tgt_tokens)
    per_process = share // accum
    out = [f"train.accum_steps={accum}"]
    if per_process != train_cfg.max_tgt_tokens:
        ratio = train_cfg.max_src_tokens / train_cfg.max_tgt_tokens
        out += [f"train.max_src_tokens={max(1, round(per_process * ratio))}", f"train.max_tgt_tokens={per_process}"]
    return out


def _subset(files: dict[str, Path], work: Path, cfg: DemoConfig) -> dict[str, Path]:
    """Write the first N lines of each file when --train-lines / --eval-lines ask for it."""
    if not cfg.train_lines and not cfg.eval_lines:
        return files
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, path in files.items():
        limit = cfg.train_lines if ".train." in key else cfg.eval_lines
        dst = work / key
        if not dst.exists():
            dst.write_text("".join(line + "\n" for line in read_text(path, limit)), encoding="utf-8")
        out[key] = dst
    return out


def _run_training(cmd: list[str], log_path: Path | None, env: dict | None = None) -> subprocess.Popen:
    """Start one ``aiayn train`` command (killed with the demo: ``die_with_parent``); output to the
    terminal or a log."""
    from aiayn.host.process import die_with_parent
    before_exec = functools.partial(die_with_parent, os.getpid())
    if log_path is None:
        return subprocess.Popen(cmd, preexec_fn=before_exec, env=env)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as f:
        return subprocess.Popen(cmd + ["--no-progress"], stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=before_exec, env=env)


def _train_cmd(data_dir: Path, run_dir: Path, recipe: Path, sets: list[str], processes: int = 1) -> list[str]:
    """``aiayn train`` in a child process; with several processes, through torchrun's launcher
    (``torch.distributed.run``): one model, data parallel over gloo on a CPU."""
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
              if processes > 1 else [sys.executable])
    cmd = [*launch, "-m", "aiayn.cli", "train", "--data", str(data_dir), "--out", str(run_dir), "--recipe", str(recipe)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def default_recipe(quick: bool, cuda: bool | None = None) -> Path:
    """The recipe without --recipe: multi30k-quick.json with --quick; else multi30k-gpu.json where CUDA
    is present (one process, the same 4,096-token steps, 8 minutes) and multi30k.json on a CPU."""
    if quick:
        return RECIPES / "multi30k-quick.json"
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    return RECIPES / ("multi30k-gpu.json" if cuda else "multi30k.json")


def auto_processes() -> int:
    """``--processes 0``: one per GPU; on a CPU 2 (with at least 2 cores), each with its own thread."""
    import torch
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def train_data_parallel(data_dir: Path, run_dir: Path, recipe: Path, sets: list[str], run_cfg, processes: int) -> None:
    """Train one model with ``processes`` data-parallel processes, each on its share of the threads."""
    threads = max(1, (run_cfg.train.threads or os.cpu_count() or 1) // processes)
    proc = _run_training(_train_cmd(data_dir, run_dir, recipe, [*sets, f"train.threads={threads}"], processes),
                         None, env={**os.environ, "OMP_NUM_THREADS": str(threads)})  # (torchrun's default is 1)
    try:
        if proc.wait() != 0:
            raise UserError(f"{run_dir}: training failed (exit code {proc.returncode})")
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()


def _train_members(data_dir: Path, member_dirs: list[Path], recipe: Path, sets: list[str], run_cfg) -> None:
    """Train one model per directory at once, each in its own ``aiayn train`` process with its
    share of the threads and seed train.seed + i. The first shows its progress bar; the others
    write to MEMBER.log beside their directory. Finished members are skipped, interrupted ones
    resume; if one fails, the others are stopped.
    """
    n = len(member_dirs)
    threads = max(1, (run_cfg.train.threads or os.cpu_count() or 1) // n)
    procs: list[tuple[Path, subprocess.Popen, Path | None]] = []
    try:
        for i, d in enumerate(member_dirs):
            if (d / "summary.json").exists():
                continue
            cmd = _train_cmd(data_dir, d, recipe, [*sets, f"train.seed={run_cfg.train.seed + i}", f"train.threads={threads}"])
            log_path = None if i == 0 else d.parent / f"{d.name}.log"
            procs.append((d, _run_training(cmd, log_path), log_path))
        running = list(procs)
        while running:
            time.sleep(0.5)
            for d, proc, log_path in list(running):
                if proc.poll() is None:
                    continue
                running.remove((d, proc, log_path))
                if proc.returncode != 0:
                    raise UserError(f"{d}: training failed (exit code {proc.returncode})"
                                    + (f"; see {log_path}" if log_path else ""))
    finally:
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()


def run_demo(cfg: DemoConfig) -> dict:
    """``aiayn demo`` in seven stages: prepare, train, average, choose α on validation, translate
    test_2016, score it, translate examples and plot their attention. Every stage that finished
    is skipped on a re-run (training resumes); ``out/results.json`` holds what each measured."""
    if cfg.members < 1 or cfg.processes < 0:
        raise UserError(f"--members must be at least 1 and --processes at least 0, got {cfg.members} and {cfg.processes}")
    if cfg.train:
        from aiayn.demo_own import run_own_demo
        return run_own_demo(cfg)
    given = [flag for flag, value in (("--valid", cfg.valid), ("--test", cfg.test), ("--tgt-lang", cfg.tgt_lang)) if value]
    if given:
        raise UserError(f"{', '.join(given)} go with --train (your own files); Multi30k's target is the other of en, de")
    src = cfg.src_lang or "en"
    tgt = "de" if src == "en" else "en"
    if src not in LANGS:
        raise UserError(f"--src-lang must be en or de for Multi30k (or give your own files with --train), got {src!r}")
    _check_scorer()
    files = find_multi30k(cfg.data_root, src, tgt)
    out = claim_folder(cfg.out or "runs/demo", DEMO_FILES, overwrite=cfg.overwrite, what="aiayn demo")
    files = _subset(files, out / "subset", cfg)
    t_all = time.monotonic()
    results: dict = {"direction": f"{src}-{tgt}", "config": dataclasses.asdict(cfg)}
    data_dir = _stage_prepare(cfg, files, out / "data", src, tgt, results)
    run_dir = out / "run"
    member_dirs = _stage_train(cfg, data_dir, run_dir, results)
    model_path = _stage_average(cfg, member_dirs, run_dir, out / "model.pt", results)

    from aiayn.decode.translator import Translator
    translator = Translator.from_checkpoint(model_path, device=cfg.device)
    _stage_alpha(cfg, translator, files, src, tgt, results)
    hyp_path = _stage_test(cfg, translator, files, out / "test_2016.hyp", src, tgt, results)

    plots_dir = _stage_examples(translator, EXAMPLES[src], out / "plots", results)
    results["seconds_total"] = round(time.monotonic() - t_all, 1)
    write_results(cfg, out, results)
    print(f"model: {model_path}")
    print(f"translations: {hyp_path}")
    print(f"plots: {plots_dir}")
    return results


def write_results(cfg: DemoConfig, out: Path, results: dict) -> None:
    """``out/results.json``, and the same file at ``--results-to`` (written whole; a results folder's
    copy for BENCHMARKS.md)."""
    from aiayn.files import write_output
    text = json.dumps(results, indent=2, ensure_ascii=False).encode()
    (out / "results.json").write_bytes(text)
    print(f"results: {out / 'results.json'}")
    if cfg.results_to:
        Path(cfg.results_to).parent.mkdir(parents=True, exist_ok=True)
        write_output(cfg.results_to, lambda f: f.write(text))
        print(f"results: {cfg.results_to}")


def _stage_examples(translator, examples: list[str], plots_dir: Path, results: dict) -> Path:
    """7. ``examples`` translated into ``results``, the first one's attention drawn in ``plots_dir``."""
    results["examples"] = dict(zip(examples, translator.translate(examples)))
    for s, t in results["examples"].items():
        print(f"[7/7] {s}  ->  {t}", flush=True)
    if plots_dir.exists():
        shutil.rmtree(plots_dir)
    from aiayn.viz.attention import plot_attention
    plot_attention(translator, examples[0], plots_dir)
    return plots_dir


def _check_scorer() -> None:
    """The tokenized BLEU of stages 4 and 6 (``evaluate.multi30k``) needs sacremoses: said before the
    training, not after it."""
    try:
        import sacremoses  # noqa: F401
    except ImportError as exc:
        raise UserError(f"aiayn demo scores with sacremoses (Multi30k's tokenized BLEU), which does not import "
                        f"({exc}); pip install sacremoses") from exc


def _stage_prepare(cfg: DemoConfig, files: dict[str, Path], data_dir: Path, src: str, tgt: str, results: dict) -> Path:
    """1. The shared BPE and the binarized splits of ``files`` ("raw.SPLIT.SIDE", SIDE ``src`` or
    ``tgt``; train and valid, test where given) in ``data_dir``, unless a run prepared them already
    (with the same options: other ones are an error, not a silent reuse). Unaligned files are an
    error naming the file and line (``read_pairs``)."""
    from aiayn.data.prepare import PrepareConfig, SplitFiles, prepare
    prep_cfg = PrepareConfig(vocab_size=cfg.vocab_size, lowercase=cfg.lowercase,
                             character_coverage=cfg.character_coverage)
    if not (data_dir / "manifest.json").exists():
        t0 = time.monotonic()
        prepare({s: SplitFiles(files[f"raw.{s}.{src}"], files[f"raw.{s}.{tgt}"])
                 for s in ("train", "valid", "test") if f"raw.{s}.{src}" in files}, data_dir, prep_cfg)
        results["prepare_seconds"] = round(time.monotonic() - t0, 1)
    else:
        had = json.loads((data_dir / "manifest.json").read_text())["options"]
        differ = [k for k in ("vocab_size", "lowercase", "character_coverage") if had.get(k, False) != getattr(prep_cfg, k)]
        if differ:
            raise UserError(f"{data_dir / 'manifest.json'}: prepared with "
                            f"{', '.join(f'{k}={had.get(k, False)}' for k in differ)}, but this run asks for "
                            f"{', '.join(f'{k}={getattr(prep_cfg, k)}' for k in differ)}; use another --out")
    print(f"[1/7] data: {data_dir}", flush=True)
    return data_dir


def recipe_sets(sets: str, minutes: float, max_steps: int, threads: int = 0) -> list[str]:
    """A demo's overrides of its recipe: ``sets`` (SECTION.FIELD=VALUE joined by commas), then
    its --minutes, --max-steps and --threads where given."""
    out = [x for x in sets.split(",") if x.strip()]
    if minutes:
        out.append(f"train.max_time_min={minutes}")
    if max_steps:
        out.append(f"train.max_steps={max_steps}")
    if threads:
        out.append(f"train.threads={threads}")
    return out


def train_recipe(data_dir: Path, run_dir: Path, recipe: Path, sets: list[str], run_cfg, processes: int,
                 stage: str) -> None:
    """One model of ``recipe`` trained into ``run_dir`` unless it finished there (resumed if it
    started): in ``processes`` data-parallel processes (0 = ``auto_processes()``) or in this one.
    ``stage`` (e.g. "[2/7]") starts the line it prints."""
    from aiayn.train.loop import train
    if (run_dir / "summary.json").exists():
        return
    processes = processes or auto_processes()
    t = run_cfg.train
    print(f"{stage} training {recipe.name} for up to {t.max_time_min:g} minutes into {run_dir}"
          + (f" with {processes} processes" if processes > 1 else "")
          + (f", {t.accum_steps} batches of {t.max_tgt_tokens:,} tokens a step per process" if t.accum_steps > 1 else ""),
          flush=True)
    if processes > 1:
        train_data_parallel(data_dir, run_dir, recipe, sets, run_cfg, processes)
    else:
        train(data_dir, run_dir, run_cfg, progress=True)


def _stage_train(cfg: DemoConfig, data_dir: Path, run_dir: Path, results: dict) -> list[Path]:
    """2. The recipe trained into ``run_dir`` (``--members`` > 1: one sub-directory a member), or
    resumed there; returns the members' run directories."""
    from aiayn.config import apply_sets
    from aiayn.train.config import load_recipe
    recipe = Path(cfg.recipe) if cfg.recipe else _sized_recipe(cfg, run_dir.parent, results)
    sets = recipe_sets(cfg.sets, cfg.minutes, cfg.max_steps, cfg.threads)
    run_cfg = apply_sets(load_recipe(recipe), sets)
    if cfg.members == 1:
        member_dirs = [run_dir]
        processes = cfg.processes or auto_processes()
        own_step = bool(cfg.recipe or cfg.quick or any(s.strip().startswith("train.accum_steps") for s in sets))
        step = step_sets(run_cfg.train, processes, 0 if own_step else DEMO_STEP_TOKENS)
        sets, run_cfg = sets + step, apply_sets(run_cfg, step)
        train_recipe(data_dir, run_dir, recipe, sets, run_cfg, processes, "[2/7]")
    else:
        member_dirs = [run_dir / f"member{i + 1}" for i in range(cfg.members)]
        if not all((d / "summary.json").exists() for d in member_dirs):
            print(f"[2/7] training {cfg.members} members of {recipe.name} at once for up to "
                  f"{run_cfg.train.max_time_min:g} minutes into {run_dir}", flush=True)
            _train_members(data_dir, member_dirs, recipe, sets, run_cfg)
    summaries = [json.loads((d / "summary.json").read_text()) for d in member_dirs]
    results["train"] = summaries[0]
    if cfg.members > 1:
        results["train_members"] = summaries
    print(f"[2/7] trained: {', '.join(str(t['steps']) for t in summaries)} steps, "
          f"{results['train']['train_seconds']:.0f} s", flush=True)
    return member_dirs


def _sized_recipe(cfg: DemoConfig, out: Path, results: dict) -> Path:
    """The default recipe: multi30k-gpu.json where CUDA is present; on a CPU the one sized to this
    machine's budget of training FLOPs in the demo's minutes (aiayn.demo_sizing), printed with why."""
    from aiayn.demo_sizing import QUICK_SIZES, SIZES, describe, sized_recipe
    from aiayn.train.config import load_recipe
    if default_recipe(cfg.quick).name == "multi30k-gpu.json":
        return default_recipe(cfg.quick)
    first = load_recipe(RECIPES / (QUICK_SIZES if cfg.quick else SIZES)[0].recipe).train
    minutes = cfg.minutes or first.max_time_min
    processes = (cfg.processes or auto_processes()) if cfg.members == 1 else 1
    threads = max(1, (cfg.threads or first.threads or os.cpu_count() or 1) // (processes * cfg.members))
    recipe, record = sized_recipe(RECIPES, cfg.quick, minutes, processes, threads, out)
    results["sizing"] = record
    print(f"[2/7] sized to this machine: {describe(record)}", flush=True)
    return recipe


def _stage_average(cfg: DemoConfig, member_dirs: list[Path], run_dir: Path, model_path: Path, results: dict) -> Path:
    """3. Each member's last ``average_last`` checkpoints averaged (§6.1); one member straight
    into ``model_path``, several into an ensemble file there."""
    from aiayn.checkpoint import atomic_save, average_checkpoints, ensemble_checkpoint, step_checkpoints
    averages, averaged = [], []
    for d in member_dirs:
        ckpts = step_checkpoints(d)[-cfg.average_last:]
        averages.append(model_path if cfg.members == 1 else d / "averaged.pt")
        atomic_save(average_checkpoints(ckpts), averages[-1])
        averaged.append([p.relative_to(run_dir).as_posix() for p in ckpts])
    if cfg.members == 1:
        results["averaged"] = averaged[0]
        print(f"[3/7] averaged {len(averaged[0])} checkpoints -> {model_path}", flush=True)
    else:
        results["averaged"] = averaged
        atomic_save(ensemble_checkpoint(averages), model_path)
        print(f"[3/7] averaged the last {cfg.average_last} checkpoints of each member; their ensemble -> {model_path}",
              flush=True)
    return model_path


def _stage_alpha(cfg: DemoConfig, translator, files: dict[str, Path], src: str, tgt: str, results: dict) -> None:
    """4. The length penalty α chosen on the validation set (``choose_alpha``), set on
    ``translator``; validation scored at that α."""
    from aiayn.decode.config import DecodeConfig
    from aiayn.evaluate.bleu import sacre_bleu
    from aiayn.evaluate.multi30k import multi30k_bleu
    val_src, val_tok = read_text(files[f"raw.valid.{src}"]), read_text(files[f"tok.valid.{tgt}"])
    tuning, val_translations = tune_alpha(translator, val_src, val_tok, tgt, cfg.alphas, cfg.beam_size,
                                          report=lambda a, r: print(
                                              f"[4/7] valid α={a}: Multi30k BLEU {r['valid_multi30k_bleu']:.2f}"
                                              f" (length ratio {r['length_ratio']:.3f})", flush=True))
    best_alpha, p_values = choose_alpha(val_translations, val_tok, tgt, cfg.alpha_significance)
    for a, p in p_values.items():
        tuning[a]["p_vs_first"] = round(p, 3)
    why = (f"p against α {next(iter(tuning))}, paired bootstrap: " + ", ".join(f"{a} {p:.3f}" for a, p in p_values.items())
           + f"; significant below {cfg.alpha_significance}") if p_values else "the highest-scoring"
    print(f"[4/7] α {best_alpha} for test ({why})", flush=True)
    results["alpha_tuning"] = {str(k): v for k, v in tuning.items()}
    results["alpha"] = best_alpha
    translator.cfg = DecodeConfig(beam_size=cfg.beam_size, alpha=best_alpha)
    hyps_val = val_translations[best_alpha]  # translated while tuning; the same cfg gives the same lines
    val_raw = read_text(files[f"raw.valid.{tgt}"])
    val_bleu = multi30k_bleu(hyps_val, val_tok, tgt)
    results["valid"] = {"multi30k_bleu": val_bleu.score, "length_ratio": round(val_bleu.length_ratio, 3),
                        "sacrebleu": sacre_bleu(hyps_val, val_raw).score}
    if cfg.lowercase:
        results["valid"]["sacrebleu_lc"] = sacre_bleu(hyps_val, val_raw, lowercase=True).score


def translate_test(translator, lines: list[str], hyp_path: Path, name: str, results: dict) -> list[str]:
    """5. The test split ``name``'s ``lines`` translated into ``hyp_path`` (one line per source line),
    the seconds it took in ``results``."""
    t0 = time.monotonic()
    with progress_bar(len(lines), unit=" lines", desc=name) as bar:
        hyps = translator.translate(lines, progress=bar.update)
    results["test_translate_seconds"] = round(time.monotonic() - t0, 1)
    hyp_path.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    print(f"[5/7] translated {len(hyps)} {name} sentences in {results['test_translate_seconds']} s", flush=True)
    return hyps


def report_test_scores(scores: list, name: str, results: dict) -> None:
    """6. The test split ``name``'s scores into ``results["test"]``, and printed."""
    results["test"] = {s.label: _score_entry(s) for s in scores}
    for s in scores:
        ratio = results["test"][s.label].get("length_ratio")
        shown = f" (length ratio {ratio:.3f})" if ratio is not None else ""
        print(f"[6/7] {name} {s.label}: {s.score:.2f}{shown}   {s.signature}", flush=True)


def _stage_test(cfg: DemoConfig, translator, files: dict[str, Path], hyp_path: Path, src: str, tgt: str,
                results: dict) -> Path:
    """5-6. test_2016 translated into ``hyp_path`` (one line per source line) and scored: the
    published baselines' tokenized BLEU, sacreBLEU and chrF, the paper's compound-split BLEU."""
    from aiayn.evaluate.bleu import score_all
    from aiayn.evaluate.multi30k import multi30k_bleu
    hyps = translate_test(translator, read_text(files[f"raw.test.{src}"]), hyp_path, "test_2016", results)
    ref_raw, ref_tok = read_text(files[f"raw.test.{tgt}"]), read_text(files[f"tok.test.{tgt}"])
    scores = [multi30k_bleu(hyps, ref_tok, tgt), *score_all(hyps, ref_raw, tgt, lowercase=cfg.lowercase)]
    report_test_scores(scores, "test_2016", results)
    return hyp_path
