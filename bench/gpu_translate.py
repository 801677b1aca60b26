"""Beam search on a GPU: aiayn against Hugging Face ``MarianMTModel.generate`` on the same model shapes.

Random weights; ``--batch`` sentences of ``--src-len`` tokens, beam 4; every system generates
exactly ``--out-len`` tokens per sentence (EOS suppressed until then), so all run the same number
of decoder steps on the same rows (as bench/translate_throughput.py does on the CPU):
  aiayn   DecodeConfig(beam_size=4, min_len=L, max_len_a=0, max_len_b=L) through ``aiayn.decode.search``
          with the cached decoder, as ``Translator`` decodes; fp32, bf16 (``precision=bf16``:
          the weights cast to bfloat16, log-probabilities in float32) and fp16 (CUDA only);
          aiayn-graphs-*: the same with ``DecodeConfig.cuda_graphs`` (``GraphDecoder``: each step one
          CUDA graph replay; the warm-up call captures the graph, the timed calls replay it)
  HF      MarianMTModel.generate(num_beams=4, min_new_tokens=L, max_new_tokens=L), fp32, bf16 and fp16 weights
  CT2     CTranslate2 on aiayn's own model (the same weights, written by ``aiayn export``'s ``write_ct2``):
          translate_batch(beam_size=4, min_decoding_length=L, max_decoding_length=L), compute types
          float32, bfloat16, float16 and int8_bfloat16 (int8 weights, bfloat16 between them), on the
          same device. CTranslate2's CUDA build opens libcublas.so.12 by name: it is loaded from the
          nvidia-cublas-cu12 package where one is installed; bench/gpu_check.sh otherwise names the
          installed cuBLAS (13 beside a CUDA 13 torch) libcublas.so.12 on LD_LIBRARY_PATH, the
          functions CTranslate2 calls being the same in both (recorded as ``cublas`` in the results)
Interleaved rounds, median round; target tokens/s = batch * L / time. A system whose warm-up call
generated other than batch * L tokens did other work than the rest: its line says so, ``same_work``
is false in the results, and the script exits nonzero.

    python bench/gpu_translate.py --sizes base,big
    python bench/gpu_translate.py --sizes tiny --batch 4 --out-len 8 --vocab 300 --device cpu \
        --systems aiayn-fp32,hf-fp32,ct2-fp32                                   # CPU smoke

Results: ``$BENCH_RESULTS/gpu_translate.json``, written again after every size.
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiayn  # noqa: E402
from aiayn.decode.adapter import CachedDecoder  # noqa: E402
from aiayn.decode.config import DecodeConfig  # noqa: E402
from aiayn.decode.graphs import GraphDecoder  # noqa: E402
from aiayn.decode.search import SpecialIds, search  # noqa: E402
from aiayn.decode.loading import model_for_precision  # noqa: E402
from gpu_train import sync, timed_rounds  # noqa: E402


def aiayn_system(cfg, precision: str, src: torch.Tensor, L: int, K: int, device, graphs: bool = False):
    torch.manual_seed(0)
    model = model_for_precision(aiayn.Transformer(cfg).to(device).eval(), precision)
    decoder = GraphDecoder(model) if graphs else CachedDecoder(model)
    dcfg = DecodeConfig(beam_size=K, min_len=L, max_len_a=0, max_len_b=L, precision=precision)
    ids = SpecialIds(cfg.pad_id, cfg.bos_id, cfg.eos_id)

    def run():
        hyps = search(decoder, src, dcfg, ids)
        return sum(len(h[0].tokens) + int(h[0].eos) for h in hyps)
    return run


def hf_system(cfg, dtype: torch.dtype, src_aiayn: torch.Tensor, L: int, K: int, device):
    from marian import build_marian, marian_pad
    model = build_marian(cfg).to(device=device, dtype=dtype).eval()
    model.config._attn_implementation = "sdpa"
    pad = marian_pad(cfg)
    src = torch.where(src_aiayn == cfg.pad_id, torch.full_like(src_aiayn, pad), src_aiayn)
    mask = torch.ones_like(src)

    @torch.inference_mode()
    def run():
        out = model.generate(input_ids=src, attention_mask=mask, num_beams=K, do_sample=False, min_new_tokens=L,
                             max_new_tokens=L, early_stopping=True, use_cache=True, suppress_tokens=[pad])
        return int((out[:, 1:] != pad).sum())  # after the start token; a row ended early is padded
    return run


def load_cublas12() -> None:
    """CTranslate2's CUDA build opens libcublas.so.12 by name; a torch of another CUDA brings another
    cuBLAS, so load the nvidia-cublas-cu12 package's copy first where one is installed."""
    for path in sys.path:
        for lib in glob.glob(os.path.join(path, "nvidia", "cublas", "lib", "libcublas.so.12")):
            ctypes.CDLL(os.path.join(os.path.dirname(lib), "libcublasLt.so.12"), mode=ctypes.RTLD_GLOBAL)
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return


