"""``aiayn parse demo``: the NLTK WSJ sample from ``treebank.zip`` to a scored test split (§6.3).

Steps (each skipped when its output exists, so a re-run resumes; training resumes from its last
checkpoint):
  1. prepare   split by WSJ file, linearize, shared BPE                    OUT/ptb
  2. train     recipes/parse-sample.json, bounded by --minutes, data parallel over the cores
                                                                          OUT/run
  3. average   the last --average-last checkpoints (§6.1)                 OUT/model.pt
  4. parse     dev and test with the constrained beam search (§6.3's beam 21, α 0.3, +300)
                                                                          OUT/{dev,test}.pred
  5. score     EVALB (COLLINS.prm) beside the right-branching baseline    OUT/results.json
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from aiayn.config import ConfigError, param, replace
from aiayn.demo.config import MINUTES
from aiayn.demo.stages import recipe_sets, train_recipe
from aiayn.errors import UserError
from aiayn.files import claim_folder

log = logging.getLogger(__name__)

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "parse-sample.json"
SPLITS = ("dev", "test")


def _splits(cfg: "ParseDemoConfig") -> tuple[str, ...]:
    chosen = tuple(s.strip() for s in cfg.splits.split(",") if s.strip())
    if not chosen or any(s not in SPLITS for s in chosen):
        raise UserError(f"--splits takes {' and/or '.join(SPLITS)}, comma-separated; got {cfg.splits!r}")
    return chosen


@dataclass(frozen=True)
class ParseDemoConfig:
    """Options of ``aiayn parse demo``; defaults are the full run (``MINUTES`` of training, as ``aiayn demo``)."""

    treebank: str = param("", "treebank.zip (or a directory of wsj_NNNN.mrg files); empty = NLTK's sample, "
                              "ptb-wsj-nltk-sample/treebank.zip under --data-root")
    data_root: str = param("", "folder holding ptb-wsj-nltk-sample/ (`aiayn data ptb-sample --out DIR` fills one); "
                               "empty = $AIAYN_SHARED_DATA, ../shared/data, the cache ($AIAYN_CACHE, else "
                               "$XDG_CACHE_HOME/aiayn or ~/.cache/aiayn), else a download into the cache (docs/data.md)")
    out: str = param("runs/parse-demo", "output directory (a re-run resumes)")
    minutes: float = param(0.0, f"training wall-time budget in minutes; 0 = the recipe's ({MINUTES:g})")
    max_steps: int = param(0, "also stop training after this many steps; 0 = only the time budget")
    processes: int = param(0, "data-parallel training processes, each on its share of the threads; 0 = one per "
                              "GPU, or 2 on a CPU with 2 or more cores")
    recipe: str = param("", "training recipe JSON; empty = recipes/parse-sample.json")
    sets: str = param("", "overrides of the recipe, SECTION.FIELD=VALUE joined by commas (as --set)")
    linearization: str = param("words", "target form: words (the words copied, the recipe's) or slots "
                                        "(Vinyals et al.'s XX); docs/parsing.md")
    vocab_size: int = param(4000, "shared BPE vocabulary size")
    average_last: int = param(5, "average this many last checkpoints (§6.1)")
    beam_size: int = param(21, "beam size (§6.3: 21)")
    alpha: float = param(0.3, "length penalty α (§6.3: 0.3)")
    device: str = param("auto", "where the parser decodes: auto, cpu, cuda or cuda:N")
    splits: str = param("dev,test", "the splits to parse and score, comma-separated (dev alone while choosing a recipe)")

    def __post_init__(self) -> None:
        if self.average_last < 1:  # (0 would take every checkpoint: [-0:])
            raise ConfigError(f"average_last must be >= 1, got {self.average_last}")


def _treebank(cfg: ParseDemoConfig) -> Path:
    """--treebank; else NLTK's sample, found or downloaded as Multi30k is (aiayn.data.ptb_sample)."""
    if cfg.treebank:
        return Path(cfg.treebank)
    from aiayn.data.ptb_sample import find_ptb_sample
    return find_ptb_sample(cfg.data_root or None)


