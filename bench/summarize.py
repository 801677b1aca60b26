"""Collect bench/results/*.json into results/summary.md: tables ready for BENCHMARKS.md and the
speed targets of BENCHMARKS.md, each marked PASS, FAIL or MISSING.

    python bench/summarize.py

Fractions of peak are recomputed here against the current matmul_peak.json (the same
FLOP counts as in each part's JSON; see their "flop_formula").
"""
from __future__ import annotations

import argparse
from pathlib import Path

import benchlib as bl

# The speed targets: (part, ratio key in that part's JSON, what it means).
TARGETS = [
    ("train_base", "aiayn-fp32/hf-fp32", "training fp32 vs HF Marian, base"),
    ("train_small", "aiayn-fp32/hf-fp32", "training fp32 vs HF Marian, small"),
    ("train_base", "aiayn-bf16/aiayn-fp32", "training bf16 vs aiayn fp32, base"),
    ("train_small", "aiayn-bf16/aiayn-fp32", "training bf16 vs aiayn fp32, small"),
    ("translate_base", "aiayn-best-fp32/ct2-best-fp32", "translation fp32 vs CTranslate2 fp32, base"),
    ("translate_small", "aiayn-best-fp32/ct2-best-fp32", "translation fp32 vs CTranslate2 fp32, small"),
    ("translate_base", "aiayn-best-fp32/hf-fp32", "translation fp32 vs HF generate, base"),
    ("translate_small", "aiayn-best-fp32/hf-fp32", "translation fp32 vs HF generate, small"),
    ("translate_base", "aiayn-best-reduced/ct2-best-fp32", "translation reduced precision vs CTranslate2 fp32, base"),
    ("translate_small", "aiayn-best-reduced/ct2-best-fp32", "translation reduced precision vs CTranslate2 fp32, small"),
]
# Results written before aiayn's decoding workers existed compare aiayn-fp32 alone, and those written
# before ct2-fp32-inter existed compare with intra-op CTranslate2 only: the keys tried in order.
OLDER_KEY = {"aiayn-best-fp32/ct2-best-fp32": ("aiayn-fp32/ct2-best-fp32", "aiayn-fp32/ct2-fp32"),
             "aiayn-best-fp32/hf-fp32": ("aiayn-fp32/hf-fp32",),
             "aiayn-best-reduced/ct2-best-fp32": ("aiayn-best-reduced/ct2-fp32",)}


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def machine_section(parts: dict) -> list[str]:
    m = next((p["machine"] for p in parts.values() if p and "machine" in p), None)
    if m is None:
        return ["No results yet: run `bash bench/run_all.sh`."]
    lines = [f"Measured {m['date']} on {m['cpu_model']} ({m['logical_cpus']} logical CPUs, "
             f"{m['cores_per_socket']} cores/socket x {m['sockets']} socket(s), {m['threads_per_core']} thread(s)/core; "
             f"ISA {', '.join(m['isa'])}), Python {m['python']}, torch {m['torch']}, transformers "
             f"{m.get('transformers')}, ctranslate2 {m.get('ctranslate2')}; {m['threads']} threads per system.",
             "Every system runs in its own process; systems are interleaved (A B C A B C ...); numbers are "
             "medians over the measured rounds (n below). Random weights; synthetic token ids."]
    if m.get("isa_held"):
        lines += ["", "**Held to a narrower instruction set than the CPU's**: "
                  + " ".join(f"`{k}={v}`" for k, v in m["isa_held"].items()) + "."]
    sizes = {p.get("size") for p in parts.values() if p and "size" in p}
    threads = {p["machine"]["threads"] for p in parts.values() if p and "machine" in p}
    if "tiny" in sizes:
        lines += ["", "**SMOKE RESULTS (tiny model): a check of the harness, not a measurement.**"]
    if len(threads) > 1:
        lines += ["", f"**Parts were measured with different thread counts: {sorted(threads)}.**"]
    mm = parts.get("matmul_peak")
    if mm:
        rows = [[k, "x".join(map(str, v["shape_mkn"])), f"{v['gflops_median']:.1f}", f"{v['gflops_best']:.1f}"]
                for k, v in mm["cases"].items() if "gflops_median" in v]
        lines += ["", "### Matmul peak (C = A @ B, 2*M*K*N FLOPs)", ""]
        lines += md_table(["case", "M x K x N", "GFLOP/s (median)", "best"], rows)
    return lines


def system_rows(part: dict) -> list[list[str]]:
    rows = []
    for name, r in part["systems"].items():
        if "time" not in r:
            err = (r.get("error") or "failed").strip().splitlines()[-1][:120]
            label = "" if bl.status(r) == "not run" else "FAILED: "
            rows.append([name, label + err.replace("|", "/"), "", "", "", "", ""])
            continue
        peak = bl.peak_gflops(r["peak_dtype"])
        frac = bl.ratio(r["model_gflops_per_s"], peak)
        note = "" if r.get("lengths_ok", True) else " (output lengths differ!)"
        rss = r.get("peak_rss_mb")
        rss_txt = "-" if rss is None else f"{rss:.0f} (+{rss - r.get('rss_before_build_mb', 0):.0f})"
        workers = [w for w in (r.get("info") or {}).get("workers_peak_rss_mb") or [] if w is not None]
        if workers and rss is not None:  # decoding worker processes (aiayn's DecodeConfig.workers) come on top
            rss_txt += " + workers " + " + ".join(f"{w:.0f}" for w in workers)
        rows.append([name, f"{r['tgt_tokens_per_s']:.0f}{note}", f"{r['time']['median']:.3f}", str(r["time"]["n"]),
                     f"{r['model_gflops_per_s']:.1f}", pct(frac), rss_txt])
    return rows


