"""Attention heat maps of a translation: the pictures of the paper's Figures 3-5.

For one source sentence the translator's best output is recomputed teacher-forced with
``need_weights=True`` (``Translator.attention``), so the plotted weights are exactly the ones
the model returns. One PNG per kind (encoder self-attention, decoder self-attention,
encoder-decoder attention) and layer, each a grid of the H heads with query tokens on the
rows and key tokens on the columns (every row sums to 1 over the keys).

Shapes: L layers, H heads, Q queries (rows), K keys (columns), S source, T target length.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from aiayn.errors import UserError, WriteError
from aiayn.files import atomic_write

log = logging.getLogger(__name__)

# kind -> (title, query side, key side); a decoder position's keys are the decoder's inputs (BOS,
# then the output shifted right), its row the token it predicts (``Translator.attention``)
KINDS: dict[str, tuple[str, str, str]] = {
    "encoder": ("encoder self-attention", "src_tokens", "src_tokens"),
    "decoder_self": ("decoder self-attention", "tgt_tokens", "tgt_in_tokens"),
    "cross": ("encoder-decoder attention", "tgt_tokens", "src_tokens"),
}


def agg_pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


MAP_INCHES = 8.0  # a head's heat map at most, on its longer side: a long sentence gets smaller cells, not a huge figure
LABEL_INCHES = 0.06  # the room a tick label takes across (4-point text): smaller cells label every n-th token


def attention_figure(weights: np.ndarray, rows: list[str], cols: list[str], title: str):
    """A grid of heat maps, one per head, and the colour scale of the weights (0 to 1). weights (H,Q,K);
    rows: Q query tokens; cols: K key tokens. A head's map is at most ``MAP_INCHES`` on a side; where
    its cells are too small to label each token, every n-th is labelled (the title says so)."""
    plt = agg_pyplot()
    H, Q, K = weights.shape
    n_cols = H if H <= 2 else (2 if H <= 4 else 4)
    n_rows = math.ceil(H / n_cols)
    cell = min(0.28, MAP_INCHES / max(Q, K))  # inches per token: square cells, bounded figure
    font = min(8.0, max(4.0, 30.0 * cell))
    every = math.ceil(LABEL_INCHES / cell - 1e-9)  # (1 where a label fits each cell)
    fig, axes = plt.subplots(n_rows, n_cols, squeeze=False, constrained_layout=True,
                             figsize=(n_cols * (cell * K + 1.3) + 1.0, n_rows * (cell * Q + 1.5) + 0.4))
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.axis("off")
            continue
        image = ax.imshow(weights[h], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        ax.set_title(f"head {h + 1}", fontsize=9)
        ax.set_xticks(range(0, K, every), cols[::every], rotation=90, fontsize=font)
        ax.set_yticks(range(0, Q, every), rows[::every], fontsize=font)
    fig.colorbar(image, ax=axes, shrink=min(1.0, 3.0 / (n_rows * (cell * Q + 1.5))), label="attention weight")
    fig.suptitle(title + (f" (one token in {every} labelled)" if every > 1 else ""))
    return fig


def attention_maps(translator, src_text: str) -> dict[str, object]:
    """Pieces and weights (``Translator.attention``) of the best translation of ``src_text``."""
    ids = translator.encode([src_text])[0]
    if not ids:
        raise UserError("--src: the sentence is empty (no subword tokens); nothing to plot")
    hyps = translator.translate_ids([ids])[0]
    best = hyps[0]
    maps = translator.attention(ids, best.tokens, best.eos)
    maps["translation"] = translator.tgt_tok.decode(best.tokens)
    return maps


def plot_attention(translator, src_text: str, out_dir: str | Path) -> list[Path]:
    """Translate ``src_text`` and write one heat-map grid PNG per attention kind and layer.

    Files: ``{encoder,decoder_self,cross}_layer{1..L}.png`` in ``out_dir``; returns their paths.
    """
    out_dir = Path(out_dir)
    maps = attention_maps(translator, src_text)
    log.info("translation: %s", maps["translation"])
    paths = []
    for kind, (title, q_side, k_side) in KINDS.items():
        stack = maps[kind]  # (L,H,Q,K)
        for layer, weights in enumerate(stack, 1):
            fig = attention_figure(weights, maps[q_side], maps[k_side], f"{title}, layer {layer}")
            paths.append(save_figure(fig, out_dir / f"{kind}_layer{layer}.png"))
    return paths


def save_figure(fig, out: str | Path) -> Path:
    """Write ``fig`` as a PNG (creating the directory) in one step (``atomic_write``: an interrupted
    write leaves the earlier file whole), close it, return the path. A write that fails (a full
    disk, a folder that refuses it) is a WriteError naming ``out``."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=100))
    except OSError as exc:
        raise WriteError(f"{out}: cannot write ({exc.strerror or exc}); an earlier figure there is intact") from None
    finally:
        agg_pyplot().close(fig)
    return out
