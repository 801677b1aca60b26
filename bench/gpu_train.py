"""Training throughput on a GPU: aiayn as ``aiayn train`` steps, Hugging Face MarianMTModel and
``torch.nn.Transformer``, on the same batches, in interleaved rounds.

Each system takes the same optimizer step: forward under autocast (bf16, or fp16 with a gradient
scaler), §5.4's label-smoothed loss (aiayn's own ``label_smoothed_loss``, fused with the output
projection where ``train.fused_loss`` says so; the rivals ``F.cross_entropy(label_smoothing=0.1)``),
backward, fused Adam. aiayn's step is the training loop's own step (``aiayn.train.step``:
``forward_backward``, ``grad_norm``, ``step_numbers``, ``update`` queued with its skip flag,
``read_numbers``), so one read of the step's numbers per step, after the update is queued, as in
training; TF32 on as ``train.tf32``. Its variants: ``aiayn-compile`` (``train.compile``),
``aiayn-castonce`` (``train.cast_weights_once``: the linear maps' weights cast in one batched copy a
forward), ``aiayn-cudnn`` (``train.cudnn_attention``: cuDNN's attention allowed), ``aiayn-unfused``
(``train.fused_loss=off``).

Two kinds of batches:
- ``synthetic``: B sentences of S source and T target tokens, no padding (the rivals' usual test);
- ``real`` (with ``--data``, instead): length-bucketed batches of a prepared data directory
  (``aiayn prepare``), cut by aiayn's ``TokenBatchSampler`` at ``--batch-tokens`` source and target
  tokens, padding included; tok/s counts the real target tokens, TFLOP/s the padded shapes the
  device computes.

Rounds: every system runs ``--steps`` steps per round on the same batches, systems in turn,
``--rounds`` rounds (round r takes batches r * steps, r * steps + 1, ... of those cycled through,
after ``--warmup`` untimed steps on the first ones); a round's tokens and FLOPs are those of the
batches it timed, and the median round's rates are reported. Model FLOPs are
``aiayn.train.flops.train_flops``; the fraction of peak is against the device's dense bf16/fp16 peak
(``PEAK_TFLOPS``, by device name) and against an 8192^3 matmul measured in the same run.

    python bench/gpu_train.py --sizes base,big --precisions bf16 --systems aiayn,aiayn-compile,hf-marian
    python bench/gpu_train.py --sizes base --data runs/gpu/data --systems aiayn,aiayn-cudnn,hf-marian
    python bench/gpu_train.py --sizes tiny --precisions bf16 --vocab 500 --batch 8 --len 12   # CPU smoke

Results: ``$BENCH_RESULTS/gpu_train.json`` (default bench/results/), written again after every case,
so a run stopped half way keeps the cases it measured. A system that fails (at its build, its warm-up
or a timed round; ``aiayn-compile`` where compiling failed and the plain model trained) is in the case's
``failed``, the others measured; a failed profile is ``profile_failed``; either makes the exit status 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiayn  # noqa: E402
from aiayn.train.flops import train_flops  # noqa: E402
from aiayn.checkpoint.run import Learner  # noqa: E402
from aiayn.train.config import RunConfig, TrainConfig  # noqa: E402
from aiayn.train.loop import schedule_of  # noqa: E402
from aiayn.train.step import TrainStep  # noqa: E402
from aiayn.train.objective import make_optimizer  # noqa: E402
from aiayn.train.runtime import Dist, Place, use_tf32  # noqa: E402

EPS_LS = 0.1
# Dense bf16/fp16 tensor-core peaks (TFLOP/s, without sparsity), by a word of the device's name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "V100": 125.0,
               "P100": 21.2}


def device_peak(device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """Measured TFLOP/s of an n^3 product in ``dtype`` (the device's practical peak)."""
    if device.type != "cuda":
        return float("nan")
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


# -- batches -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Batches:
    """aiayn batches (pad 0, BOS/EOS of the config) and the same tokens for the rivals."""
    aiayn: list  # aiayn.data.batching.Batch on the device
    real_tokens: list[int]  # non-pad target tokens per batch
    shapes: list[tuple[int, int, int]]  # (B, S, T) per batch


def synthetic_batches(cfg, B: int, S: int, T: int, device) -> Batches:
    from aiayn.data.batching import Batch
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, cfg.vocab_size, (B, S), generator=g)
    src[:, -1] = cfg.eos_id
    y = torch.randint(4, cfg.vocab_size, (B, T), generator=g)
    y[:, -1] = cfg.eos_id
    tin = torch.cat([torch.full((B, 1), cfg.bos_id), y[:, :-1]], 1)
    b = Batch(src.to(device), tin.to(device), y.to(device), B * S, B * T, src_padded=False)
    return Batches([b], [B * T], [(B, S, T)])


