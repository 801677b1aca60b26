"""``aiayn demo --train SRC TGT --valid SRC TGT [--test SRC TGT]``: the Multi30k demo's steps
(``aiayn.demo.multi30k``) on your own parallel text, from raw files to a scored, averaged model
(docs/own-data.md).

Steps (1-3 skipped when their output already exists, so a re-run resumes; 4-7 decode again, with the
decoding options given):
  1. prepare   the demo's shared BPE (--vocab-size 8000, character coverage 1.0)      OUT/data
  2. train     the demo's recipe, 4,096 + 4,096-token steps on any process count      OUT/run
  3. average   the last --average-last checkpoints (§6.1)                              OUT/model.pt
  4. tune α    length penalty chosen on --valid by sacreBLEU (never on test)
  5. translate --test with beam search                                                 OUT/test.hyp
  6. score     sacreBLEU and chrF on the raw text (Multi30k's tokenized BLEU is Multi30k's alone)
  7. examples  the first validation sentences translated, the first one's attention drawn OUT/plots
Languages come from the files' suffixes (train.en -> en) or --src-lang / --tgt-lang; they name
the output folder (runs/demo-SRC-TGT) and the direction in results.json.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from aiayn.data.corpora import check_lang
from aiayn.data.textio import check_readable, file_suffix, read_lines, suffix_language
from aiayn.demo import stages
from aiayn.errors import UserError

# all it writes in --out
OWN_FILES = ("subset", "data", "inputs.json", "sizing.json", "run", "model.pt", "test.hyp", "plots", "results.json")
SPLITS = ("train", "valid", "test")
N_EXAMPLES = 3  # validation sentences translated at the end; the first one's attention is drawn


def lang_of(path: str, flag: str) -> str:
    """The language a file's suffix names (train.en, train.en.gz -> en); an error asking for
    ``flag`` when it names none."""
    lang = suffix_language(path)
    if lang is None:
        raise UserError(f"{path}: cannot tell the language from the file name (no suffix such as .en or .de); "
                        f"give {flag}")
    return lang


def check_order(pair, flag: str, src: str, tgt: str) -> None:
    """A --valid or --test ``pair`` (``flag``) in the run's direction ``src``-``tgt``: an error where a
    file's suffix names the other side's language (dev.de dev.en for en-de, dev.en twice), which would
    choose α and score on text the other way round."""
    if src.lower() == tgt.lower():
        return
    for path, side, other in zip(pair, ("source", "target"), (tgt, src)):
        if file_suffix(path).lower() == other.lower():
            raise UserError(f"{flag} {pair[0]} {pair[1]}: the {side} file's suffix says {file_suffix(path)!r}, but "
                            f"the run is {src}-{tgt} (--train's source, then target); give {flag} SOURCE TARGET")


def own_files(cfg) -> tuple[dict[str, Path], str, str]:
    """The files of ``cfg``'s --train, --valid and --test by "raw.SPLIT.SIDE" (SIDE src or tgt),
    each checked to exist, and the source and target languages."""
    if cfg.data_root:
        raise UserError("--data-root is where Multi30k is; with --train your own files are the data: drop one of them")
    if not cfg.valid:
        raise UserError("--train needs --valid SOURCE TARGET: the length penalty is chosen on it")
    files = {}
    for split in SPLITS:
        pair = getattr(cfg, split)
        if pair and len(pair) != 2:
            raise UserError(f"--{split} takes two files, SOURCE and TARGET; got {len(pair)}")
        for side, what, path in zip(("src", "tgt"), ("source", "target"), pair):
            check_readable(Path(path), f"--{split} {what}")
            files[f"raw.{split}.{side}"] = Path(path)
    src = cfg.src_lang or lang_of(cfg.train[0], "--src-lang")
    tgt = cfg.tgt_lang or lang_of(cfg.train[1], "--tgt-lang")
    check_lang(src, "--src-lang")
    check_lang(tgt, "--tgt-lang")
    if src == tgt and not (cfg.src_lang and cfg.tgt_lang):
        raise UserError(f"{cfg.train[0]} and {cfg.train[1]}: both files' suffixes say {src!r}; "
                        f"give --src-lang and --tgt-lang")
    for split in SPLITS[1:]:
        if getattr(cfg, split):
            check_order(getattr(cfg, split), f"--{split}", src, tgt)
    return files, src, tgt


def _lines(path: Path) -> list[str]:
    """A split's lines as ``aiayn prepare`` read them (plain or gzip, stripped)."""
    return list(read_lines(path))