def throughput_section(parts: dict) -> list[str]:
    lines = []
    header = ["system", "target tokens/s", "{} s (median)", "n", "model GFLOP/s", "of peak",
              "peak RSS MB (+ over import)"]
    for kind, what in (("train", "step"), ("translate", "call")):
        for size in ("base", "small"):
            part = parts.get(f"{kind}_{size}")
            if not part:
                continue
            a = part["args"]
            if kind == "train":
                title = (f"### Training, {size}: fwd + bwd + Adam, {a['batch']} x {a['src_len']}/{a['tgt_len']} "
                         f"tokens = {part['tgt_tokens_per_step']} target tokens per step, "
                         f"{part['model_flops_per_step'] / 1e9:.0f} GFLOP per step")
            else:
                title = (f"### Translation, {size}: beam {a['beam']}, {a['batch']} sentences x {a['src_len']} "
                         f"tokens, output forced to {a['out_len']} tokens, "
                         f"{part['model_flops_per_call'] / 1e9:.0f} GFLOP per call")
            lines += ["", title, ""]
            lines += md_table([h.format(what) for h in header], system_rows(part))
            lines += ["", f"FLOPs: {part['flop_formula']}. Fraction of peak: against the 2048^3 matmul median of "
                          f"the system's dtype (bf16 systems against bf16; the int8 systems, aiayn's and CTranslate2's, against fp32)."]
    return lines


def targets_section(parts: dict) -> list[str]:
    rows = []
    for part_name, key, what in TARGETS:
        part = parts.get(part_name)
        ratios = (part or {}).get("ratios", {})
        if key not in ratios:
            key = next((k for k in OLDER_KEY.get(key, ()) if k in ratios), key)
        r = ratios.get(key)
        named = {n for side in key.split("/") for n in bl.BEST_OF.get(side, (side,))}
        if not r or r["ratio"] is None:
            no_bf16 = any(s.get("error") == bl.NO_BF16 for n, s in (part or {}).get("systems", {}).items() if n in named)
            rows.append([what, key, "-", "N/A: this CPU has no bf16 instructions" if no_bf16 else "MISSING"])
            continue
        verdict = "PASS" if r["ratio"] >= r["target"] else "FAIL"
        bad = [n for n, s in part["systems"].items() if n in named and not s.get("lengths_ok", True)]
        if bad:
            verdict += " (invalid: output lengths differ)"
        shown = f"{r['ratio']:.2f}"
        if float(shown) == r["target"] and r["ratio"] != r["target"]:  # 1.996 would show as 2.00 and FAIL
            shown = f"{r['ratio']:.3f}"
        rows.append([what, key, f"{shown}x (target >= {r['target']}x)", verdict])
    return ["", "### Targets", ""] + md_table(["target", "ratio of tokens/s", "measured", "verdict"], rows)


def attention_section(part: dict | None) -> list[str]:
    if not part:
        return []
    c = part["model_config"]
    rows = [[r["n"], r["B"], f"{r['flops_projections'] / 1e9:.2f}", f"{r['flops_core'] / 1e9:.2f}",
             f"{r['flops_ffn'] / 1e9:.2f}", f"{1e3 * r['t_attention_layer_s']:.1f}", f"{1e3 * r['t_core_s']:.1f}",
             f"{1e3 * r['t_ffn_s']:.1f}", f"{r['t_attention_layer_s'] / r['t_ffn_s']:.2f}"] for r in part["rows"]]
    x = {k: "not reached" if v is None else v for k, v in part["crossover_n"].items()}
    return ["", f"### §4 Table 1: self-attention layer vs FFN (d_model {c['d_model']}, h {c['n_heads']}, d_k "
                f"{c['d_k']}, d_ff {c['d_ff']}; B x n = {part['args']['tokens']} tokens, forward, fp32)", ""] + \
        md_table(["n", "B", "GFLOP proj", "GFLOP core", "GFLOP FFN", "attention ms", "core ms", "FFN ms",
                  "attention / FFN time"], rows) + \
        ["", f"FLOPs: {part['flop_formula']}.",
         f"Attention core >= projections: FLOPs from n = {x['flops_core_ge_projections']}, time from n = "
         f"{x['time_core_ge_projections']}; core >= FFN: FLOPs from n = {x['flops_core_ge_ffn']}, time from n = "
         f"{x['time_core_ge_ffn']}; whole attention layer >= 2x FFN time from n = "
         f"{x['time_attention_layer_ge_2x_ffn']}."]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="default: <results>/summary.md")
    args = ap.parse_args(argv)
    names = ["matmul_peak", "train_base", "train_small", "translate_base", "translate_small", "attention_sweep"]
    parts = {n: bl.read_result(n) for n in names}
    lines = ["## Speed", ""] + machine_section(parts) + throughput_section(parts) + \
        targets_section(parts) + attention_section(parts["attention_sweep"])
    out = Path(args.out) if args.out else bl.results_dir() / "summary.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\n[wrote {out}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