def ct2_system(cfg, compute_type: str, src: torch.Tensor, L: int, K: int, device, workdir: Path):
    """CTranslate2's beam search on the model ``aiayn_system`` decodes (seed 0), exported as ``aiayn export`` does."""
    import ctranslate2
    from aiayn.interop.ct2_export import write_ct2
    if device.type == "cuda":
        load_cublas12()
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).eval()
    tokens = [f"w{i}" for i in range(cfg.vocab_size)]
    tokens[cfg.pad_id], tokens[1], tokens[cfg.bos_id], tokens[cfg.eos_id] = "<pad>", "<unk>", "<s>", "</s>"
    folder = workdir / f"ct2-{cfg.d_model}-{cfg.vocab_size}"
    if not (folder / "model.bin").exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_ct2(model, tokens, tokens, folder)
    tr = ctranslate2.Translator(str(folder), device=device.type, compute_type=compute_type)
    batch = [[tokens[i] for i in row] for row in src.tolist()]

    def run():
        out = tr.translate_batch(batch, beam_size=K, min_decoding_length=L, max_decoding_length=L,
                                 suppress_sequences=[["<pad>"], ["<s>"]])
        return sum(len(r.hypotheses[0]) for r in out)
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="base,big")
    ap.add_argument("--vocab", type=int, default=37000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--src-len", type=int, default=20)
    ap.add_argument("--out-len", type=int, default=69, help="tokens generated per sentence (input + 50 for 19 words)")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", default="aiayn-fp32,aiayn-bf16,hf-fp32,hf-bf16,ct2-fp32,ct2-bf16,ct2-fp16,ct2-int8")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-name", default="gpu_translate.json", help="result file name")
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = Path(os.environ.get("BENCH_RESULTS", Path(__file__).resolve().parent / "results")) / args.out_name
    out.parent.mkdir(parents=True, exist_ok=True)
    cases = []
    workdir = Path(tempfile.mkdtemp(prefix="gpu-translate-"))
    atexit.register(shutil.rmtree, workdir, ignore_errors=True)  # the CTranslate2 models converted
    for size in args.sizes.split(","):
        cfg = aiayn.get_preset(size, vocab_size=args.vocab)
        g = torch.Generator().manual_seed(1)
        src = torch.randint(4, cfg.vocab_size, (args.batch, args.src_len), generator=g)
        src[:, -1] = cfg.eos_id
        src = src.to(device)
        builders = {"aiayn-fp32": lambda: aiayn_system(cfg, "fp32", src, args.out_len, args.beam, device),
                    "aiayn-bf16": lambda: aiayn_system(cfg, "bf16", src, args.out_len, args.beam, device),
                    "aiayn-fp16": lambda: aiayn_system(cfg, "fp16", src, args.out_len, args.beam, device),
                    "aiayn-graphs-fp32": lambda: aiayn_system(cfg, "fp32", src, args.out_len, args.beam, device, True),
                    "aiayn-graphs-bf16": lambda: aiayn_system(cfg, "bf16", src, args.out_len, args.beam, device, True),
                    "hf-fp32": lambda: hf_system(cfg, torch.float32, src, args.out_len, args.beam, device),
                    "hf-bf16": lambda: hf_system(cfg, torch.bfloat16, src, args.out_len, args.beam, device),
                    "hf-fp16": lambda: hf_system(cfg, torch.float16, src, args.out_len, args.beam, device),
                    "ct2-fp32": lambda: ct2_system(cfg, "float32", src, args.out_len, args.beam, device, workdir),
                    "ct2-bf16": lambda: ct2_system(cfg, "bfloat16", src, args.out_len, args.beam, device, workdir),
                    "ct2-fp16": lambda: ct2_system(cfg, "float16", src, args.out_len, args.beam, device, workdir),
                    "ct2-int8": lambda: ct2_system(cfg, "int8_bfloat16", src, args.out_len, args.beam, device,
                                                   workdir)}
        runs, tokens, failed = {}, {}, {}
        for sys_name in args.systems.split(","):
            try:
                runs[sys_name] = builders[sys_name]()
                tokens[sys_name] = runs[sys_name]()  # warm-up; the tokens it produced
                sync(device)
            except Exception as exc:
                failed[sys_name] = f"{type(exc).__name__}: {exc}"[:400]
                print(f"{size} {sys_name}: failed: {failed[sys_name]}", flush=True)
                runs.pop(sys_name, None)
        times = timed_rounds(runs, args.rounds, device, failed=failed)  # a failure in a round: that system out
        res, expected = {}, args.batch * args.out_len
        for k, ts in times.items():
            t = statistics.median(ts)
            res[k] = {"tgt_tok_s": round(expected / t), "seconds": round(t, 4), "tokens_generated": tokens[k],
                      "same_work": tokens[k] == expected, "rounds_s": [round(x, 4) for x in ts]}
            other = "" if res[k]["same_work"] else f"; NOT THE SAME WORK: {tokens[k]} tokens generated, not {expected}"
            print(f"{size:5s} {k:17s} {res[k]['tgt_tok_s']:>10,} tgt tok/s  ({t:.3f} s per call){other}", flush=True)
        for a, b in (("aiayn-fp32", "hf-fp32"), ("aiayn-bf16", "hf-bf16"), ("aiayn-bf16", "aiayn-fp32"),
                     ("aiayn-fp32", "ct2-fp32"), ("aiayn-bf16", "ct2-bf16"), ("aiayn-bf16", "ct2-fp16"),
                     ("aiayn-bf16", "ct2-int8"), ("aiayn-fp16", "ct2-fp16"), ("aiayn-fp16", "hf-fp16"),
                     ("aiayn-fp16", "aiayn-fp32"), ("aiayn-graphs-fp32", "aiayn-fp32"),
                     ("aiayn-graphs-bf16", "aiayn-bf16"), ("aiayn-graphs-fp32", "hf-fp32"),
                     ("aiayn-graphs-bf16", "hf-bf16"), ("aiayn-graphs-fp32", "ct2-fp32"),
                     ("aiayn-graphs-bf16", "ct2-bf16"), ("aiayn-graphs-bf16", "ct2-fp16")):
            if a in res and b in res:
                print(f"{size:5s} {a} / {b}: {res[a]['tgt_tok_s'] / res[b]['tgt_tok_s']:.2f}x", flush=True)
        cases.append({"size": size, "systems": res, "failed": failed})
        out.write_text(json.dumps({"device": name, "torch": torch.__version__, "args": vars(args),
                                   "cublas": os.environ.get("AIAYN_CUBLAS12", "as installed"), "cases": cases},
                                  indent=1))  # after every case
    print(f"results: {out}")
    return 1 if any(c["failed"] or not all(r["same_work"] for r in c["systems"].values()) for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
