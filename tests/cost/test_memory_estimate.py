"""The peak-memory estimate of ``aiayn estimate`` (aiayn/cost/memory.py) against hand-computed bytes."""
from __future__ import annotations

import json
from pathlib import Path


from aiayn.cli import main
from aiayn.model.config import ModelConfig
from aiayn.train.config import TrainConfig
from aiayn.cost.memory import activation_bytes, loss_bytes, parameter_counts, peak_memory

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TINY = ModelConfig(vocab_size=10, n_layers=1, d_model=8, d_ff=16, n_heads=2, d_k=4, d_v=4, p_drop=0.1, max_positions=16)
M_S, M_T = 6, 8  # B = 2 sentences, S = 3, T = 4


def test_tiny_model_parameters_by_hand():
    """Embedding 10*8 = 80 (one matrix, tied); encoder layer: Q K V 8*24, W^O 8*8 (§3.2.2: no biases),
    W1 8*16+16, W2 16*8+8, 2 LayerNorms 2*16 = 568; decoder layer: 192 + 64, cross Q 64, K V 8*16, W^O 64,
    FFN 280, 3 LayerNorms 48 = 840. P = 1488, of which 80 + 32 + 48 = 160 in no matmul; the sinusoid
    table 16*8. With attn_bias, 24 + 8 in each encoder self-attention, 24 + 8 + 8 + 16 + 8 in the decoder: 1584."""
    assert parameter_counts(TINY) == (1488, 160, 128)
    assert parameter_counts(ModelConfig(**{**vars(TINY), "attn_bias": True})) == (1584, 160, 128)


def test_tiny_model_bf16_by_hand():
    """D 8, F 16, H 2, K = Dv = 4, V 10, one layer each, dropout on (m = 1), b = 2:
    c = 4*8 + 8 + 8 = 48; self-attention 2 (8 + 2*12 + 2*4) + 4*2 = 88; cross per target token
    2 (8 + 8 + 8) + 8 = 56, per source token 2*2*8 + 2*8 = 48; FFN 2*8 + 2*16 = 48; embedding 8 + 8 = 16.
    Source token: 88 + 48 + 2*48 + 48 + 16 = 296; target token: 88 + 56 + 48 + 3*48 + 16 = 352;
    6*296 + 8*352 = 4592. Fused loss: 4 (8*8 + 10*8) + 2*8*8 + 2*8*10 + 2*2*10*8 = 1184.
    Weights 4 (1488 + 128) = 6464, gradients 4*1488, Adam 8*1488, copies 2 (1488 - 160) = 2656."""
    assert activation_bytes(TINY, M_S, M_T, 2) == 4592
    p = peak_memory(TINY, TrainConfig(), M_S, M_T, "bf16")
    assert (p.weights, p.gradients, p.adam, p.ema, p.weight_copies, p.activations, p.loss) == \
        (6464, 5952, 11904, 0, 2656, 4592, 1184)
    assert p.total == 32752
    assert peak_memory(TINY, TrainConfig(), M_S, M_T, "fp16") == p  # the same bytes


def test_tiny_model_fp32_and_the_variants_by_hand():
    """fp32 (b = 4, no copies): self-attention 4*40 + 8 = 168, cross 4*24 + 8 = 104 and 4*16 = 64 per
    source token, FFN 4*24 = 96, plus the encoder output once, 4*8: source 168 + 96 + 96 + 64 + 16 + 32 = 472,
    target 168 + 104 + 96 + 144 + 16 = 528; 6*472 + 8*528 = 7056; fused loss 576 + 4*64 + 4*80 = 1152.
    Unfused (bf16): 2*2*8*10 + 2*8*8 + 8*8 = 512; R-Drop: twice the activations and that loss.
    Pre-norm: a final LayerNorm per stack, (4*8 + 8) per token: 14*40 = 560 more. The moving average 4P."""
    p = peak_memory(TINY, TrainConfig(), M_S, M_T, "fp32")
    assert (p.weight_copies, p.activations, p.loss) == (0, 7056, 1152)
    assert loss_bytes(TINY, M_T, 2, fused=False) == 512
    assert peak_memory(TINY, TrainConfig(fused_loss="off"), M_S, M_T, "bf16").loss == 512
    rdrop = peak_memory(TINY, TrainConfig(rdrop_alpha=1.0), M_S, M_T, "bf16")
    assert (rdrop.activations, rdrop.loss) == (2 * 4592, 2 * 512)
    pre = ModelConfig(**{**vars(TINY), "pre_norm": True})
    assert activation_bytes(pre, M_S, M_T, 2) == 4592 + 560
    assert peak_memory(TINY, TrainConfig(ema_decay=0.999), M_S, M_T, "bf16").ema == 4 * 1488


def test_estimate_prints_the_peak_and_base_fits_16_gb_at_25000_tokens(capsys):
    """The WMT14 base recipe with the paper's 25,000 tokens in one batch on one device, bf16: under
    16 GB by the estimate (docs/gpu.md); the JSON and the text say the same total."""
    args = ["estimate", "--recipe", str(RECIPES / "wmt14-ende-base.json"), "--gpus", "1", "--device", "h100",
            "--tokens-per-step", "25000", "--max-device-tokens", "25000"]
    assert main(args + ["--json"]) == 0
    peak = json.loads(capsys.readouterr().out)["peak_memory"]
    assert (peak["src_tokens"], peak["tgt_tokens"], peak["precision"]) == (25000, 25000, "bf16")
    assert peak["total"] < 16e9
    assert main(args) == 0
    assert f"peak memory per device: {peak['total'] / 2**30:.1f} GiB at 25,000 + 25,000 tokens a batch, bf16" \
        in capsys.readouterr().out
