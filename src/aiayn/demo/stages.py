"""The stages both demos share (``aiayn.demo.multi30k`` on Multi30k, ``aiayn.demo.own`` on your
own parallel text), and ``aiayn parse demo``'s training: the first N lines (``subset``), the shared
BPE (``stage_prepare``), the recipe trained in one or several processes or as several members
(``stage_train``), the last checkpoints averaged (``stage_average``), the test split translated and
its scores reported, examples translated and the first one's attention drawn (``stage_examples``), results.json.
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
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.data.textio import count_lines, read_lines, unaligned
from aiayn.demo.config import (CUDA_PROCESS_BYTES, DEMO_STEP_TOKENS, GPU_MEMBERS, GPU_STEP_DEVICE_S,
                               GPU_STEP_MATMUL_TFLOPS, RECIPES, DemoConfig)
from aiayn.errors import UserError
from aiayn.files import (check_output_path, claim_folder, refuse_input_as_output, refuse_inputs_inside,
                         write_json_atomic, write_text_output)
from aiayn.progress import progress_bar

if TYPE_CHECKING:
    from aiayn.data.stream import Batching
    from aiayn.train.config import RunConfig, TrainConfig

log = logging.getLogger(__name__)
INPUTS = "inputs.json"  # in --out: the files as given that its data was prepared from (stage_prepare)


def _score_entry(score) -> dict:
    """A score for results.json; BLEU scores also carry their length ratio."""
    from aiayn.evaluate.bleu import BleuResult
    entry = {"score": round(score.score, 2), "signature": score.signature}
    if isinstance(score, BleuResult):
        entry["length_ratio"] = round(score.length_ratio, 3)
    return entry


def step_sets(b: Batching, local_sgd: bool, processes: int, step_tokens: int) -> list[str]:
    """Overrides of the recipe's batching ``b`` that keep a step at ``step_tokens`` + ``step_tokens``
    tokens on ``processes`` synchronous data-parallel processes: processes x train.accum_steps x the
    per-process batch = ``step_tokens``, the recipe's per-process batch kept where it fits
    (multi30k.json's 2,048: 2 processes, or 1 process accumulating 2 batches), else cut to
    ``step_tokens`` / processes. None where ``step_tokens`` is 0 or under local SGD (``local_sgd``:
    each process then steps on its own)."""
    if not step_tokens or (local_sgd and processes > 1):
        return []
    share = max(1, step_tokens // processes)  # tokens each process adds to a step
    accum = max(1, share // b.max_tgt_tokens)
    per_process = share // accum
    out = [f"train.accum_steps={accum}"]
    if per_process != b.max_tgt_tokens:
        ratio = b.max_src_tokens / b.max_tgt_tokens
        out += [f"train.max_src_tokens={max(1, round(per_process * ratio))}", f"train.max_tgt_tokens={per_process}"]
    return out


def claim_out(cfg: DemoConfig, default: str, names: tuple[str, ...], files: dict[str, Path]) -> Path:
    """The demo's --out (``claim_folder``: new, resumed, or with --overwrite started afresh), before
    any work: refused where it holds one of the demo's inputs (``files``, --recipe), which starting
    afresh would delete; --results-to checked as well, not only once the run is over."""
    out = Path(cfg.out or default)
    inputs = [*files.values(), *([cfg.recipe] if cfg.recipe else [])]
    refuse_inputs_inside(out, inputs)
    if cfg.results_to:
        refuse_input_as_output(cfg.results_to, inputs, "--results-to")
        check_output_path(cfg.results_to, "--results-to")
    return claim_folder(out, names, overwrite=cfg.overwrite, what="aiayn demo")


def subset(files: dict[str, Path], work: Path, cfg: DemoConfig) -> dict[str, Path]:
    """The first --train-lines / --eval-lines lines of each file (``files`` by "KIND.SPLIT.SIDE"),
    written to ``work`` on every run, when those options ask for it. The files are read as ``aiayn
    prepare`` reads them (``read_lines``: gzip by content, lines ending at ``\\n`` only, an error
    naming the given file and line) and whole: a split's two raw files with different line counts
    are an error naming the shorter one, in ``aiayn prepare``'s words (``read_pairs``)."""
    if not cfg.train_lines and not cfg.eval_lines:
        return files
    work.mkdir(parents=True, exist_ok=True)
    out, counts = {}, {}
    for key, path in files.items():
        limit = cfg.train_lines if ".train." in key else cfg.eval_lines
        lines, n = [], 0
        for n, line in enumerate(read_lines(path), 1):
            if not limit or n <= limit:
                lines.append(line)
        counts[key] = n
        if key.startswith("raw."):  # a split's pair, source first: aligned in the files given
            split = key.split(".")[1]
            pair = [k for k in counts if k.startswith(f"raw.{split}.")]
            if len(pair) == 2:
                (a, n_a), (b, n_b) = ((files[k], counts[k]) for k in pair)
                if n_a != n_b:  # (two empty files are prepare's to refuse: its message names the split)
                    raise unaligned(a, n_a, b, n_b)
        out[key] = work / key
        write_text_output(out[key], "".join(line + "\n" for line in lines))
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
    (``aiayn.demo.launch``: torchrun's, quiet when interrupted): one model, data parallel over gloo on a CPU."""
    launch = ([sys.executable, "-m", "aiayn.demo.launch", "--standalone", f"--nproc_per_node={processes}"]
              if processes > 1 else [sys.executable])
    cmd = [*launch, "-m", "aiayn.cli", "train", "--data", str(data_dir), "--out", str(run_dir), "--recipe", str(recipe)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def default_recipe(quick: bool, cuda: bool | None = None) -> Path:
    """The recipe without --recipe: multi30k-quick.json with --quick; else multi30k-gpu.json where CUDA
    is present (one process, the same 4,096-token steps, a shorter clock) and multi30k.json on a CPU."""
    if quick:
        return RECIPES / "multi30k-quick.json"
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    return RECIPES / ("multi30k-gpu.json" if cuda else "multi30k.json")


def minutes(m: float) -> str:
    """``m`` minutes in words: the noun singular for exactly one (tests/demo/test_demo.py has examples)."""
    return f"{m:g} minute" + ("" if m == 1 else "s")


def say_quick(cfg: DemoConfig) -> None:
    """With --quick (and no --recipe), what it trades, said before any work: the quick recipe's model
    and minutes (with --set and --minutes) against the full demo's minutes, and where the scores of
    each are."""
    if not cfg.quick or cfg.recipe:
        return
    from aiayn.config import apply_sets
    from aiayn.demo.config import MINUTES
    from aiayn.train.config import load_recipe
    quick = apply_sets(load_recipe(default_recipe(True)), recipe_sets(cfg.sets, cfg.minutes, cfg.max_steps))
    q = quick.model
    print(f"--quick: a {q.n_layers}+{q.decoder_layers}-layer model trained for {minutes(quick.train.max_time_min)}, "
          f"where the full demo trains a larger one for {MINUTES:g}: every stage runs, but the translations are "
          f"rough (what each scores: docs/recipe.md)", flush=True)


def auto_members(cfg: DemoConfig) -> int:
    """``--members 0``: up to ``GPU_MEMBERS`` where the demo trains multi30k-gpu.json on one GPU in one
    process (no --recipe, no --quick, --processes 0 or 1), whose step waits on the host more than on a
    fast GPU, so that several models train at once at nearly the speed of one; else 1. As many as
    - the device serves while each still reaches the recipe's ``max_steps`` in its minutes: a
      member's step takes ``GPU_STEP_DEVICE_S`` of an H200's work, scaled by this GPU's matmul rate
      in the run's precision (``runtime.matmul_tflops``), and the members take turns on the device;
    - the host has cores: each member's step is issued by its own process;
    - the GPU's free memory holds (each member's training peak in the run's precision by
      ``aiayn.cost.memory``, and ``CUDA_PROCESS_BYTES``).
    The count and its reasons are logged."""
    import torch
    if cfg.members:
        return cfg.members
    one_gpu = torch.cuda.is_available() and torch.cuda.device_count() == 1
    if not (one_gpu and not cfg.recipe and not cfg.quick and cfg.processes <= 1):
        return 1
    import dataclasses

    from aiayn.cost.memory import peak_memory
    from aiayn.train import runtime as rt
    from aiayn.train.config import batching, load_recipe
    from aiayn.train.loop import precision_of, schedule_of
    run = load_recipe(default_recipe(False, cuda=True))
    b = batching(run.train)
    device, schedule = torch.device("cuda"), schedule_of(run)
    precision = precision_of(run, device)
    peak = peak_memory(dataclasses.replace(run.model, vocab_size=cfg.vocab_size), run.train, b.max_src_tokens,
                       b.max_tgt_tokens, precision)
    by_memory = torch.cuda.mem_get_info()[0] // (peak.total + CUDA_PROCESS_BYTES)
    by_cores = os.cpu_count() or 1
    rate = rt.matmul_tflops(device, n=8192, seconds=0.5, dtype=rt.precision_dtype(precision))
    torch.cuda.empty_cache()  # the measure's matrices: this process decodes later, the members train now
    step_s = GPU_STEP_DEVICE_S * GPU_STEP_MATMUL_TFLOPS / rate  # one member's step of device work here
    budget_s = (cfg.minutes or schedule.max_time_min) * 60
    by_device = int(budget_s // (step_s * schedule.max_steps))
    members = max(1, min(GPU_MEMBERS, by_device, by_cores, by_memory))
    log.info("members: %d on %s (%s matmuls at %.0f TFLOP/s: a member's step about %.1f ms of its work, so "
             "%d reach %d steps in %g minutes; its free memory holds %d, the host's cores %d)", members,
             torch.cuda.get_device_name(device), precision, rate, step_s * 1e3, by_device, schedule.max_steps,
             budget_s / 60, by_memory, by_cores)
    return members


def auto_processes() -> int:
    """``--processes 0``: one per GPU; on a CPU 2 (with at least 2 cores), each with its own thread."""
    import torch
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2 if (os.cpu_count() or 1) >= 2 else 1


STOP_WAIT_S = 15.0  # how long an interrupted launcher is given to stop its ranks before SIGTERM


def train_data_parallel(data_dir: Path, run_dir: Path, recipe: Path, sets: list[str], t: TrainConfig,
                        processes: int) -> None:
    """Train one model of ``recipe`` and ``sets`` (whose train section is ``t``) with ``processes``
    data-parallel processes, each on its share of the threads."""
    threads = max(1, (t.threads or os.cpu_count() or 1) // processes)
    proc = _run_training(_train_cmd(data_dir, run_dir, recipe, [*sets, f"train.threads={threads}"], processes),
                         None, env={**os.environ, "OMP_NUM_THREADS": str(threads)})  # (torchrun's default is 1)
    try:
        if proc.wait() != 0:
            raise UserError(f"{run_dir}: training failed (exit code {proc.returncode})")
    finally:
        if proc.poll() is None:
            try:  # a Ctrl-C reached the launcher too (one process group): it stops its ranks itself
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait()


def _train_members(data_dir: Path, member_dirs: list[Path], recipe: Path, sets: list[str], t: TrainConfig) -> None:
    """Train one model of ``recipe`` and ``sets`` (whose train section is ``t``) per directory at once,
    each in its own ``aiayn train`` process with its share of the threads and seed train.seed + i.
    The first shows its progress bar; the others
    write to MEMBER.log beside their directory. Finished members are skipped, interrupted ones
    resume; if one fails, the others are stopped.
    """
    n = len(member_dirs)
    threads = max(1, (t.threads or os.cpu_count() or 1) // n)
    procs: list[tuple[Path, subprocess.Popen, Path | None]] = []
    try:
        for i, d in enumerate(member_dirs):
            if (d / "summary.json").exists():
                continue
            cmd = _train_cmd(data_dir, d, recipe, [*sets, f"train.seed={t.seed + i}", f"train.threads={threads}"])
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


def record_alpha(model_path: Path, alpha: float) -> None:
    """The α chosen on validation stored in ``model_path`` (its ``decode`` entry, which translate,
    evaluate and serve read unless a flag says otherwise): the demo's model translates as the demo
    scored it."""
    from aiayn.checkpoint import atomic_save, load_checkpoint
    ckpt = load_checkpoint(model_path, ensemble_ok=True)
    if ckpt.get("decode") != {"alpha": alpha}:
        atomic_save({**ckpt, "decode": {"alpha": alpha}}, model_path)


def write_results(cfg: DemoConfig, out: Path, results: dict) -> None:
    """``out/results.json``, and the same file at ``--results-to`` (written whole; a results folder's
    copy for BENCHMARKS.md), with what repeating it needs besides the options, the recipe and the seed
    that ``results`` holds: this process's code, libraries and machine (``environment``)."""
    from aiayn.files import write_output
    from aiayn.host.environment import environment
    results["environment"] = environment()
    text = json.dumps(results, indent=2, ensure_ascii=False).encode()
    write_output(out / "results.json", lambda f: f.write(text))
    print(f"results: {out / 'results.json'}")
    if cfg.results_to:
        Path(cfg.results_to).parent.mkdir(parents=True, exist_ok=True)
        write_output(cfg.results_to, lambda f: f.write(text))
        print(f"results: {cfg.results_to}")


def stage_examples(translator, examples: list[str], plots_dir: Path, results: dict) -> Path:
    """7. ``examples`` translated into ``results``, the first one's attention drawn in ``plots_dir``
    (which sentence, and how many plots, said)."""
    results["examples"] = dict(zip(examples, translator.translate(examples)))
    for s, t in results["examples"].items():
        print(f"[7/7] {s}  ->  {t}", flush=True)
    if plots_dir.exists():
        shutil.rmtree(plots_dir)
    from aiayn.viz.attention import plot_attention
    paths = plot_attention(translator, examples[0], plots_dir)
    print(f"[7/7] attention drawn for \"{examples[0]}\": {len(paths)} plots in {plots_dir} (encoder, decoder and "
          f"encoder-decoder attention, one PNG a layer, every head)", flush=True)
    return plots_dir


def forget_results(out: Path) -> None:
    """An earlier run's ``out/results.json`` removed before this run changes what it describes (the
    averaged model.pt and its α, the translations, the plots): a run stopped or failing midway leaves
    no scores beside outputs they are not of. ``write_results`` writes it at the end."""
    (out / "results.json").unlink(missing_ok=True)


def mark_reused(results: dict, stage: str) -> None:
    """``stage`` taken whole from an earlier run of the same --out (a re-run): listed in
    results.json's ``reused``, and what it measured there (``prepare_seconds``, ``train``,
    ``sizing``) is what that run stored."""
    results.setdefault("reused", []).append(stage)


def stage_prepare(cfg: DemoConfig, files: dict[str, Path], data_dir: Path, langs: tuple[str, str], results: dict,
                  given: dict[str, Path] | None = None) -> Path:
    """1. The shared BPE and the binarized splits of ``files`` ("raw.SPLIT.LANG", ``langs`` the source
    and target's; train and valid, test where given) in ``data_dir``, unless a run prepared them
    already (from the same files, ``given`` as the user gave them before ``subset`` took their first
    lines, and with the same options: others are an error, not a silent reuse); what they were is
    kept in ``data_dir``'s sibling ``INPUTS``. Unaligned files are an error naming the file and line
    (``read_pairs``)."""
    from aiayn.data.prepare import PrepareConfig, SplitFiles, prepare
    prep_cfg = PrepareConfig(vocab_size=cfg.vocab_size, lowercase=cfg.lowercase,
                             character_coverage=cfg.character_coverage)
    src, tgt = langs
    inputs = given_inputs(cfg, given or files, langs)
    record = data_dir.parent / INPUTS
    again = (data_dir / "manifest.json").exists()  # prepared before: a re-run
    if not again:
        manifest = prepare({s: SplitFiles(files[f"raw.{s}.{src}"], files[f"raw.{s}.{tgt}"])
                            for s in ("train", "valid", "test") if f"raw.{s}.{src}" in files}, data_dir, prep_cfg)
        write_json_atomic(record, inputs)
    else:
        manifest = json.loads((data_dir / "manifest.json").read_text())
        had = manifest["options"]
        differ = [k for k in ("vocab_size", "lowercase", "character_coverage") if had.get(k, False) != getattr(prep_cfg, k)]
        if differ:
            raise UserError(f"{data_dir / 'manifest.json'}: prepared with "
                            f"{', '.join(f'{k}={had.get(k, False)}' for k in differ)}, but this run asks for "
                            f"{', '.join(f'{k}={getattr(prep_cfg, k)}' for k in differ)}; use another --out")
        if record.exists():
            _check_same_inputs(data_dir, json.loads(record.read_text()), inputs)
        else:  # a run from before INPUTS was kept: the files prepare read, as the manifest has them
            read = given_inputs(cfg, files, langs, subset=False)
            for split in read:
                had = manifest["splits"].get(split, {}).get("inputs")
                if had is not None:  # (recorded since the manifest's inputs were)
                    _check_same_inputs(data_dir, {split: {**had, "first": 0}}, {split: read[split]})
        mark_reused(results, "prepare")
    if "seconds" in manifest:  # what prepare took, as it stored it (manifests since it was stored)
        results["prepare_seconds"] = manifest["seconds"]
    print(f"[1/7] data: {data_dir}{' (prepared before: a re-run)' if again else ''}", flush=True)
    return data_dir


def given_inputs(cfg: DemoConfig, files: dict[str, Path], langs: tuple[str, str], subset: bool = True) -> dict:
    """What the model is trained and validated on (test is read raw), by split: the source and target
    files as given (``files`` by "raw.SPLIT.LANG"), the source's lines, and the first lines of them
    taken (--train-lines / --eval-lines where ``subset`` and fewer than all; else 0)."""
    out = {}
    for split, limit in (("train", cfg.train_lines), ("valid", cfg.eval_lines)):
        src, tgt = (files[f"raw.{split}.{lang}"] for lang in langs)
        n = count_lines(src)
        out[split] = {"src": str(src.resolve()), "tgt": str(tgt.resolve()), "lines": n,
                      "first": limit if subset and 0 < limit < n else 0}
    return out


def _check_same_inputs(data_dir: Path, was: dict, now: dict) -> None:
    """A data directory of an earlier run is reused only for the same files of each split in ``now``
    (``given_inputs``: the same paths, line counts and first lines taken of them, as ``was`` records):
    other files, or the same the other way round, are an error, not a silent reuse of the earlier data
    and model."""
    def said(inputs: dict) -> str:
        lines = f"the first {inputs['first']} of {inputs['lines']}" if inputs.get("first") else inputs.get("lines")
        return f"{inputs.get('src')} and {inputs.get('tgt')} ({lines} lines)"

    for split, given in now.items():
        had = {k: was.get(split, {}).get(k) for k in given}
        if had != given:
            raise UserError(f"{data_dir}: its {split} split was prepared from {said(had)}, but this run gives "
                            f"{said(given)}; use another --out, or --overwrite to start afresh")


def check_sets(cfg: DemoConfig) -> None:
    """``--set``, --minutes and --max-steps read as the training stage will read them, before the data is
    prepared: a misspelt key or a bad value is said at once (against --recipe, else the default recipe;
    the sized one has the same fields)."""
    from aiayn.config import apply_sets
    from aiayn.train.config import load_recipe
    recipe = Path(cfg.recipe) if cfg.recipe else default_recipe(cfg.quick, cuda=False)
    apply_sets(load_recipe(recipe), recipe_sets(cfg.sets, cfg.minutes, cfg.max_steps, cfg.threads))


def recipe_sets(sets: str, minutes: float, max_steps: int, threads: int = 0) -> list[str]:
    """A demo's overrides of its recipe: ``sets`` (SECTION.FIELD=VALUE joined by commas), then
    its --minutes, --max-steps and --threads where given (0: not given); one that a ``sets`` entry of
    its field contradicts is refused (``option_sets``)."""
    from aiayn.config import option_sets
    out = [x for x in sets.split(",") if x.strip()]
    return out + option_sets(out, [("--minutes", "train.max_time_min", float(minutes) if minutes else None),
                                   ("--max-steps", "train.max_steps", max_steps or None),
                                   ("--threads", "train.threads", threads or None)])


def train_recipe(data_dir: Path, run_dir: Path, recipe: Path, sets: list[str], processes: int, stage: str) -> None:
    """One model of ``recipe`` with the overrides ``sets`` trained into ``run_dir`` unless it finished
    there (resumed if it started): in ``processes`` data-parallel processes (0 = ``auto_processes()``)
    or in this one. ``stage`` (e.g. "[2/7]") starts the line it prints."""
    from aiayn.config import apply_sets
    from aiayn.train.config import batching, load_recipe
    from aiayn.train.loop import train
    run_cfg = apply_sets(load_recipe(recipe), sets)
    if (run_dir / "summary.json").exists():
        check_finished_run(run_dir, run_cfg)
        return
    processes = processes or auto_processes()
    t, b = run_cfg.train, batching(run_cfg.train)
    step = f", {b.accum_steps} batches of {b.max_tgt_tokens:,} tokens a step per process" if b.accum_steps > 1 else ""
    print(f"{stage} training {recipe.name} for up to {minutes(t.max_time_min)} into {run_dir}"
          + (f" with {processes} processes" if processes > 1 else "") + step, flush=True)
    if processes > 1:
        train_data_parallel(data_dir, run_dir, recipe, sets, t, processes)
    else:
        train(data_dir, run_dir, run_cfg, progress=True)


DERIVED_TRAIN_FIELDS = ("threads", "accum_steps", "max_src_tokens", "max_tgt_tokens")  # from --processes, --threads
DATA_MODEL_FIELDS = ("vocab_size", "tgt_vocab_size", "tie_src_tgt_embeddings")  # the data directory's (fit_to_data)


def check_finished_run(run_dir: Path, run_cfg: RunConfig) -> None:
    """A run that finished in ``run_dir`` (its summary.json) is reused only where it was trained as
    ``run_cfg`` asks (its config.json, one of an older version as ``checkpoint.format.upgrade`` reads
    it): the model (the fields the data directory sets aside, ``DATA_MODEL_FIELDS``)
    and the training options (those the demo derives from the process and thread counts aside,
    ``DERIVED_TRAIN_FIELDS``: a step holds the same tokens on any count). Another --recipe,
    --minutes, --max-steps or --set is an error naming the field, as prepare's options are, not the
    earlier model scored under the new options."""
    from aiayn.checkpoint.format import upgrade
    from aiayn.config import to_dict
    path = run_dir / "config.json"
    if not path.is_file():
        return
    had = json.loads(path.read_text())
    model, execution = upgrade(had.get("model", {}))  # as an older version wrote it: as ``load_recipe`` reads it
    sections = {"model": model, "train": {**execution, **had.get("train", {})}}
    differ = []
    for section, derived in (("model", DATA_MODEL_FIELDS), ("train", DERIVED_TRAIN_FIELDS)):
        was = sections[section]
        for k, v in to_dict(getattr(run_cfg, section)).items():
            if k not in derived and k in was and was[k] != v:
                differ.append((f"{section}.{k}", was[k], v))
    if differ:
        raise UserError(f"{path}: the finished run was trained with {', '.join(f'{k}={a!r}' for k, a, _ in differ)}, "
                        f"but this run asks for {', '.join(f'{k}={b!r}' for k, _, b in differ)}; use another --out, "
                        f"or --overwrite to start afresh")


def stage_train(cfg: DemoConfig, data_dir: Path, run_dir: Path, results: dict) -> list[Path]:
    """2. The recipe trained into ``run_dir`` (``--members`` > 1: one sub-directory a member), or
    resumed there; returns the members' run directories. ``results`` gets the recipe's name, the seed
    (member i's is seed + i - 1) and the first run's whole configuration (its config.json)."""
    from aiayn.config import apply_sets
    from aiayn.train.config import batching, load_recipe
    recipe = Path(cfg.recipe) if cfg.recipe else _sized_recipe(cfg, run_dir.parent, results)
    sets = recipe_sets(cfg.sets, cfg.minutes, cfg.max_steps, cfg.threads)
    t = apply_sets(load_recipe(recipe), sets).train
    member_dirs = [run_dir] if cfg.members == 1 else [run_dir / f"member{i + 1}" for i in range(cfg.members)]
    finished = all((d / "summary.json").exists() for d in member_dirs)  # before: not trained again
    if cfg.members == 1:
        processes = cfg.processes or auto_processes()
        given = {s.partition("=")[0].strip() for s in sets}
        own_step = bool(cfg.recipe or cfg.quick or "train.accum_steps" in given)
        step = step_sets(batching(t), t.local_sgd_period > 0, processes, 0 if own_step else DEMO_STEP_TOKENS)
        if any(s.partition("=")[0] in given for s in step):  # a --set batch wins over the demo's, as over the recipe's
            step = []
        train_recipe(data_dir, run_dir, recipe, sets + step, processes, "[2/7]")
    else:
        run_cfg = apply_sets(load_recipe(recipe), sets)
        for i, d in enumerate(member_dirs):
            if (d / "summary.json").exists():
                check_finished_run(d, dataclasses.replace(run_cfg, train=dataclasses.replace(t, seed=t.seed + i)))
        if not all((d / "summary.json").exists() for d in member_dirs):
            print(f"[2/7] training {cfg.members} members of {recipe.name} at once for up to "
                  f"{minutes(t.max_time_min)} into {run_dir}", flush=True)
            _train_members(data_dir, member_dirs, recipe, sets, t)
    if finished:
        mark_reused(results, "train")
    summaries = [json.loads((d / "summary.json").read_text()) for d in member_dirs]
    run_config = json.loads((member_dirs[0] / "config.json").read_text())  # what it trained, every field
    results.update(recipe=cfg.recipe or recipe.name, seed=run_config["train"]["seed"], run_config=run_config)
    results["train"] = summaries[0]
    if cfg.members > 1:
        results["train_members"] = summaries
    print(f"[2/7] trained{' before (a re-run)' if finished else ''}: {', '.join(str(t['steps']) for t in summaries)} steps, "
          f"{results['train']['train_seconds']:.0f} s", flush=True)
    return member_dirs


def _sized_recipe(cfg: DemoConfig, out: Path, results: dict) -> Path:
    """The default recipe: multi30k-gpu.json where CUDA is present; on a CPU the one sized to this
    machine's budget of training FLOPs in the demo's minutes (aiayn.demo.sizing), in the precision
    its training will take (the recipes' with the demo's ``--set``: auto is bf16 where native, else
    fp32), printed with why."""
    import torch

    from aiayn.config import apply_sets
    from aiayn.demo.sizing import QUICK_SIZES, SIZES, describe, sized_recipe
    from aiayn.train.config import load_recipe
    from aiayn.train.loop import precision_of
    if default_recipe(cfg.quick).name == "multi30k-gpu.json":
        return default_recipe(cfg.quick)
    first_run = load_recipe(RECIPES / (QUICK_SIZES if cfg.quick else SIZES)[0].recipe)
    first = first_run.train
    minutes = cfg.minutes or first.max_time_min
    processes = (cfg.processes or auto_processes()) if cfg.members == 1 else 1
    threads = max(1, (cfg.threads or first.threads or os.cpu_count() or 1) // (processes * cfg.members))
    precision = precision_of(apply_sets(first_run, recipe_sets(cfg.sets, cfg.minutes, cfg.max_steps)),
                             torch.device("cpu"))
    again = (out / "sizing.json").exists()  # a re-run: the choice made when the run began, not measured now
    recipe, record = sized_recipe(cfg.quick, minutes, processes, threads, out, precision=precision)
    results["sizing"] = record
    if again:
        mark_reused(results, "sizing")
    print(f"[2/7] sized to this machine{' when the run began (sizing.json)' if again else ''}: {describe(record)}",
          flush=True)
    return recipe


def stage_average(cfg: DemoConfig, member_dirs: list[Path], run_dir: Path, model_path: Path, results: dict) -> Path:
    """3. Each member's last ``average_last`` checkpoints averaged (§6.1); one member straight
    into ``model_path``, several into an ensemble file there."""
    from aiayn.checkpoint import atomic_save, average_checkpoints, ensemble_checkpoint, step_checkpoints
    averages, averaged, again = [], [], False
    for d in member_dirs:
        ckpts = step_checkpoints(d)[-cfg.average_last:]
        averages.append(model_path if cfg.members == 1 else d / "averaged.pt")
        if not _averaged_already(averages[-1], ckpts):
            atomic_save(average_checkpoints(ckpts), averages[-1])
            again = True
        averaged.append([p.relative_to(run_dir).as_posix() for p in ckpts])
    if cfg.members > 1 and (again or not model_path.is_file()):
        atomic_save(ensemble_checkpoint(averages), model_path)
        again = True
    done = "averaged" if again else "averaged before (a re-run):"
    if not again:
        mark_reused(results, "average")
    results["averaged"] = averaged[0] if cfg.members == 1 else averaged
    if cfg.members == 1:
        print(f"[3/7] {done} {len(averaged[0])} checkpoints -> {model_path}", flush=True)
    else:
        print(f"[3/7] {done} the last {cfg.average_last} checkpoints of each member; their ensemble -> {model_path}",
              flush=True)
    return model_path


def _averaged_already(path: Path, ckpts: list[Path]) -> bool:
    """Whether ``path`` holds the average of exactly ``ckpts`` (its ``averaged_from``): a re-run does
    not average them again, and averages anew when the run or --average-last changed."""
    from aiayn.checkpoint import load_checkpoint
    if not path.is_file():
        return False
    try:
        return load_checkpoint(path).get("averaged_from") == [str(p) for p in ckpts]
    except UserError:
        return False


def translate_test(translator, lines: list[str], hyp_path: Path, name: str, results: dict) -> list[str]:
    """5. The test split ``name``'s ``lines`` translated into ``hyp_path`` (one line per source line),
    the seconds it took in ``results``."""
    t0 = time.monotonic()
    with progress_bar(len(lines), unit=" lines", desc=name) as bar:
        hyps = translator.translate(lines, progress=bar.update)
    results["test_translate_seconds"] = round(time.monotonic() - t0, 1)
    write_text_output(hyp_path, "".join(h + "\n" for h in hyps))
    print(f"[5/7] translated {len(hyps)} {name} sentences in {results['test_translate_seconds']} s", flush=True)
    return hyps


def report_test_scores(scores: list, name: str, results: dict) -> None:
    """6. The test split ``name``'s scores into ``results["test"]``, and printed."""
    results["test"] = {s.label: _score_entry(s) for s in scores}
    for s in scores:
        ratio = results["test"][s.label].get("length_ratio")
        shown = f" (length ratio {ratio:.3f})" if ratio is not None else ""
        print(f"[6/7] {name} {s.label}: {s.score:.2f}{shown}   {s.signature}", flush=True)