def real_batches(cfg, data_dir: str, tokens: int, n: int, device) -> Batches:
    """The first ``n`` batches of epoch 0 of the training split, as ``aiayn train`` cuts them."""
    from aiayn.data.batching import TokenBatchSampler, TokenBounds, collate
    from aiayn.data.dataset import DataDir
    data = DataDir(data_dir).split("train")
    sampler = TokenBatchSampler(data.src_lens + 1, data.tgt_lens + 1, TokenBounds(tokens, tokens), seed=1, shuffle=True)
    out = []
    for idx in sampler:
        out.append(collate([data[i] for i in idx], cfg.pad_id, cfg.bos_id, cfg.eos_id).to(device))
        if len(out) == n:
            break
    return Batches(out, [b.n_tgt_tokens for b in out], [(len(b), b.src.size(1), b.tgt_in.size(1)) for b in out])


# -- the systems -----------------------------------------------------------------------------------

def autocast(device, precision: str):
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def build_aiayn(cfg, batches: Batches, device, precision: str, compile_: bool = False, cudnn: bool = False,
                fused_loss: str = "auto", cast_once: bool = False):
    """A step of ``aiayn train`` (one process, no accumulation) on batch k: the loop's own
    ``TrainStep`` (``TrainStep.for_run``), stepped as the loop steps it."""
    t = TrainConfig(precision=precision, eps_ls=EPS_LS, cudnn_attention=cudnn, fused_loss=fused_loss, compile=compile_,
                    cast_weights_once=cast_once)
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).to(device).train()
    opt = make_optimizer(model.parameters(), 1e-4, (0.9, 0.98), 1e-9, fused=True)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    stepper = TrainStep.for_run(t, Learner(model, opt, scaler), Place(Dist(), device, precision),
                                 schedule_of(RunConfig(cfg, t)))

    def step(k: int):
        stepper.step([batches.aiayn[k]], k + 1)
    step.compiled = lambda: stepper.net is not stepper.plain_net  # False where compiling failed: the plain model
    return step


def _rival_step(model, forward, batches: Batches, device, precision: str):
    """Forward under autocast, F.cross_entropy with label smoothing (mean over real targets),
    backward, fused Adam (with a scaler under fp16)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def step(k: int):
        with autocast(device, precision):
            logits, labels, pad = forward(k)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=pad,
                               label_smoothing=EPS_LS)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def build_marian(cfg, batches: Batches, device, precision: str):
    """HF MarianMTModel (sdpa attention), the same shapes; ids moved to Marian's pad."""
    from marian import build_marian as build, marian_pad
    pad = marian_pad(cfg)
    model = build(cfg).to(device).train()
    model.config._attn_implementation = "sdpa"

    def to_marian(x):
        return torch.where(x == cfg.pad_id, torch.full_like(x, pad), x)
    rows = [(to_marian(b.src), to_marian(b.tgt_in), to_marian(b.tgt_out)) for b in batches.aiayn]
    masks = [((s != pad).long(), (ti != pad).long()) for s, ti, _ in rows]

    def forward(k):
        src, tin, tout = rows[k]
        em, dm = masks[k]
        out = model(input_ids=src, attention_mask=em, decoder_input_ids=tin, decoder_attention_mask=dm,
                    use_cache=False)
        return out.logits, tout, pad
    return _rival_step(model, forward, batches, device, precision)


