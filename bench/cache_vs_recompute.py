"""The decoder cache against recomputing the prefix: beam 4 on 64 sentences of 20 tokens with a base-sized model (random
weights, vocabulary 8000), output forced to 20 tokens, with the decoder cache and without it
(the whole prefix recomputed every step). Prints target tokens/s; one run each, 2 threads.

    python bench/cache_vs_recompute.py [VOCAB]
"""
import os
import sys
import time

if sys.argv[2:] or not all(a.isdigit() for a in sys.argv[1:]):
    sys.exit(__doc__)  # the usage above, for --help or arguments that do not fit it

import torch

import aiayn.model as M
from aiayn.decode.adapter import CachedDecoder, RecomputeDecoder
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import search

torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
torch.manual_seed(0)
V = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
model = M.Transformer(M.get_preset("base", vocab_size=V)).eval()
g = torch.Generator().manual_seed(2)
src = torch.randint(4, V, (64, 20), generator=g)
src[:, -1] = 3  # EOS
L = 20
cfg = DecodeConfig(beam_size=4, min_len=L, max_len_a=0.0, max_len_b=L)
with torch.inference_mode():
    search(CachedDecoder(model), src[:2], cfg)  # warm-up
    for name, dec in [("cache", CachedDecoder(model)), ("recompute", RecomputeDecoder(model))]:
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        out = search(dec, src, cfg)
        dt = time.perf_counter() - t0
        n = sum(len(hs[0].tokens) for hs in out)
        print(f"V={V} {name}: {n} target tokens in {dt:.2f}s = {n / dt:.0f} tok/s (load {load0:.1f})", flush=True)
