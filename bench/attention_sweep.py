"""§4, Table 1: cost of a self-attention layer vs the position-wise FFN as the length n grows.

    python bench/attention_sweep.py [--preset base --tokens 4096 --n 16,32,...,4096]

Table 1 puts self-attention at O(n^2 * d) per layer against O(n * d^2) for the position-wise
parts. We time aiayn's own modules in float32, forward only (torch.inference_mode), on
batches of B = tokens / n sequences of length n, so the per-token work of the projections
and the FFN stays constant while the attention core grows with n:
  attention layer  MultiHeadAttention.project_qkv + attend (fused Q/K/V projection, Eq. 1
                   through scaled_dot_product_attention, W^O)
  attention core   attention_fast(q, k, v) alone (QK^T, softmax, .V)
  FFN              FeedForward (Eq. 2)
FLOPs: aiayn.train.flops.self_attention_flops(n, ...) x B (projections 2*n*(D*H*(2K+Dv) + H*Dv*D),
core 2*H*n^2*(K+Dv)); FFN 4*n*D*d_ff per sequence. The FLOP crossovers are n = D*H*(2K+Dv) +
H*Dv*D over H*(K+Dv) (core = projections; 2*D = 1024 for base) and n = 2*D*d_ff / (H*(K+Dv))
(core = FFN; 2048 for base). Writes results/attention_sweep.json.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

import benchlib as bl

log = logging.getLogger("bench.attention")


def _median_time(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def first_n(rows: list[dict], key_a: str, key_b: str) -> int | None:
    """Smallest n with rows[key_a] >= rows[key_b]."""
    return next((r["n"] for r in rows if r[key_a] >= r[key_b]), None)


@torch.inference_mode()
def sweep(cfg, ns: list[int], tokens: int, warmup: int, reps: int) -> list[dict]:
    from aiayn.model.attention import MultiHeadAttention, attention_fast
    from aiayn.train.flops import self_attention_flops
    from aiayn.model.layers import FeedForward

    D, H, K, Dv, F = cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.d_ff
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model=D, n_heads=H, d_k=K, d_v=Dv, p_drop_attn=0.0, self_attention=True).eval()
    ffn = FeedForward(D, F, 0.0).eval()
    rows = []
    for n in ns:
        B = max(1, tokens // n)
        x = torch.randn(B, n, D)  # (B,n,D)
        q, k, v = mha.project_qkv(x)  # (B,H,n,K)
        t_layer = _median_time(lambda: mha.attend(*mha.project_qkv(x), None), warmup, reps)
        t_core = _median_time(lambda: attention_fast(q, k, v, None, False), warmup, reps)
        t_ffn = _median_time(lambda: ffn(x), warmup, reps)
        fl = {key: B * val for key, val in self_attention_flops(n, D, H, K, Dv).items()}
        row = {"n": n, "B": B, "flops_projections": fl["projections"], "flops_core": fl["attention_core"],
               "flops_ffn": B * n * 4 * D * F, "t_attention_layer_s": t_layer, "t_core_s": t_core,
               "t_projections_s": max(t_layer - t_core, 0.0), "t_ffn_s": t_ffn}
        row["flops_attention_layer"] = fl["projections"] + fl["attention_core"]
        rows.append(row)
        log.info("n=%d B=%d attention %.2f ms (core %.2f) FFN %.2f ms", n, B, 1e3 * t_layer, 1e3 * t_core,
                 1e3 * t_ffn)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="base", help="aiayn preset giving d_model, heads, d_k, d_v, d_ff")
    ap.add_argument("--tokens", type=int, default=4096, help="B * n per measurement")
    ap.add_argument("--n", default="16,32,64,128,256,512,1024,2048,4096", help="sequence lengths")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=bl.DEFAULT_THREADS)
    args = ap.parse_args(argv)
    bl.setup_logging()
    torch.set_num_threads(args.threads)
    import aiayn

    cfg = aiayn.get_preset(args.preset)
    machine = bl.machine_info(args.threads)
    rows = sweep(cfg, [int(n) for n in args.n.split(",")], args.tokens, args.warmup, args.reps)
    peak = bl.peak_gflops("fp32")
    table = []
    for r in rows:
        r["gflops_per_s_attention_layer"] = r["flops_attention_layer"] / r["t_attention_layer_s"] / 1e9
        r["gflops_per_s_ffn"] = r["flops_ffn"] / r["t_ffn_s"] / 1e9
        table.append([r["n"], r["B"], f"{r['flops_projections'] / 1e9:.2f}", f"{r['flops_core'] / 1e9:.2f}",
                      f"{r['flops_ffn'] / 1e9:.2f}", f"{1e3 * r['t_attention_layer_s']:.1f}",
                      f"{1e3 * r['t_core_s']:.1f}", f"{1e3 * r['t_ffn_s']:.1f}",
                      f"{r['t_attention_layer_s'] / r['t_ffn_s']:.2f}"])
    crossover = {
        "flops_core_ge_projections": first_n(rows, "flops_core", "flops_projections"),
        "flops_core_ge_ffn": first_n(rows, "flops_core", "flops_ffn"),
        "time_core_ge_projections": first_n(rows, "t_core_s", "t_projections_s"),
        "time_core_ge_ffn": first_n(rows, "t_core_s", "t_ffn_s"),
        "time_attention_layer_ge_2x_ffn": next((r["n"] for r in rows if r["t_attention_layer_s"] >= 2 * r["t_ffn_s"]),
                                               None),
    }
    print(f"\nself-attention vs FFN, preset {args.preset} (D={cfg.d_model}, H={cfg.n_heads}, d_k={cfg.d_k}, "
          f"d_ff={cfg.d_ff}), B*n = {args.tokens} tokens, {args.threads} threads, forward fp32")
    bl.print_table(["n", "B", "GF proj", "GF core", "GF FFN", "attn ms", "core ms", "FFN ms", "attn/FFN"], table)
    print("first n where: " + ", ".join(f"{k} = {v}" for k, v in crossover.items()))
    bl.write_result("attention_sweep", {
        "bench": "attention_sweep", "preset": args.preset, "model_config": cfg.__dict__, "machine": machine,
        "args": vars(args), "peak_fp32_gflops": peak,
        "flop_formula": "self_attention_flops(n, D, H, K, Dv) x B: projections 2*n*(D*H*(2K+Dv) + H*Dv*D), "
                        "core 2*H*n^2*(K+Dv); FFN 4*n*D*d_ff per sequence",
        "rows": rows, "crossover_n": crossover, "peak_rss_mb": bl.peak_rss_mb()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