class TorchTransformer(nn.Module):
    """``nn.Transformer`` with a shared scaled embedding, sinusoidal positions and tied softmax."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.tf = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.decoder_layers, cfg.d_ff, cfg.p_drop,
                                 batch_first=True)
        from aiayn.model.positional import sinusoidal_table
        self.register_buffer("pe", sinusoidal_table(cfg.max_positions, cfg.d_model))

    def forward(self, src, tin):
        scale = self.cfg.d_model ** 0.5
        x = self.emb(src) * scale + self.pe[: src.size(1)]
        t = self.emb(tin) * scale + self.pe[: tin.size(1)]
        causal = nn.Transformer.generate_square_subsequent_mask(tin.size(1), device=src.device)
        src_pad, tgt_pad = src.eq(self.cfg.pad_id), tin.eq(self.cfg.pad_id)
        h = self.tf(x, t, tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=src_pad,
                    tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
        return h @ self.emb.weight.t()


def build_torch(cfg, batches: Batches, device, precision: str):
    torch.manual_seed(0)
    model = TorchTransformer(cfg).to(device).train()

    def forward(k):
        b = batches.aiayn[k]
        return model(b.src, b.tgt_in), b.tgt_out, cfg.pad_id
    return _rival_step(model, forward, batches, device, precision)


SYSTEMS = {"aiayn": build_aiayn,
           "aiayn-compile": lambda *a: build_aiayn(*a, compile_=True),
           "aiayn-castonce": lambda *a: build_aiayn(*a, cast_once=True),
           "aiayn-cudnn": lambda *a: build_aiayn(*a, cudnn=True),
           "aiayn-unfused": lambda *a: build_aiayn(*a, fused_loss="off"),
           "hf-marian": build_marian, "torch-nn": build_torch}


# -- measurement -----------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_rounds(fns: dict, rounds: int, device, calls=lambda r: [()], failed: dict | None = None
                 ) -> dict[str, list[float]]:
    """Interleaved rounds: in round r each function is called with each argument tuple of ``calls(r)``
    (default: once, with none), the functions in turn (so a drift of the machine hits all alike); per
    function the seconds of each round. With ``failed`` (a dict), a function that raises is taken out of
    ``fns`` (its model freed) and out of the times, its error in ``failed``, and the others' rounds go
    on: one system's failure (out of memory, a kernel that fails at a shape first seen) costs no other
    system's measurement. Without it the error propagates."""
    times = {k: [] for k in fns}
    for r in range(rounds):
        for name, fn in list(fns.items()):
            try:
                sync(device)
                t0 = time.perf_counter()
                for args in calls(r):
                    fn(*args)
                sync(device)
            except Exception as exc:
                if failed is None:
                    raise
                failed[name] = f"round {r}: {type(exc).__name__}: {exc}"[:400]
                print(f"{name}: failed in timed round {r}: {failed[name]}", flush=True)
                del fns[name], times[name], fn
                continue
            times[name].append(time.perf_counter() - t0)
    return times


def round_batches(r: int, n_steps: int, n_batches: int, warmup: int = 0) -> list[int]:
    """The batches round r times: the n_steps after the warm-up's and the earlier rounds', cycled."""
    return [(warmup + r * n_steps + i) % n_batches for i in range(n_steps)]


def measure(steps: dict, batches: Batches, cfg, device, n_steps: int, rounds: int, warmup: int,
            failed: dict | None = None) -> dict:
    """Interleaved rounds over the same batches for every system; per system the median round's
    target tok/s and model TFLOP/s, each round's counted over exactly the batches it timed. A system
    that fails in a round is left out, its error in ``failed`` (``timed_rounds``)."""
    n = len(batches.shapes)
    per_round = [round_batches(r, n_steps, n, warmup) for r in range(rounds)]
    real = [sum(batches.real_tokens[k] for k in ks) for ks in per_round]
    padded = [sum(batches.shapes[k][0] * batches.shapes[k][2] for k in ks) for ks in per_round]
    flops = [sum(train_flops(cfg, *batches.shapes[k]) for k in ks) for ks in per_round]
    times = timed_rounds(steps, rounds, device, lambda r: [(k,) for k in per_round[r]], failed)
    out = {}
    for name, ts in times.items():
        out[name] = {"tgt_tok_s": round(statistics.median(x / t for x, t in zip(real, ts))),
                     "padded_tgt_tok_s": round(statistics.median(x / t for x, t in zip(padded, ts))),
                     "tflops": round(statistics.median(f / t for f, t in zip(flops, ts)) / 1e12, 2),
                     "step_ms": round(statistics.median(ts) / n_steps * 1e3, 2),
                     "rounds_s": [round(x, 4) for x in ts], "round_tgt_tokens": real}
    return out


