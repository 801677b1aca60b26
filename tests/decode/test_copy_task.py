"""End to end: a tiny Transformer trained on the copy task (the Annotated Transformer's
synthetic task) must be decoded back exactly by greedy and beam search, cached or not."""
from __future__ import annotations

import pytest
import torch

import aiayn.model as M
from aiayn.decode.adapter import CachedDecoder, RecomputeDecoder
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import SpecialIds, search

V, PAD, BOS, EOS = 14, 0, 2, 3


def copy_batch(g: torch.Generator, B: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """src = x + [EOS], tgt_in = [BOS] + x, tgt_out = x + [EOS], lengths 2..8, padded to 9
    (one shape for every batch keeps the CPU kernels warm)."""
    lengths = torch.randint(2, 9, (B,), generator=g).tolist()
    T = 9
    src = torch.full((B, T), PAD)
    tgt_in, tgt_out = src.clone(), src.clone()
    for b, n in enumerate(lengths):
        x = torch.randint(4, V, (n,), generator=g)
        src[b, :n], src[b, n] = x, EOS
        tgt_in[b, 0], tgt_in[b, 1:n + 1] = BOS, x
        tgt_out[b, :n], tgt_out[b, n] = x, EOS
    return src, tgt_in, tgt_out


@pytest.mark.slow
def test_trained_copy_model_decodes_its_input():
    torch.manual_seed(0)
    model = M.Transformer(M.get_preset("tiny", vocab_size=V, p_drop=0.0))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9)
    steps = 200
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / steps)  # linear decay: stable end
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        src, tgt_in, tgt_out = copy_batch(g, 64)
        logits = model(src, tgt_in)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgt_out.reshape(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    src, _, tgt_out = copy_batch(torch.Generator().manual_seed(1), 32)
    expected = [tuple(t for t in row.tolist() if t not in (PAD, EOS)) for row in tgt_out]
    for cfg in (DecodeConfig(beam_size=1), DecodeConfig(beam_size=4)):
        cached = search(CachedDecoder(model), src, cfg, SpecialIds(PAD, BOS, EOS))
        plain = search(RecomputeDecoder(model), src, cfg, SpecialIds(PAD, BOS, EOS))
        assert [hs[0].tokens for hs in cached] == [hs[0].tokens for hs in plain]
        correct = sum(hs[0].tokens == e for hs, e in zip(cached, expected))
        assert correct >= 31, f"beam {cfg.beam_size}: {correct}/32 copies exact"
        assert all(hs[0].eos for hs in cached)
