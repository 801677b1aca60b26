"""``aiayn presets``: the named configurations and their exact parameter counts."""
from __future__ import annotations

import json

from aiayn.config import to_dict
from aiayn.errors import UserError
from aiayn.model.config import LIMITS, PAPER_PARAMS_M, PRESETS, get_preset
from aiayn.model.transformer import count_preset_parameters
from aiayn.train.config import run_config_from_preset

TABLE3_TRAIN = ("eps_ls", "max_steps")  # Table 3's columns that are training settings: ε_ls, train steps


def preset_rows(vocab_size: int | None) -> list[dict]:
    """Each preset's exact count (with ``vocab_size`` where given: within ``LIMITS``) beside the paper's
    Table 3 figure; ``rel_diff_vs_paper`` unrounded; ``train``: Table 3's training columns, ε_ls and the
    steps (D3 and D4 differ from base only in ε_ls, which the model section cannot show)."""
    if vocab_size is not None:
        lo, hi = LIMITS["vocab_size"]
        if not lo <= vocab_size <= hi:
            raise UserError(f"--vocab-size {vocab_size}: outside [{lo:,}, {hi:,}]")
    rows = []
    for name in PRESETS:
        overrides = {"vocab_size": vocab_size} if vocab_size is not None else {}
        cfg = get_preset(name, **overrides)
        params = count_preset_parameters(cfg)
        paper = PAPER_PARAMS_M.get(name)
        train = to_dict(run_config_from_preset(name).train)
        rows.append({"name": name, "params": params,
                     "paper_params_M": paper,
                     "rel_diff_vs_paper": None if paper is None else params / (paper * 1e6) - 1,
                     "config": to_dict(cfg), "train": {k: train[k] for k in TABLE3_TRAIN}})
    return rows


def run(args) -> int:
    rows = preset_rows(args.vocab_size)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'name':<8} {'N':>2} {'d_model':>7} {'d_ff':>5} {'h':>3} {'d_k':>4} {'d_v':>4} {'P_drop':>6} "
          f"{'eps_ls':>6} {'steps':>7} {'params':>12} {'paper':>6} {'diff':>7}")
    for r in rows:
        c, t = r["config"], r["train"]
        paper = "" if r["paper_params_M"] is None else f"{r['paper_params_M']}M"
        diff = "" if r["rel_diff_vs_paper"] is None else f"{100 * r['rel_diff_vs_paper']:+.1f}%"
        print(f"{r['name']:<8} {c['n_layers']:>2} {c['d_model']:>7} {c['d_ff']:>5} {c['n_heads']:>3} "
              f"{c['d_k']:>4} {c['d_v']:>4} {c['p_drop']:>6} {t['eps_ls']:>6} "
              f"{t['max_steps']:>7,} {r['params']:>12,} {paper:>6} {diff:>7}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("presets", help="list the named model configurations with exact parameter counts",
                       allow_abbrev=False)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="shared vocabulary size to count with (default: each preset's own)")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per preset")
    p.set_defaults(func=run)