def model_config(size: str, vocab: int):
    """A preset's model (``base``, ``big``, ...) or a recipe's (a path ending in .json), with ``vocab`` pieces."""
    if size.endswith(".json"):
        from aiayn.train.config import load_recipe
        return dataclasses.replace(load_recipe(size).model, vocab_size=vocab)
    return aiayn.get_preset(size, vocab_size=vocab, attn_bias=True)  # as the rival's MarianMT, and as measured


def run_case(size: str, precision: str, batches_kind: str, args, device) -> dict:
    cfg = model_config(size, args.vocab)
    if args.data and batches_kind == "real":
        from aiayn.data.dataset import DataDir
        cfg = dataclasses.replace(cfg, vocab_size=DataDir(args.data).vocab_size)
        batches = real_batches(cfg, args.data, args.batch_tokens, args.real_batches, device)
    else:
        batches = synthetic_batches(cfg, args.batch, args.len, args.len, device)
    steps, failed = {}, {}
    for name in args.systems.split(","):
        try:
            steps[name] = SYSTEMS[name](cfg, batches, device, precision)
            t0 = time.perf_counter()
            for k in range(args.warmup):
                steps[name](k % len(batches.shapes))
            sync(device)
            if name == "aiayn-compile" and not steps[name].compiled():  # the step went on without it (warned)
                raise RuntimeError("torch.compile failed in the warm-up and the step trains the plain model: "
                                   "not a measurement of train.compile")
            print(f"{size:5s} {precision} {batches_kind:9s} {name:14s} warm-up {time.perf_counter() - t0:.1f} s",
                  flush=True)
        except Exception as exc:  # a system that cannot run here is reported, not fatal
            failed[name] = f"{type(exc).__name__}: {exc}"[:400]
            print(f"{size} {precision} {batches_kind} {name}: failed: {failed[name]}", flush=True)
            steps.pop(name, None)
    res = measure(steps, batches, cfg, device, args.steps, args.rounds, args.warmup, failed)
    for name, r in res.items():
        print(f"{size:5s} {precision} {batches_kind:9s} {name:14s} {r['tgt_tok_s']:>10,} tgt tok/s "
              f"{r['tflops']:7.1f} TFLOP/s  step {r['step_ms']:.1f} ms", flush=True)
    if "aiayn" in res and "hf-marian" in res:
        print(f"{size:5s} {precision} {batches_kind:9s} aiayn / hf-marian: "
              f"{res['aiayn']['tgt_tok_s'] / res['hf-marian']['tgt_tok_s']:.2f}x", flush=True)
    for a, b in (("aiayn-compile", "aiayn"), ("aiayn-castonce", "aiayn"), ("aiayn-cudnn", "aiayn"),
                 ("aiayn", "aiayn-unfused")):
        if a in res and b in res:
            print(f"{size:5s} {precision} {batches_kind:9s} {a} / {b}: "
                  f"{res[a]['tgt_tok_s'] / res[b]['tgt_tok_s']:.2f}x", flush=True)
    return {"size": size, "precision": precision, "batches": batches_kind, "shapes": batches.shapes[:5],
            "n_batches": len(batches.shapes), "systems": res, "failed": failed}


