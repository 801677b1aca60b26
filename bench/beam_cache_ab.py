"""A/B of two beam-search speed choices on the translation benchmark's shape (aiayn only):
shared beam slots vs the copying cache (``CachedDecoder(share_slots=...)``), and denormals
flushed vs kept (``aiayn.host.denormals``).

    python bench/beam_cache_ab.py [--size base] [--mode fp32] [--reps 3]

Same call as translate_throughput.py's aiayn systems (64 sentences x 20 tokens, beam 4,
output forced to 69 tokens, random weights); four systems, each in its own process,
interleaved, 2 threads. Writes results/beam_cache_ab_<size>_<mode>.json.
"""
from __future__ import annotations

import argparse

import benchlib as bl
from translate_throughput import build_aiayn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(bl.SIZES), default="base")
    ap.add_argument("--mode", choices=["fp32", "bf16", "bf16w"], default="fp32")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=69)
    bl.add_common_args(ap)
    args = ap.parse_args(argv)
    bl.fill_defaults(args, {"reps": 3, "warmup": 1, "min_reps": 3, "budget_s": 1e9})
    bl.setup_logging()
    shape = {"size": args.size, "mode": args.mode, "B": args.batch, "S": 20, "L": args.out_len, "K": 4}
    keep = {**bl.AIAYN_PROCESS, "denormals": "keep"}
    systems = [bl.System("shared-flush", build_aiayn, shape, **bl.AIAYN_PROCESS),
               bl.System("copy-flush", build_aiayn, {**shape, "share_slots": False}, **bl.AIAYN_PROCESS),
               bl.System("shared-keep", build_aiayn, shape, **keep),
               bl.System("copy-keep", build_aiayn, {**shape, "share_slots": False}, **keep)]
    res = bl.measure_interleaved(bl.pick(systems, args.systems), threads=args.threads, warmup=args.warmup,
                                 reps=args.reps, min_reps=args.min_reps, budget_s=args.budget_s,
                                 timeout_s=args.timeout_s)
    rows = []
    for name, r in res.items():
        if "time" not in r:
            rows.append([name, "FAILED", "-", "-"])
            continue
        r["tgt_tokens_per_s"] = args.batch * args.out_len / r["time"]["median"]
        rows.append([name, f"{r['tgt_tokens_per_s']:.0f}", f"{r['time']['median']:.3f}",
                     f"{r.get('peak_rss_mb', 0):.0f}"])
    bl.print_table(["system", "target tokens/s", "call s (median)", "peak RSS MB"], rows)
    tps = {k: v.get("tgt_tokens_per_s") for k, v in res.items()}
    ratios = {"shared/copy (flush)": bl.ratio(tps.get("shared-flush"), tps.get("copy-flush")),
              "flush/keep (shared)": bl.ratio(tps.get("shared-flush"), tps.get("shared-keep"))}
    for k, v in ratios.items():
        print(f"{k}: {bl.fmt(v, '.2f')}x")
    bl.write_result(args.name or f"beam_cache_ab_{args.size}_{args.mode}",
                    {"machine": bl.machine_info(args.threads), "shape": shape, "systems": res, "ratios": ratios})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