def _stage_prepare(cfg: ParseDemoConfig, out: Path) -> Path:
    """1. Split files and the data directory in ``out/ptb``; a re-run with other options is an error."""
    from aiayn.parsing.prepare import PARSE_DATA_DEFAULTS, prepare_parsing
    ptb = out / "ptb"
    done = ptb / "splits.json"
    if done.exists() and (ptb / "data" / "manifest.json").exists():
        had = json.loads(done.read_text()).get("linearization", "slots")
        vocab = json.loads((ptb / "data" / "manifest.json").read_text())["options"]["vocab_size"]
        if (had, vocab) != (cfg.linearization, cfg.vocab_size):
            raise UserError(f"{ptb}: prepared with linearization {had} and vocabulary {vocab}, this run asks for "
                            f"{cfg.linearization} and {cfg.vocab_size}; use another --out")
    else:
        data_cfg = replace(PARSE_DATA_DEFAULTS, vocab_size=cfg.vocab_size, num_workers=os.cpu_count() or 1)
        prepare_parsing(_treebank(cfg), ptb, data_cfg, force=True, linearization=cfg.linearization)
    print(f"[1/5] data: {ptb / 'data'} ({cfg.linearization} linearization)", flush=True)
    return ptb


def _check_sets(cfg: ParseDemoConfig) -> None:
    """``--set``, --minutes and --max-steps read as the training stage will read them, before the treebank
    is prepared: a misspelt key or a bad value is said at once, as ``aiayn demo`` says it."""
    from aiayn.config import apply_sets
    from aiayn.train.config import load_recipe
    apply_sets(load_recipe(Path(cfg.recipe) if cfg.recipe else RECIPE), recipe_sets(cfg.sets, cfg.minutes, cfg.max_steps))


def _stage_train(cfg: ParseDemoConfig, data_dir: Path, run_dir: Path, results: dict) -> None:
    """2. The recipe trained into ``run_dir`` (or resumed there), data parallel over the cores."""
    recipe = Path(cfg.recipe) if cfg.recipe else RECIPE
    sets = recipe_sets(cfg.sets, cfg.minutes, cfg.max_steps)
    train_recipe(data_dir, run_dir, recipe, sets, cfg.processes, "[2/5]")
    results["train"] = json.loads((run_dir / "summary.json").read_text())
    print(f"[2/5] trained: {results['train']['steps']} steps, {results['train']['train_seconds']:.0f} s", flush=True)


def _stage_average(cfg: ParseDemoConfig, run_dir: Path, model_path: Path, results: dict) -> None:
    """3. The last ``average_last`` checkpoints averaged (§6.1) into ``model_path``."""
    from aiayn.checkpoint import atomic_save, average_checkpoints, step_checkpoints
    ckpts = step_checkpoints(run_dir)[-cfg.average_last:]
    if not model_path.exists():
        atomic_save(average_checkpoints(ckpts), model_path)
    results["averaged"] = [p.name for p in ckpts]
    print(f"[3/5] averaged {len(ckpts)} checkpoints -> {model_path}", flush=True)


def _stage_parse(cfg: ParseDemoConfig, splits: tuple[str, ...], model_path: Path, ptb: Path, out: Path,
                 results: dict) -> None:
    """4-5. Dev and test parsed (constrained), EVALB-scored beside the right-branching baseline."""
    from aiayn.decode.config import DecodeConfig
    from aiayn.parsing.baseline import right_branching
    from aiayn.parsing.decode import PARSE_DECODE, bracketed_lines, parse_trees, read_gold_trees
    from aiayn.parsing.evalb import evalb, read_lines
    from aiayn.parsing.evalb_params import COLLINS
    translator = None
    for split in splits:
        gold_lines, gold = read_gold_trees(ptb / f"{split}.gold")
        pred = out / f"{split}.pred"
        if not pred.exists():
            if translator is None:
                from aiayn.decode.translator import Translator
                dcfg: DecodeConfig = replace(PARSE_DECODE, beam_size=cfg.beam_size, alpha=cfg.alpha)
                translator = Translator.from_checkpoint(model_path, dcfg, device=cfg.device)
            t0 = time.monotonic()
            trees, stats = parse_trees(translator, gold)
            results[f"{split}_parse_seconds"] = round(time.monotonic() - t0, 1)
            results[f"{split}_repaired"] = stats.repaired
            tmp = pred.with_suffix(".tmp")
            tmp.write_text(bracketed_lines(trees), encoding="utf-8")
            tmp.replace(pred)
        baseline = [right_branching(g.words(), g.tags()).to_bracketed() for g in gold]
        for name, lines in (("aiayn", read_lines(pred)), ("right-branching", baseline)):
            score = evalb(gold_lines, lines, COLLINS, gold_name=str(ptb / f"{split}.gold"),
                          test_name=str(pred) if name == "aiayn" else "right-branching").all
            results.setdefault(split, {})[name] = {
                "labeled_f1": round(score.fmeasure, 2) if score.match else 0.0,  # (EVALB prints nan there)
                "recall": round(score.recall, 2),
                "precision": round(score.precision, 2), "sentences": len(gold_lines)}
        print(f"[4/5] {split}: labeled F1 {results[split]['aiayn']['labeled_f1']:.2f} "
              f"(right-branching {results[split]['right-branching']['labeled_f1']:.2f})", flush=True)


