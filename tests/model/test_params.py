"""Parameter counts: exact counts, a hand-derived formula, and the paper's Table 3 column."""
from __future__ import annotations

import json

import pytest

import aiayn
from aiayn.cli import main
from aiayn.model.config import PAPER_PARAMS_M
from aiayn.model.transformer import count_parameters, count_preset_parameters


def formula(cfg) -> int:
    """Hand count: shared V x D embedding once; per layer attention (W^Q, W^K, W^V, W^O of §3.2.2, their
    biases where ``attn_bias``), FFN, LayerNorms."""
    D, F, H, K, Dv, N, V = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.n_layers, cfg.vocab_size
    attn = D * H * K * 2 + D * H * Dv + H * Dv * D + (H * K * 2 + H * Dv + D if cfg.attn_bias else 0)
    ffn = D * F + F + F * D + D
    ln = 2 * D
    enc = attn + ffn + 2 * ln
    dec = 2 * attn + ffn + 3 * ln
    final = 2 * ln if cfg.pre_norm else 0
    learned = 2 * cfg.max_positions * D if cfg.learned_positions else 0
    return V * D + N * enc + N * dec + final + learned


@pytest.mark.parametrize("name", list(aiayn.model.PRESETS))
def test_exact_count_matches_hand_formula(name):
    cfg = aiayn.get_preset(name, vocab_size=37000)
    assert count_preset_parameters(cfg) == formula(cfg)


def test_meta_count_equals_real_model_count():
    cfg = aiayn.get_preset("tiny", vocab_size=1000)
    assert count_parameters(aiayn.Transformer(cfg)) == count_preset_parameters(cfg) == formula(cfg)


def test_base_hand_computed_number():
    # attention 4 x 512^2 = 1,048,576; FFN 2 x 512 x 2,048 + 2,048 + 512 = 2,099,712; LayerNorm 2 x 512:
    # encoder layer 1,048,576 + 2,099,712 + 2 x 1,024 = 3,150,336; decoder layer 2 x 1,048,576 + 2,099,712
    # + 3 x 1,024 = 4,199,936; 37000*512 + 6*3,150,336 + 6*4,199,936
    assert count_preset_parameters(aiayn.get_preset("base", vocab_size=37000)) == 63_045_632
    # with attn_bias (not in the paper): 4 x 512 more in each attention, 6 x (2,048 + 2 x 2,048) in all
    assert count_preset_parameters(aiayn.get_preset("base", vocab_size=37000, attn_bias=True)) == 63_082_496


# The paper's column is not consistent with any single vocabulary size under an exact count with
# one shared V x D matrix: every row except big implies V of about 41,000, big implies about 35,800
# (see docs/parameter-counts.md). At V = 37,000 big and C7 land within 2% and the others
# 2.5-6.5% low. These deviations are measured facts of the architecture, pinned here.
DEVIATION_AT_37K = {"base": -0.0301, "B1": -0.0350, "B2": -0.0279, "C1": -0.0654, "C2": -0.0331,
                    "C3": -0.0282, "C4": -0.0423, "C5": -0.0249, "C6": -0.0481, "C7": -0.0196,
                    "big": 0.0055}


def test_presets_json_cli(capsys):
    assert main(["presets", "--vocab-size", "37000", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for name in ["base", "big"] + [f"A{i}" for i in range(1, 5)] + ["B1", "B2"] + \
            [f"C{i}" for i in range(1, 8)] + [f"D{i}" for i in range(1, 5)] + ["E", "parsing"]:
        assert name in rows and rows[name]["params"] > 0
    for name, paper in PAPER_PARAMS_M.items():
        rel = rows[name]["params"] / (paper * 1e6) - 1
        assert rel == pytest.approx(DEVIATION_AT_37K[name], abs=5e-4), name
    assert abs(rows["big"]["params"] / 213e6 - 1) < 0.02
    assert abs(rows["C7"]["params"] / 90e6 - 1) < 0.02


def test_paper_counts_within_2_percent_at_fitted_vocabulary():
    # With V = 41,000 every row but big lands within 2% of the paper's figure.
    for name, paper in PAPER_PARAMS_M.items():
        rel = count_preset_parameters(aiayn.get_preset(name, vocab_size=41000)) / (paper * 1e6) - 1
        if name == "big":
            assert 0.02 < rel < 0.03
        else:
            assert abs(rel) < 0.02, (name, rel)


def test_presets_table_rounds_once_and_refuses_a_vocabulary_outside_the_limits(capsys):
    """big is 0.5501% over the paper at V = 37,000: +0.6% in the table (not +0.5% from a rounded ratio)."""
    assert main(["presets", "--vocab-size", "37000"]) == 0
    big = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("big "))
    assert big.split()[-1] == "+0.6%"
    for bad in ("-5", "0", "3"):
        assert main(["presets", "--vocab-size", bad]) == 2
        assert f"aiayn presets: error: --vocab-size {bad}: outside [4, 2,097,152]" in capsys.readouterr().err


def test_presets_show_the_label_smoothing_of_rows_d3_and_d4(capsys):
    """D3 and D4 change ε_ls alone (a training setting): the table and the JSON say so, where the
    model columns alone printed them as copies of base."""
    assert main(["presets"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    header_eps = 8  # name N d_model d_ff h d_k d_v P_drop eps_ls
    assert (rows["base"][header_eps], rows["D3"][header_eps], rows["D4"][header_eps]) == ("0.1", "0.0", "0.2")
    assert main(["presets", "--json"]) == 0
    train = {r["name"]: r["train"] for r in json.loads(capsys.readouterr().out)}
    assert (train["D3"], train["D4"], train["base"], train["big"]) == (
        {"eps_ls": 0.0, "max_steps": 100_000}, {"eps_ls": 0.2, "max_steps": 100_000},
        {"eps_ls": 0.1, "max_steps": 100_000}, {"eps_ls": 0.1, "max_steps": 300_000})


def test_parsing_preset_is_the_base_model_with_4_layers_at_d_model_1024():
    """§6.3: "a 4-layer transformer with d_model = 1024", "all other parameters remained unchanged from
    the English-to-German base translation model": d_ff 2048 and h = 8, so d_k = d_v = d_model / h = 128,
    as in Table 3's row C5 (d_model 1024, the rest as base), with the WSJ-only setting's 16K vocabulary."""
    cfg = aiayn.get_preset("parsing")
    assert (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.p_drop, cfg.vocab_size) == \
        (4, 1024, 2048, 8, 128, 128, 0.1, 16_000)
    assert cfg == aiayn.get_preset("C5", n_layers=4, vocab_size=16_000)
    # attention: 4 x 1,024^2 = 4,194,304; FFN: 2 x 1,024 x 2,048 + 2,048 + 1,024 = 4,197,376;
    # encoder layer 4,194,304 + 4,197,376 + 2 x 2,048 = 8,395,776; decoder layer 2 x 4,194,304 + 4,197,376
    # + 3 x 2,048 = 12,592,128; 16,000 x 1,024 = 16,384,000 shared
    assert count_preset_parameters(cfg) == 16_384_000 + 4 * (8_395_776 + 12_592_128) == 100_335_616
