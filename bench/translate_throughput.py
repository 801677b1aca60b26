"""Translation throughput: target tokens/s of beam search (§6.1), aiayn vs Marian vs CTranslate2.

    python bench/translate_throughput.py --size base
    python bench/translate_throughput.py --size small

--batch sentences (64) of --src-len tokens (20, EOS included, no padding), beam 4, random
weights. Every system generates exactly --out-len tokens per sentence (EOS suppressed until
then), so all do the same number of decoder steps on the same number of rows:
  aiayn        DecodeConfig(beam_size=4, min_len=L, max_len_a=0, max_len_b=L); aiayn.decode.search
               with the cached decoder (as Translator does), on token ids
  HF           MarianMTModel.generate(num_beams=4, min_new_tokens=L, max_new_tokens=L)
  CTranslate2  translate_batch(beam_size=4, min_decoding_length=L, max_decoding_length=L) on the
               same Marian model converted by ctranslate2.converters.TransformersConverter
The default L = 69 is the rivals' setting (the reference rival measurements: max length = input + 50).

Systems (each in its own process, interleaved, 2 threads each): aiayn-fp32; aiayn-bf16
(search under torch.autocast bfloat16; attention core in float32 by train.attn_fp32);
aiayn-bf16w (weights cast to bfloat16, no autocast); aiayn-int8 (int8 linear maps,
aiayn/decode/int8.py, as DecodeConfig(precision="int8") decodes); aiayn-int8bf16 (the same int8 linear
maps, bfloat16 between them: precision "int8-bf16"); hf-fp32; ct2-fp32; ct2-int8; ct2-fp32-inter
(CTranslate2's inter_threads: 2 workers of 1 thread, each given half the batch; CT2 scales
worse over intra-op threads than aiayn does, so this is its other way to use the 2 threads);
aiayn-fp32-inter, aiayn-bf16w-inter, aiayn-int8bf16-inter (aiayn's DecodeConfig.workers = 2 through a
Translator: 2 processes of 1 thread, each given half the batch, as ct2-fp32-inter). aiayn's systems use
its C kernels (DecodeConfig.c_kernels, aiayn/kernels/loader.py); aiayn-fp32-torch,
aiayn-int8bf16-torch and aiayn-int8bf16-inter-torch are the same with PyTorch's operations, for A/B runs
(only when named in --systems). aiayn's float32 systems multiply from oneDNN's packed weights
(DecodeConfig.packed_weights, aiayn/decode/packed.py; MKL's packed sgemm instead on Intel CPUs,
DecodeConfig.packed_library "auto"); aiayn-fp32-unpacked and
aiayn-fp32-inter-unpacked use PyTorch's linear, aiayn-fp32-onednn and aiayn-fp32-inter-onednn oneDNN's
packed weights whatever the CPU (A/B only, also only when named in --systems).
Tokens/s = batch * L / median wall time of one call (one output per sentence counted).

Model FLOPs of one call (``beam_flops``): the encoder and the encoder-decoder keys/values once
per sentence, then per step t = 1..L for the N = batch * beam rows the decoder's linear layers,
self-attention over t keys, cross-attention over S keys, and the d_model x V output layer.
Writes results/translate_<size>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

import benchlib as bl

log = logging.getLogger("bench.translate")

DEFAULTS = {
    "base": {"reps": 4, "warmup": 1, "min_reps": 3, "budget_s": 160.0},
    "small": {"reps": 6, "warmup": 1, "min_reps": 3, "budget_s": 60.0},
    "tiny": {"reps": 2, "warmup": 1, "min_reps": 1, "budget_s": 10.0},
    "main": {"reps": 6, "warmup": 1, "min_reps": 3, "budget_s": 60.0},
}


def beam_flops(cfg, B: int, S: int, L: int, K: int) -> int:
    """Forward matmul FLOPs of beam search with K beams for L steps on B sentences of S tokens."""
    from aiayn.train.flops import forward_flops

    D, F, H, dk, dv, V = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.target_vocab_size
    N = B * K
    once = forward_flops(cfg, B, S, 0)  # encoder + encoder-decoder K/V projections, per sentence
    linear = 2 * (D * H * (2 * dk + dv) + H * dv * D + D * H * dk + H * dv * D + 2 * D * F)  # per row, layer
    per_step = cfg.decoder_layers * N * (linear + H * S * 2 * (dk + dv)) + N * 2 * D * V
    self_attn = cfg.decoder_layers * N * H * 2 * (dk + dv) * L * (L + 1) // 2  # step t attends to t keys
    return once + L * per_step + self_attn


def _src(B: int, S: int, low: int, high: int, eos: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    src = torch.randint(low, high, (B, S), generator=g)
    src[:, -1] = eos
    return src


def build_aiayn(size: str, mode: str, B: int, S: int, L: int, K: int, share_slots: bool = True, workers: int = 1,
                c_kernels: bool = True, packed: bool = True, library: str = "auto"):
    """aiayn beam search on ids, as Translator.translate_ids calls it; mode fp32 | bf16 | bf16w | int8 | int8bf16;
    share_slots=False: the copying beam cache (for A/B runs); workers > 1: through a Translator with
    DecodeConfig.workers (the batch halved over that many processes, aiayn/decode/workers.py);
    c_kernels=False: PyTorch's operations instead of the C kernels (DecodeConfig.c_kernels); packed=False:
    PyTorch's float32 linear instead of packed weights (DecodeConfig.packed_weights); library: whose packed
    weights (DecodeConfig.packed_library)."""
    import aiayn
    from aiayn.decode.adapter import CachedDecoder
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.search import SpecialIds, search
    from aiayn.decode.loading import decoding_kernels

    cfg = bl.model_config(size)
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).eval()
    precision = {"fp32": "fp32", "bf16": "fp32", "bf16w": "bf16", "int8": "int8", "int8bf16": "int8-bf16"}[mode]
    dcfg = DecodeConfig(beam_size=K, min_len=L, max_len_a=0, max_len_b=L, c_kernels=c_kernels, packed_weights=packed,
                        packed_library=library)
    ids = SpecialIds(pad=cfg.pad_id, bos=cfg.bos_id, eos=cfg.eos_id)
    src = _src(B, S, 4, cfg.vocab_size, cfg.eos_id)
    if workers > 1:
        from aiayn.decode.translator import Translator

        assert mode != "bf16", "autocast decoding has no workers variant"
        # no tokenizers: translate_ids works on ids (the workers get None for them)
        tr = Translator(model, None, None, dataclasses.replace(dcfg, precision=precision, workers=workers))
        rows = [r.tolist() for r in src]
        tr.translate_ids(rows[:workers])  # start the workers (the harness's warm-up rounds come on top)

        def run_workers() -> dict:
            lens = [hs[0].length for hs in tr.translate_ids(rows)]
            # the system's own process only waits: its peak RSS and cores leave out the workers'
            return {"out_len_min": min(lens), "out_len_max": max(lens), "sentences": len(lens), "workers": workers,
                    "workers_peak_rss_mb": [bl.peak_rss_mb(pid) for pid in tr._workers().pids()]}

        return run_workers
    kernels = decoding_kernels(dcfg, model)
    from aiayn.decode.loading import model_for_precision
    model = model_for_precision(model, precision, kernels, packed, library)  # the decoding copy Translator makes
    if mode == "bf16":  # autocast: Eq. 1 in float32 (train.attn_fp32, as training's validation has it)
        from aiayn.execution import Execution, apply
        apply(model, Execution(attn_fp32=True))
    decoder = CachedDecoder(model, share_slots=share_slots, kernels=kernels)

    def run() -> dict:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "bf16" else contextlib.nullcontext()
        with ctx:
            hyps = search(decoder, src, dcfg, ids)
        lens = [hs[0].length for hs in hyps]
        return {"out_len_min": min(lens), "out_len_max": max(lens), "sentences": len(hyps)}

    return run


def build_hf(size: str, B: int, S: int, L: int, K: int):
    from marian import MARIAN_EOS, build_marian, marian_pad

    cfg = bl.model_config(size)
    model = build_marian(cfg).eval()
    pad = marian_pad(cfg)
    src = _src(B, S, 2, pad, MARIAN_EOS)
    mask = torch.ones_like(src)

    @torch.inference_mode()
    def run() -> dict:
        out = model.generate(input_ids=src, attention_mask=mask, num_beams=K, do_sample=False,
                             min_new_tokens=L, max_new_tokens=L, early_stopping=True, use_cache=True,
                             suppress_tokens=[pad])
        return {"out_len_min": out.size(1) - 1, "out_len_max": out.size(1) - 1, "sentences": out.size(0),
                "attn_implementation": getattr(model.config, "_attn_implementation", None)}

    return run


def prepare_ct2(size: str, workdir: str) -> dict:
    """Build the Marian model, convert it, and check the conversion: greedy HF vs CT2 outputs
    on 4 sentences x 12 tokens should agree (float32). Runs in its own process."""
    import ctranslate2
    from marian import MARIAN_EOS, build_marian, convert_to_ct2, marian_pad, marian_tokens

    torch.set_num_threads(1)
    cfg = bl.model_config(size)
    model = build_marian(cfg).eval()
    ct2_dir = convert_to_ct2(model, cfg, Path(workdir))
    pad, toks = marian_pad(cfg), marian_tokens(cfg)
    src = _src(4, 10, 2, pad, MARIAN_EOS)
    with torch.inference_mode():
        hf = model.generate(input_ids=src, attention_mask=torch.ones_like(src), num_beams=1, do_sample=False,
                            min_new_tokens=12, max_new_tokens=12, suppress_tokens=[pad])[:, 1:].tolist()
    tr = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="float32", intra_threads=1)
    ct = tr.translate_batch([[toks[i] for i in row] for row in src.tolist()], beam_size=1,
                            min_decoding_length=12, max_decoding_length=12)
    pairs = [(toks[a], b) for row, r in zip(hf, ct) for a, b in zip(row[:11], r.hypotheses[0][:11])]
    return {"ct2_dir": str(ct2_dir), "greedy_agreement_hf_ct2": sum(a == b for a, b in pairs) / max(1, len(pairs))}


def build_ct2(size: str, compute_type: str, ct2_dir: str, threads: int, B: int, S: int, L: int, K: int,
              inter: int = 1):
    """inter > 1: CTranslate2's own data parallelism, ``inter`` workers of threads / inter threads
    each, the batch split into ``inter`` parts (the same total thread count)."""
    import ctranslate2
    from marian import MARIAN_EOS, marian_pad, marian_tokens

    cfg = bl.model_config(size)
    tr = ctranslate2.Translator(ct2_dir, device="cpu", compute_type=compute_type, inter_threads=inter,
                                intra_threads=max(1, threads // inter))
    toks = marian_tokens(cfg)
    src = [[toks[i] for i in row] for row in _src(B, S, 2, marian_pad(cfg), MARIAN_EOS).tolist()]

    def run() -> dict:
        out = tr.translate_batch(src, beam_size=K, min_decoding_length=L, max_decoding_length=L,
                                 max_batch_size=-(-B // inter))
        lens = [len(r.hypotheses[0]) for r in out]
        return {"out_len_min": min(lens), "out_len_max": max(lens), "sentences": len(out),
                "compute_type": tr.compute_type}

    return run


def systems(args: argparse.Namespace, ct2_dir: str | None) -> list[bl.System]:
    shape = {"B": args.batch, "S": args.src_len, "L": args.out_len, "K": args.beam}
    out = [bl.System(f"aiayn-{m}", build_aiayn, {"size": args.size, "mode": m, **shape}, **bl.AIAYN_PROCESS)
           for m in ("fp32", "bf16", "bf16w", "int8", "int8bf16")]
    if args.threads > 1:  # aiayn's DecodeConfig.workers: the same threads split over processes, as CT2's inter
        out += [bl.System(f"aiayn-{m}-inter", build_aiayn, {"size": args.size, "mode": m, "workers": args.threads,
                                                           **shape}, **bl.AIAYN_PROCESS)
                for m in ("fp32", "bf16w", "int8bf16")]
    # A/B only (run when named in --systems): the same systems with PyTorch's operations in place of the C kernels
    out += [bl.System(f"aiayn-{m}{'-inter' if w > 1 else ''}-torch", build_aiayn,
                      {"size": args.size, "mode": m, "workers": w, "c_kernels": False, **shape}, **bl.AIAYN_PROCESS)
            for m, w in (("fp32", 1), ("int8bf16", 1), ("int8bf16", args.threads)) if w == 1 or args.threads > 1]
    # A/B only: float32 through PyTorch's linear instead of packed weights (DecodeConfig.packed_weights), and
    # through oneDNN's packed weights whatever "auto" picks on this CPU (DecodeConfig.packed_library)
    out += [bl.System(f"aiayn-fp32{'-inter' if w > 1 else ''}-{suffix}", build_aiayn,
                      {"size": args.size, "mode": "fp32", "workers": w, **kw, **shape}, **bl.AIAYN_PROCESS)
            for w in (1, args.threads) if w == 1 or args.threads > 1
            for suffix, kw in (("unpacked", {"packed": False}), ("onednn", {"library": "onednn"}))]
    out.append(bl.System("hf-fp32", build_hf, {"size": args.size, **shape}))
    for name, ct in (("ct2-fp32", "float32"), ("ct2-int8", "int8")):
        out.append(bl.System(name, build_ct2, {"size": args.size, "compute_type": ct, "ct2_dir": ct2_dir,
                                               "threads": args.threads, **shape}))
    if args.threads > 1:  # CTranslate2's inter_threads, the same thread count split over workers
        out.append(bl.System("ct2-fp32-inter", build_ct2, {"size": args.size, "compute_type": "float32",
                                                           "ct2_dir": ct2_dir, "threads": args.threads,
                                                           "inter": args.threads, **shape}))
    return out


# Systems for A/B runs only: measured when named in --systems, never by default (every system is a live
# process for the whole run, and on the base model the full list outgrew 24 GiB on a 2-core AMD EPYC).
AB_ONLY_SUFFIXES = ("-torch", "-unpacked", "-onednn")


def selected(all_systems: list[bl.System], names: str | None) -> list[bl.System]:
    """The systems named in --systems; without it, all but the A/B-only ones."""
    if names:
        return bl.pick(all_systems, names)
    return [s for s in all_systems if not s.name.endswith(AB_ONLY_SUFFIXES)]


DTYPE = {"aiayn-fp32": "fp32", "aiayn-bf16": "bf16", "aiayn-bf16w": "bf16", "aiayn-int8": "fp32", "aiayn-int8bf16": "fp32",
         "aiayn-fp32-inter": "fp32", "aiayn-bf16w-inter": "bf16", "aiayn-int8bf16-inter": "fp32",
         "aiayn-fp32-torch": "fp32", "aiayn-int8bf16-torch": "fp32", "aiayn-int8bf16-inter-torch": "fp32",
         "aiayn-fp32-unpacked": "fp32", "aiayn-fp32-inter-unpacked": "fp32",
         "aiayn-fp32-onednn": "fp32", "aiayn-fp32-inter-onednn": "fp32",
         "hf-fp32": "fp32",
         "ct2-fp32": "fp32", "ct2-int8": "fp32", "ct2-fp32-inter": "fp32"}
# (numerator, denominator, target): the translation targets of BENCHMARKS.md §3; "aiayn-best-reduced" and
# "ct2-best-fp32" are the composites of benchlib.BEST_OF (both toolkits are judged on their better
# use of the same threads).
RATIOS = [("aiayn-best-fp32", "ct2-best-fp32", 1.2), ("aiayn-best-fp32", "hf-fp32", 3.0),
          ("aiayn-best-reduced", "ct2-best-fp32", 2.0), ("aiayn-best-reduced", "ct2-int8", None),
          ("aiayn-fp32", "ct2-fp32", None), ("aiayn-fp32", "ct2-fp32-inter", None),
          ("aiayn-bf16", "aiayn-fp32", None), ("aiayn-bf16w", "aiayn-fp32", None), ("aiayn-int8", "aiayn-fp32", None),
          ("aiayn-int8", "ct2-int8", None), ("aiayn-int8bf16", "aiayn-int8", None), ("aiayn-int8bf16", "ct2-int8", None),
          ("aiayn-fp32-inter", "aiayn-fp32", None), ("aiayn-int8bf16-inter", "aiayn-int8bf16", None)]


def _ct2_prepared(args: argparse.Namespace, workdir: str) -> tuple[str | None, dict]:
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as ex:
        try:
            info = ex.submit(prepare_ct2, args.size, workdir).result(timeout=args.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the CT2 systems fail, the others go on
            log.error("CTranslate2 conversion failed: %r", exc)
            return None, {"error": repr(exc)}
    log.info("converted to CTranslate2; greedy HF/CT2 agreement %.0f%%", 100 * info["greedy_agreement_hf_ct2"])
    return info["ct2_dir"], info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(bl.SIZES), default="base")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--src-len", type=int, default=20)
    ap.add_argument("--out-len", type=int, default=69, help="L, tokens generated per sentence by every system")
    ap.add_argument("--beam", type=int, default=4)
    bl.add_common_args(ap)
    args = ap.parse_args(argv)
    bl.fill_defaults(args, DEFAULTS[args.size])
    bl.setup_logging()
    cfg = bl.model_config(args.size)
    machine = bl.machine_info(args.threads)
    chosen = [s.name for s in selected(systems(args, None), args.systems)]
    workdir = tempfile.mkdtemp(prefix="bench_ct2_")
    try:
        ct2_dir, conversion = (_ct2_prepared(args, workdir) if any(n.startswith("ct2") for n in chosen)
                               else (None, {}))
        todo, skipped = bl.without_emulated_bf16([s for s in selected(systems(args, ct2_dir), args.systems)
                                                  if not (s.name.startswith("ct2") and ct2_dir is None)])
        res = bl.measure_interleaved(todo, threads=args.threads, warmup=args.warmup, reps=args.reps,
                                     min_reps=args.min_reps, budget_s=args.budget_s, timeout_s=args.timeout_s)
        res.update(skipped)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for name in chosen:
        res.setdefault(name, {"error": f"not run: CTranslate2 conversion failed: {conversion.get('error')}"})
    report(args, cfg, machine, res, conversion)
    return 0


def report(args, cfg, machine: dict, res: dict, conversion: dict) -> None:
    tokens = args.batch * args.out_len
    flops = beam_flops(cfg, args.batch, args.src_len, args.out_len, args.beam)
    rows = []
    for name, r in res.items():
        if "time" not in r:
            rows.append([name, bl.status(r), "-", "-", "-", "-", "-"])
            continue
        med = r["time"]["median"]
        r["tgt_tokens_per_s"] = tokens / med
        r["model_gflops_per_s"] = flops / med / 1e9
        r["peak_dtype"] = DTYPE[name]
        r["peak_gflops"] = peak = bl.peak_gflops(DTYPE[name])
        r["fraction_of_peak"] = bl.ratio(r["model_gflops_per_s"], peak)
        info = r.get("info", {})
        r["lengths_ok"] = info.get("out_len_min") == info.get("out_len_max") == args.out_len
        rows.append([name, f"{r['tgt_tokens_per_s']:.0f}", f"{med:.2f}", f"{r['model_gflops_per_s']:.1f}",
                     bl.fmt(r["fraction_of_peak"] and 100 * r["fraction_of_peak"], ".1f"),
                     bl.fmt(r.get("peak_rss_mb"), ".0f"),
                     f"{info.get('out_len_min')}-{info.get('out_len_max')}" + ("" if r["lengths_ok"] else " !")])
    speed = {n: r.get("tgt_tokens_per_s") for n, r in res.items()}
    for composite, members in bl.BEST_OF.items():
        measured = [speed[n] for n in members if speed.get(n)]
        speed[composite] = max(measured) if measured else None
    ratios = {}
    for a, b, target in RATIOS:
        x = bl.ratio(speed.get(a), speed.get(b))
        ratios[f"{a}/{b}"] = {"ratio": x, "target": target,
                              "pass": None if x is None or target is None else x >= target}
    print(f"\ntranslation, size {args.size}: {args.batch} sentences x {args.src_len} tokens -> {args.out_len} "
          f"tokens, beam {args.beam}, {flops / 1e9:.1f} GFLOP per call, {args.threads} threads")
    bl.print_table(["system", "tgt tok/s", "call s (median)", "GFLOP/s", "% of peak", "peak RSS MB", "out len"],
                   rows)
    for key, v in ratios.items():
        print(f"{key}: {bl.fmt(v['ratio'], '.2f')}x" + (f" (target >= {v['target']}x)" if v["target"] else ""))
    bl.write_result(args.name or f"translate_{args.size}", {
        "bench": "translate_throughput", "size": args.size, "model_config": cfg.__dict__, "machine": machine,
        "args": vars(args), "tgt_tokens_per_call": tokens, "model_flops_per_call": flops,
        "flop_formula": "beam_flops: forward_flops(cfg, B, S, 0) [encoder + cross K/V once per sentence] + "
                        "L x N x (dec_layers x (linear + H*S*2*(d_k+d_v)) + 2*D*V) + "
                        "dec_layers x N x H*2*(d_k+d_v) x L(L+1)/2, N = B x beam",
        "ct2_conversion": conversion, "systems": res, "ratios": ratios})


if __name__ == "__main__":
    raise SystemExit(main())
