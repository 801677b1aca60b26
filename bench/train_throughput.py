"""Training throughput: target tokens/s of forward + backward + Adam step (§5), aiayn vs Marian.

    python bench/train_throughput.py --size base     # Table 3 base, vocabulary 8000
    python bench/train_throughput.py --size small    # the "multi30k" preset (d_model 256, 3+3 layers)

Systems, each in its own process, run interleaved (A B C A B C ...), 2 threads each:
  aiayn-fp32   aiayn.Transformer, float32
  aiayn-bf16   the same under torch.autocast("cpu", bfloat16); the attention core stays in
               float32 (train.attn_fp32, on by default)
  hf-fp32      transformers.MarianMTModel with the same shapes, random weights, float32
Every step: one synthetic batch of --batch sentences, --src-len source and --tgt-len target
tokens each (default 128 x 32 = 4,096 target tokens, no padding), label-smoothed loss
(eps_ls = 0.1; aiayn's ``label_smoothed_loss``, HF with F.cross_entropy(label_smoothing)),
Adam(0.9, 0.98, 1e-9) (aiayn: fused, as its training loop; HF: PyTorch's per-tensor loop, as
the reference rival measurements did), zero_grad(set_to_none).

Model FLOPs per step: ``aiayn.train.flops.train_flops`` = 3 x forward matmul FLOPs (formula
in src/aiayn/train/flops.py), the same for every system since the shapes are the same;
fraction of peak = (FLOPs / median step time) / matmul_peak.json's 2048^3 median of the
system's dtype. Writes results/train_<size>.json.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import benchlib as bl

DEFAULTS = {  # per size: measured rounds, warm-up rounds, minimum rounds, measuring budget (s)
    "base": {"reps": 5, "warmup": 1, "min_reps": 3, "budget_s": 200.0},
    "small": {"reps": 8, "warmup": 2, "min_reps": 3, "budget_s": 80.0},
    "tiny": {"reps": 2, "warmup": 1, "min_reps": 1, "budget_s": 10.0},
    "main": {"reps": 10, "warmup": 2, "min_reps": 3, "budget_s": 60.0},
}
EPS_LS = 0.1


def _batch(B: int, S: int, T: int, low: int, high: int, eos: int, start: int):
    """Random ids in [low, high); sentences end in EOS; tgt_in = [start] + y[:-1]."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(low, high, (B, S), generator=g)
    src[:, -1] = eos
    y = torch.randint(low, high, (B, T), generator=g)
    y[:, -1] = eos
    tgt_in = torch.cat([torch.full((B, 1), start), y[:, :-1]], dim=1)
    return src, tgt_in, y


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    """§5.3's Adam, per-tensor as the rivals' script."""
    return torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)


def build_aiayn(size: str, precision: str, B: int, S: int, T: int):
    """One step of ``aiayn train`` on the CPU: the loop's own ``TrainStep`` (C kernels for the loss and
    the attention, fused Adam, the linear maps' rows padded as the loop pads them: ``TrainStep.for_run``),
    stepped as the loop steps it."""
    import aiayn
    from aiayn.data.batching import Batch
    from aiayn.checkpoint.run import Learner
    from aiayn.train.config import RunConfig, TrainConfig
    from aiayn.train.loop import schedule_of
    from aiayn.train.step import TrainStep
    from aiayn.train.objective import make_optimizer
    from aiayn.train.runtime import Dist, Place

    cfg = bl.model_config(size)
    t, cpu = TrainConfig(precision=precision, eps_ls=EPS_LS), torch.device("cpu")
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).train()
    opt = make_optimizer(model.parameters(), 1e-4, (0.9, 0.98), 1e-9, fused=True)
    stepper = TrainStep.for_run(t, Learner(model, opt), Place(Dist(), cpu, precision), schedule_of(RunConfig(cfg, t)))
    src, tgt_in, tgt_out = _batch(B, S, T, 4, cfg.vocab_size, cfg.eos_id, cfg.bos_id)
    batch = Batch(src, tgt_in, tgt_out, n_src_tokens=B * S, n_tgt_tokens=B * T, src_padded=False)

    def step() -> dict:
        s = stepper.step([batch], 1)
        return {"loss": s.loss / s.tokens, "precision": precision}

    return step


def build_hf(size: str, B: int, S: int, T: int):
    """One MarianMTModel training step, as the reference rival measurements did."""
    from marian import MARIAN_EOS, build_marian, marian_pad

    cfg = bl.model_config(size)
    model = build_marian(cfg).train()
    opt = _adam(model)
    pad = marian_pad(cfg)
    src, tgt_in, y = _batch(B, S, T, 2, pad, MARIAN_EOS, pad)
    enc_mask, dec_mask = torch.ones_like(src), torch.ones_like(tgt_in)
    attn = getattr(model.config, "_attn_implementation", None)

    def step() -> dict:
        logits = model(input_ids=src, attention_mask=enc_mask, decoder_input_ids=tgt_in,
                       decoder_attention_mask=dec_mask, use_cache=False).logits  # (B,T,V)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1),
                               ignore_index=pad, label_smoothing=EPS_LS)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"loss": loss.item(), "attn_implementation": attn}

    return step