def run_own_demo(cfg) -> dict:
    """The demo on ``cfg.train``/``valid``/``test`` (a ``DemoConfig``): prepare, train, average,
    choose α on validation, translate and score test, translate examples and plot their attention.
    On a re-run prepare, train and average are skipped where they finished; the decoding stages run
    again, with the options given. ``out/results.json`` holds what each measured."""
    files, src, tgt = own_files(cfg)
    stages.check_sets(cfg)  # before any work
    stages.say_quick(cfg)
    out = stages.claim_out(cfg, f"runs/demo-{src}-{tgt}", OWN_FILES, files)
    given, files = files, stages.subset(files, out / "subset", cfg)
    if not any(_lines(files["raw.valid.src"])):
        raise UserError(f"{cfg.valid[0]}: no non-empty line{' among the first --eval-lines' if cfg.eval_lines else ''}"
                        f"; the length penalty is chosen, and examples are taken, on --valid")
    t_all = time.monotonic()
    results: dict = {"direction": f"{src}-{tgt}", "config": dataclasses.asdict(cfg)}
    data_dir = stages.stage_prepare(cfg, files, out / "data", ("src", "tgt"), results, given)
    run_dir = out / "run"
    member_dirs = stages.stage_train(cfg, data_dir, run_dir, results)
    stages.forget_results(out)  # the stages below rewrite what it describes
    model_path = stages.stage_average(cfg, member_dirs, run_dir, out / "model.pt", results)

    from aiayn.decode.translator import Translator
    translator = Translator.from_checkpoint(model_path, device=cfg.device)
    val_src = _stage_alpha(cfg, translator, files, tgt, results)
    stages.record_alpha(model_path, results["alpha"])
    hyp_path = _stage_test(cfg, translator, files, out / "test.hyp", results) if cfg.test else None
    examples = [line for line in val_src if line][:N_EXAMPLES]
    plots_dir = stages.stage_examples(translator, examples, out / "plots", results)
    results["seconds_total"] = round(time.monotonic() - t_all, 1)
    stages.write_results(cfg, out, results)
    print(f"model: {model_path}")
    if hyp_path is not None:
        print(f"translations: {hyp_path}")
    print(f"plots: {plots_dir}")
    return results


def _stage_alpha(cfg, translator, files: dict[str, Path], tgt: str, results: dict) -> list[str]:
    """4. The length penalty α chosen on the validation set by sacreBLEU (-lc with --lowercase), with
    the Multi30k demo's rule (``choose_alpha``: §6.1's 0.6 unless another α wins a paired bootstrap
    over 13a tokens, sacreBLEU's); set on ``translator``. Returns the validation sources."""
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    from aiayn.decode.config import DecodeConfig
    from aiayn.evaluate.alpha import ValidationSet, choose_alpha, p_values_text, tune_alpha
    from aiayn.evaluate.bleu import chrf, sacre_bleu
    val_src, val_ref = _lines(files["raw.valid.src"]), _lines(files["raw.valid.tgt"])
    tok_13a = Tokenizer13a()

    def tokenize(lines: list[str]) -> list[str]:  # as sacreBLEU scores: 13a tokens, lowercased with --lowercase
        return [tok_13a(line.lower() if cfg.lowercase else line) for line in lines]

    tuning, translations = tune_alpha(
        translator, ValidationSet(val_src, val_ref, tgt), cfg.alphas, cfg.beam_size, key="valid_sacrebleu",
        score=lambda hyps: sacre_bleu(hyps, val_ref, lowercase=cfg.lowercase),
        report=lambda a, r: print(f"[4/7] valid α={a}: sacreBLEU{' -lc' if cfg.lowercase else ''} "
                                  f"{r['valid_sacrebleu']:.2f} (length ratio {r['length_ratio']:.3f})", flush=True))
    best_alpha, p_values = choose_alpha(translations, tokenize(val_ref), tgt, cfg.alpha_significance, tokenize=tokenize)
    for a, p in p_values.items():
        tuning[a]["p_vs_first"] = round(p, 3)
    print(f"[4/7] α {best_alpha} for test" + (f" (p against α {next(iter(tuning))}: {p_values_text(p_values)})"
                                               if p_values else ""), flush=True)
    results["alpha_tuning"] = {str(k): v for k, v in tuning.items()}
    results["alpha"] = best_alpha
    translator.cfg = DecodeConfig(beam_size=cfg.beam_size, alpha=best_alpha)
    hyps = translations[best_alpha]  # translated while tuning; the same cfg gives the same lines
    bleu = sacre_bleu(hyps, val_ref)
    results["valid"] = {"sacrebleu": round(bleu.score, 2), "length_ratio": round(bleu.length_ratio, 3),
                        "chrf": round(chrf(hyps, val_ref).score, 2)}
    if cfg.lowercase:
        results["valid"]["sacrebleu_lc"] = round(sacre_bleu(hyps, val_ref, lowercase=True).score, 2)
    return val_src


def _stage_test(cfg, translator, files: dict[str, Path], hyp_path: Path, results: dict) -> Path:
    """5-6. The test split translated into ``hyp_path`` (one line per source line) and scored on the
    raw text: sacreBLEU (and -lc with --lowercase) and chrF."""
    from aiayn.evaluate.bleu import chrf, sacre_bleu
    ref = _lines(files["raw.test.tgt"])
    hyps = stages.translate_test(translator, _lines(files["raw.test.src"]), hyp_path, "test", results)
    scores = [sacre_bleu(hyps, ref), *([sacre_bleu(hyps, ref, lowercase=True)] if cfg.lowercase else []),
              chrf(hyps, ref)]
    stages.report_test_scores(scores, "test", results)
    return hyp_path
