"""Operations the host issues per beam-search step, with the cached decoder and with the step over fixed
buffers that a GPU replays as one CUDA graph (``DecodeConfig.cuda_graphs``, aiayn/decode/graphs.py).

On a GPU a base model's step waits for the host, which issues each operation on its own; what the graph
captures leaves the host's count. Counted on the CPU (the count does not depend on the device): torch's
profiler, top-level aten operations of one search divided by its steps, those of the captured step
(``Bucket._step``, marked) apart. Random weights, every sentence forced to ``--out-len`` tokens.

    python bench/decode_host_ops.py [--size base --batch 8 --src-len 12 --out-len 20 --beam 4]

Results: ``$BENCH_RESULTS/decode_host_ops.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiayn  # noqa: E402
import benchlib as bl  # noqa: E402
from aiayn.decode import graphs  # noqa: E402
from aiayn.decode.adapter import CachedDecoder  # noqa: E402
from aiayn.decode.config import DecodeConfig  # noqa: E402
from aiayn.decode.search import SpecialIds, search  # noqa: E402

MARK = "captured step"


def count(decoder, src, cfg, ids, steps: int) -> dict:
    """Top-level aten operations per step: issued by the host, and inside the captured step."""
    search(decoder, src, cfg, ids)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        search(decoder, src, cfg, ids)
    host = captured = 0
    for e in prof.events():
        if not e.name.startswith("aten::") or (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")):
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name != MARK:
            parent = parent.cpu_parent
        if parent is None:
            host += 1
        else:
            captured += 1
    return {"host_ops_per_step": round(host / steps, 1), "captured_ops_per_step": round(captured / steps, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(bl.SIZES), default="base")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--src-len", type=int, default=12)
    ap.add_argument("--out-len", type=int, default=20)
    ap.add_argument("--beam", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    step = graphs.Bucket._step

    def marked(self):
        with torch.profiler.record_function(MARK):
            return step(self)
    graphs.Bucket._step = marked
    cfg = bl.model_config(args.size)
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).eval()
    src = torch.randint(4, cfg.vocab_size, (args.batch, args.src_len))
    src[:, -1] = cfg.eos_id
    L = args.out_len
    dcfg = DecodeConfig(beam_size=args.beam, min_len=L, max_len_a=0, max_len_b=L)
    ids = SpecialIds(cfg.pad_id, cfg.bos_id, cfg.eos_id)
    res = {"cached": count(CachedDecoder(model), src, dcfg, ids, L),
           "graphs": count(graphs.GraphDecoder(model), src, dcfg, ids, L)}
    for k, v in res.items():
        print(f"{k:7s} host {v['host_ops_per_step']:6.1f} ops a step, captured {v['captured_ops_per_step']:6.1f}")
    ratio = res["cached"]["host_ops_per_step"] / res["graphs"]["host_ops_per_step"]
    print(f"host operations a step: {ratio:.2f}x fewer with the step as a graph")
    out = Path(os.environ.get("BENCH_RESULTS", Path(__file__).resolve().parent / "results")) / "decode_host_ops.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "torch": torch.__version__, "machine": bl.machine_info(1),
                               "results": res, "ratio": round(ratio, 2)}, indent=1))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