def systems(args: argparse.Namespace) -> list[bl.System]:
    shape = {"B": args.batch, "S": args.src_len, "T": args.tgt_len}
    return [
        bl.System("aiayn-fp32", build_aiayn, {"size": args.size, "precision": "fp32", **shape}, **bl.AIAYN_PROCESS),
        bl.System("aiayn-bf16", build_aiayn, {"size": args.size, "precision": "bf16", **shape}, **bl.AIAYN_PROCESS),
        bl.System("hf-fp32", build_hf, {"size": args.size, **shape}),
        # the rival given aiayn's process settings too (allocator, denormals): how much of the ratio they are
        bl.System("hf-fp32-reuse", build_hf, {"size": args.size, **shape}, **bl.AIAYN_PROCESS),
    ]


DTYPE = {"aiayn-fp32": "fp32", "aiayn-bf16": "bf16", "hf-fp32": "fp32", "hf-fp32-reuse": "fp32"}
# (numerator, denominator, target or None): the training targets of BENCHMARKS.md §2, and two more
# (bf16 vs HF; fp32 vs HF given aiayn's process settings).
RATIOS = [("aiayn-fp32", "hf-fp32", 1.1), ("aiayn-bf16", "aiayn-fp32", 1.8), ("aiayn-bf16", "hf-fp32", None),
          ("aiayn-fp32", "hf-fp32-reuse", None)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(bl.SIZES), default="base")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--src-len", type=int, default=32)
    ap.add_argument("--tgt-len", type=int, default=32)
    bl.add_common_args(ap)
    args = ap.parse_args(argv)
    bl.fill_defaults(args, DEFAULTS[args.size])
    bl.setup_logging()
    from aiayn.train.flops import train_flops

    cfg = bl.model_config(args.size)
    machine = bl.machine_info(args.threads)
    todo, skipped = bl.without_emulated_bf16(bl.pick(systems(args), args.systems))
    res = bl.measure_interleaved(todo, threads=args.threads, warmup=args.warmup,
                                 reps=args.reps, min_reps=args.min_reps, budget_s=args.budget_s,
                                 timeout_s=args.timeout_s)
    res.update(skipped)
    tokens = args.batch * args.tgt_len
    flops = train_flops(cfg, args.batch, args.src_len, args.tgt_len)
    rows = []
    for name, r in res.items():
        if "time" not in r:
            rows.append([name, bl.status(r), "-", "-", "-", "-"])
            continue
        med = r["time"]["median"]
        r["tgt_tokens_per_s"] = tokens / med
        r["model_gflops_per_s"] = flops / med / 1e9
        peak = bl.peak_gflops(DTYPE[name])
        r["peak_dtype"], r["peak_gflops"] = DTYPE[name], peak
        r["fraction_of_peak"] = bl.ratio(r["model_gflops_per_s"], peak)
        r["fraction_of_fp32_peak"] = bl.ratio(r["model_gflops_per_s"], bl.peak_gflops("fp32"))
        rows.append([name, f"{r['tgt_tokens_per_s']:.0f}", f"{med:.3f}", f"{r['model_gflops_per_s']:.1f}",
                     bl.fmt(r["fraction_of_peak"] and 100 * r["fraction_of_peak"], ".1f"),
                     bl.fmt(r.get("peak_rss_mb"), ".0f")])
    ratios = {}
    for a, b, target in RATIOS:
        x = bl.ratio(res.get(a, {}).get("tgt_tokens_per_s"), res.get(b, {}).get("tgt_tokens_per_s"))
        ratios[f"{a}/{b}"] = {"ratio": x, "target": target,
                              "pass": None if x is None or target is None else x >= target}
    print(f"\ntraining, size {args.size}: {args.batch} x {args.src_len}/{args.tgt_len} tokens, "
          f"{flops / 1e9:.1f} GFLOP per step, {args.threads} threads")
    bl.print_table(["system", "tgt tok/s", "step s (median)", "GFLOP/s", "% of peak", "peak RSS MB"], rows)
    for key, v in ratios.items():
        print(f"{key}: {bl.fmt(v['ratio'], '.2f')}x" + (f" (target >= {v['target']}x)" if v["target"] else ""))
    bl.write_result(args.name or f"train_{args.size}", {
        "bench": "train_throughput", "size": args.size, "model_config": cfg.__dict__, "machine": machine,
        "args": vars(args), "tgt_tokens_per_step": tokens, "model_flops_per_step": flops,
        "flop_formula": "aiayn.train.flops.train_flops = 3 x forward_flops(cfg, B, S, T) (matmuls only; "
                        "causal attention counted in full)",
        "systems": res, "ratios": ratios})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
