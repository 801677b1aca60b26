"""An imported Marian model: aiayn's CPU decoding of it against transformers' ``generate``.

    python bench/marian_import.py --checkpoint runs/demo/model.pt [--lines 1000] [--threads 2]

A trained aiayn checkpoint is written as a Hugging Face MarianMTModel directory (``aiayn export
--format hf``), and that directory is read back (``aiayn import --format hf``) as OPUS-MT models
are: so the model is real (it translates), and HF runs the very Marian directory aiayn imported.
Both translate the first --lines sentences of Multi30k test_2016 (its source language is the
checkpoint's; ``--data-root`` as the demo's) on --threads CPU threads, in batches of --batch
sentences:

  greedy   HF generate(num_beams=1) and aiayn beam 1: the outputs must agree token for token
           (the count that do not is reported and makes the run fail)
  beam 4   HF generate(num_beams=4, length_penalty=0) and aiayn beam 4 at alpha = 0: the same
           search, both scoring hypotheses by their summed log-probability

Each system's wall time is the median of --reps interleaved runs over all lines (a warm-up run
first); tokens/s count the output tokens of aiayn's translations. Writes
results/marian_import.json (or $BENCH_RESULTS).
"""
from __future__ import annotations

import argparse
import atexit
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import benchlib as bl

log = logging.getLogger("bench.marian_import")


def aiayn_cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "aiayn.cli", *args],
                   check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a trained aiayn checkpoint (e.g. the demo's model.pt)")
    ap.add_argument("--data-root", default="", help="folder holding multi30k/ (default: the demo's search order)")
    ap.add_argument("--src-lang", default="en")
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    bl.setup_logging()
    sets = bl.multi30k_eval_sets(args.src_lang, args.data_root, args.threads)
    lines = sets["test_src"][: args.lines]

    from transformers import MarianMTModel, MarianTokenizer

    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.loading import load_model_for_inference
    from aiayn.decode.translator import Translator

    work = Path(tempfile.mkdtemp(prefix="marian-import-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    hf_dir, imported = work / "hf", work / "imported.pt"
    aiayn_cli("export", "--format", "hf", "--checkpoint", args.checkpoint, "--out", str(hf_dir))
    aiayn_cli("import", "--format", "hf", str(hf_dir), "--out", str(imported))

    hf = MarianMTModel.from_pretrained(hf_dir).eval()
    tok = MarianTokenizer.from_pretrained(hf_dir)
    model, src_tok, tgt_tok = load_model_for_inference(str(imported), "cpu")
    batches = [lines[i:i + args.batch] for i in range(0, len(lines), args.batch)]
    max_len_b = 50  # §6.1: |x| + 50, for both

    def run_hf(beam: int) -> list[str]:
        out = []
        with torch.inference_mode():
            for b in batches:
                enc = tok(b, return_tensors="pt", padding=True)
                gen = hf.generate(**enc, num_beams=beam, do_sample=False, length_penalty=0.0,
                                  max_new_tokens=int(enc["attention_mask"].sum(1).max()) + max_len_b,
                                  early_stopping=True)
                out += tok.batch_decode(gen, skip_special_tokens=True)
        return out

    def run_aiayn(beam: int) -> tuple[list[str], int]:
        tr = Translator(model, src_tok, tgt_tok, DecodeConfig(beam_size=beam, alpha=0.0, max_len_b=max_len_b,
                                                              batch_tokens=args.batch * 32))
        hyps = tr.translate_ids(tr.encode(lines))
        return [tgt_tok.decode(h[0].tokens) if h else "" for h in hyps], sum(len(h[0].tokens) for h in hyps if h)

    results = {"machine": bl.machine_info(args.threads), "checkpoint": args.checkpoint, "lines": len(lines),
               "batch": args.batch, "threads": args.threads, "modes": {}}
    for beam in (1, 4):
        times = {"aiayn": [], "hf": []}
        outs = {}
        for rep in range(args.reps + 1):  # rep 0 warms up
            for name in ("aiayn", "hf"):
                t0 = time.perf_counter()
                outs[name] = run_aiayn(beam) if name == "aiayn" else (run_hf(beam), None)
                if rep:
                    times[name].append(time.perf_counter() - t0)
        a_text, a_tokens = outs["aiayn"]
        h_text = outs["hf"][0]
        differ = [i for i, (a, h) in enumerate(zip(a_text, h_text)) if a != h]
        med = {k: bl.time_stats(v)["median"] for k, v in times.items()}
        results["modes"][f"beam{beam}"] = {
            "aiayn_s": med["aiayn"], "hf_s": med["hf"], "aiayn_over_hf_speed": med["hf"] / med["aiayn"],
            "output_tokens": a_tokens, "aiayn_tokens_per_s": a_tokens / med["aiayn"],
            "hf_tokens_per_s": a_tokens / med["hf"], "outputs_differ": len(differ), "first_differ": differ[:5],
            "times": times}
        log.info("beam %d: aiayn %.2f s, HF generate %.2f s (%.2fx); %d of %d outputs differ", beam,
                 med["aiayn"], med["hf"], med["hf"] / med["aiayn"], len(differ), len(lines))
    bl.write_result("marian_import", results)
    if results["modes"]["beam1"]["outputs_differ"]:
        sys.exit("greedy outputs differ between aiayn and HF generate on the imported model")


if __name__ == "__main__":
    main()
