"""``aiayn demo``: Multi30k (Elliott et al. 2016) from raw text to scored translations and an
attention plot, on whatever machine it runs on (docs/recipe.md).

Steps (1-3 skipped when their output already exists, so a re-run resumes; 4-7 decode again, with the
decoding options given):
  1. prepare   shared BPE over both languages, binarized corpus      OUT/data
  2. train     the recipe sized to this machine (aiayn.demo.sizing: multi30k-small.json or
               multi30k.json by the FLOPs it trains in the minutes; multi30k-gpu.json where CUDA is
               present), bounded by --minutes                                          OUT/run
               with its 4,096 + 4,096-token steps on any process count (train.accum_steps)
               (--processes P: one model, P data-parallel processes, each on 1/P of the threads;
               --members N: N models at once, OUT/run/memberI, each on 1/N of the threads; on one
               GPU with multi30k-gpu.json, up to 4 by default)
  3. average   the last --average-last checkpoints (§6.1)              OUT/model.pt
               (--members N: each member's, then one ensemble file of the N averages)
  4. tune α    length penalty chosen on the validation set (never on test)
  5. translate test_2016 with beam search                              OUT/test_2016.hyp
  6. score     sacreBLEU + chrF on raw cased text; Multi30k tokenized BLEU (lowercased,
               Moses-tokenized, the published baselines' metric); the paper's compound-split BLEU
  7. examples  three sentences translated; the first one's attention drawn OUT/plots
               (a PNG for each layer of each kind of attention)
The last three lines printed are ``model: PATH``, ``translations: PATH`` and ``plots: PATH``.

Your own parallel text: ``--train SRC TGT --valid SRC TGT [--test SRC TGT]`` runs the same steps
on it (``aiayn.demo.own``; docs/own-data.md), into runs/demo-SRC-TGT.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from aiayn.data.multi30k import find_multi30k, read_text
from aiayn.demo import stages
from aiayn.demo.config import DemoConfig
from aiayn.demo.own import run_own_demo
from aiayn.errors import UserError
from aiayn.evaluate.alpha import ValidationSet, choose_alpha, p_values_text, tune_alpha

# all it writes in --out
DEMO_FILES = ("subset", "data", "inputs.json", "sizing.json", "run", "model.pt", "test_2016.hyp", "plots", "results.json")
LANGS = ("en", "de")
EXAMPLES = {
    "en": ["A man in a blue shirt is riding a bicycle down the street.",
           "Two dogs are playing in the snow.",
           "A little girl in a pink dress is eating an ice cream cone."],
    "de": ["Ein Mann in einem blauen Hemd fährt mit dem Fahrrad die Straße hinunter.",
           "Zwei Hunde spielen im Schnee.",
           "Ein kleines Mädchen in einem rosa Kleid isst ein Eis."],
}


def run_demo(cfg: DemoConfig) -> dict:
    """``aiayn demo`` in seven stages: prepare, train, average, choose α on validation, translate
    test_2016, score it, translate examples and plot their attention. On a re-run prepare, train
    and average are skipped where they finished (training resumes); the decoding stages run again,
    with the options given. ``out/results.json`` holds what each measured."""
    if cfg.members < 0 or cfg.processes < 0:
        raise UserError(f"--members and --processes must be at least 0, got {cfg.members} and {cfg.processes}")
    cfg = dataclasses.replace(cfg, members=stages.auto_members(cfg))
    if cfg.train:
        return run_own_demo(cfg)
    given = [flag for flag, value in (("--valid", cfg.valid), ("--test", cfg.test), ("--tgt-lang", cfg.tgt_lang)) if value]
    if given:
        raise UserError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with --train (your own files); "
                        f"Multi30k's target is the other of en, de")
    src = cfg.src_lang or "en"
    tgt = "de" if src == "en" else "en"
    if src not in LANGS:
        raise UserError(f"--src-lang must be en or de for Multi30k (or give your own files with --train), got {src!r}")
    _check_scorer()
    files = find_multi30k(cfg.data_root, src, tgt)
    stages.check_sets(cfg)  # before any work
    stages.say_quick(cfg)
    out = stages.claim_out(cfg, "runs/demo", DEMO_FILES, files)
    given, files = files, stages.subset(files, out / "subset", cfg)
    t_all = time.monotonic()
    results: dict = {"direction": f"{src}-{tgt}", "config": dataclasses.asdict(cfg)}
    data_dir = stages.stage_prepare(cfg, files, out / "data", (src, tgt), results, given)
    run_dir = out / "run"
    member_dirs = stages.stage_train(cfg, data_dir, run_dir, results)
    stages.forget_results(out)  # the stages below rewrite what it describes
    model_path = stages.stage_average(cfg, member_dirs, run_dir, out / "model.pt", results)

    from aiayn.decode.translator import Translator
    translator = Translator.from_checkpoint(model_path, device=cfg.device)
    _stage_alpha(cfg, translator, files, src, tgt, results)
    stages.record_alpha(model_path, results["alpha"])
    hyp_path = _stage_test(cfg, translator, files, out / "test_2016.hyp", src, tgt, results)

    plots_dir = stages.stage_examples(translator, EXAMPLES[src], out / "plots", results)
    results["seconds_total"] = round(time.monotonic() - t_all, 1)
    stages.write_results(cfg, out, results)
    print(f"model: {model_path}")
    print(f"translations: {hyp_path}")
    print(f"plots: {plots_dir}")
    return results


def alpha_reason(tried: list[float], p_values: dict, p_level: float) -> str:
    """Why the α taken for test was taken, of the ``tried`` ones (the first is §6.1's)."""
    if p_values:
        return (f"p against α {tried[0]}, paired bootstrap: {p_values_text(p_values)}; significant below {p_level}")
    return "the only one tried" if len(tried) == 1 else "the highest-scoring"


def _check_scorer() -> None:
    """The tokenized BLEU of stages 4 and 6 (``evaluate.multi30k``) needs sacremoses: said before the
    training, not after it."""
    import importlib
    try:
        importlib.import_module("sacremoses")
    except ImportError as exc:
        raise UserError(f"aiayn demo scores with sacremoses (Multi30k's tokenized BLEU), which does not import "
                        f"({exc}); pip install sacremoses") from exc


def _stage_alpha(cfg: DemoConfig, translator, files: dict[str, Path], src: str, tgt: str, results: dict) -> None:
    """4. The length penalty α chosen on the validation set (``choose_alpha``), set on
    ``translator``; validation scored at that α."""
    from aiayn.decode.config import DecodeConfig
    from aiayn.evaluate.bleu import sacre_bleu
    from aiayn.evaluate.multi30k import multi30k_bleu
    val_src, val_tok = read_text(files[f"raw.valid.{src}"]), read_text(files[f"tok.valid.{tgt}"])
    tuning, val_translations = tune_alpha(translator, ValidationSet(val_src, val_tok, tgt), cfg.alphas, cfg.beam_size,
                                          report=lambda a, r: print(
                                              f"[4/7] valid α={a}: Multi30k BLEU {r['valid_multi30k_bleu']:.2f}"
                                              f" (length ratio {r['length_ratio']:.3f})", flush=True))
    best_alpha, p_values = choose_alpha(val_translations, val_tok, tgt, cfg.alpha_significance)
    for a, p in p_values.items():
        tuning[a]["p_vs_first"] = round(p, 3)
    print(f"[4/7] α {best_alpha} for test ({alpha_reason(list(tuning), p_values, cfg.alpha_significance)})", flush=True)
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


def _stage_test(cfg: DemoConfig, translator, files: dict[str, Path], hyp_path: Path, src: str, tgt: str,
                results: dict) -> Path:
    """5-6. test_2016 translated into ``hyp_path`` (one line per source line) and scored: the
    published baselines' tokenized BLEU, sacreBLEU and chrF, the paper's compound-split BLEU."""
    from aiayn.evaluate.bleu import score_all
    from aiayn.evaluate.multi30k import multi30k_bleu
    hyps = stages.translate_test(translator, read_text(files[f"raw.test.{src}"]), hyp_path, "test_2016", results)
    ref_raw, ref_tok = read_text(files[f"raw.test.{tgt}"]), read_text(files[f"tok.test.{tgt}"])
    scores = [multi30k_bleu(hyps, ref_tok, tgt), *score_all(hyps, ref_raw, tgt, lowercase=cfg.lowercase)]
    stages.report_test_scores(scores, "test_2016", results)
    return hyp_path
