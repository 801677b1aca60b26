"""Parameter counts: exact counts, a hand-derived formula, and the paper's Table 3 column."""
from __future__ import annotations

import json

import pytest

import aiayn
from aiayn.cli import main
from aiayn.model.config import PAPER_PARAMS_M
from aiayn.model.transformer import count_parameters, count_preset_parameters


def formula(cfg) -> int:
    """Hand count: shared V x D embedding once; per layer attention (with biases), FFN, LayerNorms."""
    D, F, H, K, Dv, N, V = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.n_layers, cfg.vocab_size
    attn = D * H * K * 2 + H * K * 2 + D * H * Dv + H * Dv + H * Dv * D + D
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
    # 37000*512 + 6*3,152,384 + 6*4,204,032
    assert count_preset_parameters(aiayn.get_preset("base", vocab_size=37000)) == 63_082_496


# The paper's column is not consistent with any single vocabulary size under an exact count with
# one shared V x D matrix: every row except big implies V of about 41,000, big implies about 35,800
# (see docs/parameter-counts.md). At V = 37,000 (the check) big and C7 land within 2% and
# the others 2.4-6.5% low. These deviations are measured facts of the architecture, pinned here.
DEVIATION_AT_37K = {"base": -0.0295, "B1": -0.0347, "B2": -0.0274, "C1": -0.0651, "C2": -0.0326,
                    "C3": -0.0276, "C4": -0.0416, "C5": -0.0245, "C6": -0.0474, "C7": -0.0192,
                    "big": 0.0058}


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
    """C5 is 2.447% under the paper at V = 37,000: -2.4% in the table (not -2.5% from a rounded ratio)."""
    assert main(["presets", "--vocab-size", "37000"]) == 0
    c5 = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("C5 "))
    assert c5.split()[-1] == "-2.4%"
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
    # attention: 4 x 1,024^2 + 4 x 1,024 = 4,198,400; FFN: 2 x 1,024 x 2,048 + 2,048 + 1,024 = 4,197,376;
    # encoder layer 4,198,400 + 4,197,376 + 2 x 2,048 = 8,399,872; decoder layer 2 x 4,198,400 + 4,197,376
    # + 3 x 2,048 = 12,600,320; 16,000 x 1,024 = 16,384,000 shared
    assert count_preset_parameters(cfg) == 16_384_000 + 4 * (8_399_872 + 12_600_320) == 100_384_768