def format_table(results: dict) -> str:
    """The scores as a small table: one row per parser, labeled F1 / recall / precision per split."""
    splits = [s for s in SPLITS if s in results]
    rows = ["parser            " + "".join(f"{s + ' F1':>10}{'R':>8}{'P':>8}" for s in splits)]
    for name in ("aiayn", "right-branching"):
        rows.append(f"{name:<18}" + "".join(
            f"{results[s][name]['labeled_f1']:>10.2f}{results[s][name]['recall']:>8.2f}"
            f"{results[s][name]['precision']:>8.2f}" for s in splits))
    return "\n".join(rows)


def _check_same_decoding(cfg: ParseDemoConfig, earlier: Path) -> None:
    """A re-run keeps the averaged model and the trees of the run before (stages 3-4 are skipped where
    done), so it must ask for the same averaging and search: other values are an error, not a table of
    the old trees under the new settings."""
    if not earlier.is_file():
        return
    had = json.loads(earlier.read_text(encoding="utf-8")).get("config", {})
    differ = [k for k in ("average_last", "beam_size", "alpha") if k in had and had[k] != getattr(cfg, k)]
    if differ:
        raise UserError(f"{earlier}: its model and trees were made with "
                        f"{', '.join(f'{k} {had[k]}' for k in differ)}; this run asks for "
                        f"{', '.join(f'{k} {getattr(cfg, k)}' for k in differ)}: use another --out")


def run_parse_demo(cfg: ParseDemoConfig) -> dict:
    """Prepare, train, average, parse dev and test, score (module docstring); ``OUT/results.json``."""
    from aiayn.parsing.linearize import LINEARIZATIONS
    if cfg.linearization not in LINEARIZATIONS:
        raise UserError(f"--linearization must be one of {', '.join(LINEARIZATIONS)}, got {cfg.linearization!r}")
    _check_sets(cfg)
    names = ("ptb", "run", "model.pt", "results.json", *(f"{s}.{e}" for s in SPLITS for e in ("pred", "tmp")))
    out = claim_folder(cfg.out, names, what="aiayn parse demo")  # (never a folder it did not write)
    results: dict = {"config": dataclasses.asdict(cfg)}
    splits = _splits(cfg)
    ptb = _stage_prepare(cfg, out)
    _check_same_decoding(cfg, out / "results.json")
    run_dir, model_path = out / "run", out / "model.pt"
    _stage_train(cfg, ptb / "data", run_dir, results)
    _stage_average(cfg, run_dir, model_path, results)
    _stage_parse(cfg, splits, model_path, ptb, out, results)
    from aiayn.files import write_json_atomic
    from aiayn.host.environment import environment
    results["environment"] = environment()  # what repeats it (docs/training.md, "Reproducibility")
    write_json_atomic(out / "results.json", results)
    print("[5/5] EVALB (COLLINS.prm), labeled:\n" + format_table(results), flush=True)
    print(f"results: {out / 'results.json'}")
    print(f"trees: {out / (splits[-1] + '.pred')}")
    return results