def profile_aiayn(size: str, precision: str, args, device) -> None:
    """A torch.profiler table of aiayn's step (3 steps after warm-up), by device time, and the step's
    device time beside its wall time (device time well short of wall time: the host is the bound)."""
    cfg = model_config(size, args.vocab)
    batches = synthetic_batches(cfg, args.batch, args.len, args.len, device)
    step = build_aiayn(cfg, batches, device, precision)
    for _ in range(3):
        step(0)
    sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    for _ in range(3):
        step(0)
    sync(device)
    wall_ms = (time.perf_counter() - t0) / 3 * 1e3
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            step(0)
        sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    events = prof.key_averages()
    print(events.table(sort_by=key, row_limit=25, max_name_column_width=70), flush=True)
    if device.type == "cuda":
        kernels = [e for e in events if "CUDA" in str(e.device_type)]  # the kernels themselves, not the ops
        device_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in kernels)
        print(f"{size} {precision}: device time {device_us / 3e3:.1f} ms a step against {wall_ms:.1f} ms of wall "
              f"time unprofiled ({100 * device_us / 3e3 / wall_ms:.0f}% busy), {cfg.d_model=} {cfg.n_layers=}",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="base,big")
    ap.add_argument("--precisions", default="bf16,fp16")
    ap.add_argument("--systems", default="aiayn,hf-marian,torch-nn",
                    help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--vocab", type=int, default=37000, help="vocabulary of the synthetic batches (§5.1: 37,000)")
    ap.add_argument("--batch", type=int, default=780, help="synthetic: sentences per batch")
    ap.add_argument("--len", type=int, default=32, help="synthetic: source and target length")
    ap.add_argument("--data", default="", help="a prepared data directory for real batches ('' = synthetic only)")
    ap.add_argument("--batch-tokens", type=int, default=12500, help="real: source and target tokens per batch")
    ap.add_argument("--real-batches", type=int, default=40, help="real: distinct batches cycled through")
    ap.add_argument("--steps", type=int, default=10, help="steps per system per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per system first")
    ap.add_argument("--profile", action="store_true", help="print a profile of aiayn's step (first size/precision)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-name", default="", help="result file name (default gpu_train.json, gpu_train_real.json with --data)")
    args = ap.parse_args()
    device = torch.device(args.device)
    use_tf32(device, True)  # as train.tf32
    name, peak = device_peak(device)
    measured = {p: round(matmul_peak(device, torch.bfloat16 if p == "bf16" else torch.float16), 1)
                for p in args.precisions.split(",")}
    print(f"device {name}: stated dense peak {peak} TFLOP/s; measured 8192^3 matmul {measured}; torch "
          f"{torch.__version__}", flush=True)
    sizes, precisions = args.sizes.split(","), args.precisions.split(",")
    out_name = args.out_name or ("gpu_train_real.json" if args.data else "gpu_train.json")
    out = Path(os.environ.get("BENCH_RESULTS", Path(__file__).resolve().parent / "results")) / out_name
    out.parent.mkdir(parents=True, exist_ok=True)
    head = {"device": name, "stated_peak_tflops": peak, "measured_matmul_tflops": measured,
            "torch": torch.__version__, "args": vars(args)}
    profile_failed = ""
    if args.profile:  # a profiler that fails (CUPTI missing, say) costs the profile, not the measurements
        try:
            profile_aiayn(sizes[0], precisions[0], args, device)
        except Exception as exc:
            profile_failed = f"{type(exc).__name__}: {exc}"[:400]
            print(f"profile of aiayn's step failed: {profile_failed}", flush=True)
            head["profile_failed"] = profile_failed
    cases = []
    for size in sizes:
        for precision in precisions:
            for kind in (["real"] if args.data else ["synthetic"]):
                case = run_case(size, precision, kind, args, device)
                for r in case["systems"].values():
                    r["fraction_of_stated_peak"] = round(r["tflops"] / peak, 3) if peak else None
                    m = measured.get(precision)
                    r["fraction_of_measured_matmul"] = round(r["tflops"] / m, 3) if m == m else None
                cases.append(case)
                out.write_text(json.dumps({**head, "cases": cases}, indent=1))  # after every case
    print(f"results: {out}")
    return 1 if profile_failed or any(c["failed"] for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
