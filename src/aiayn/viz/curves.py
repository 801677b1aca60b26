"""Plots of the training recipe, drawn from the training code itself.

- ``plot_lr``: the learning rate of Eq. 3 (§5.3) over steps for (d_model, warmup_steps)
  pairs, as the Annotated Transformer draws for (512, 4000), (512, 8000), (256, 4000).
- ``plot_smoothing``: the label-smoothed target distribution q of §5.4 for a few targets
  (rows) over the vocabulary (columns), from ``aiayn.train.objective.smoothed_targets``.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from matplotlib.ticker import MaxNLocator

from aiayn.train.objective import noam_lr, smoothed_targets
from aiayn.viz.attention import agg_pyplot, save_figure

LR_PAIRS: tuple[tuple[int, int], ...] = ((512, 4000), (512, 8000), (256, 4000))


LR_POINTS = 4000  # steps a curve is drawn at, at most: smooth at any --steps, in bounded time and memory


def lr_steps(steps: int, corners=()) -> np.ndarray:
    """The steps (N,) a rate curve over 1..steps is drawn at: each of them up to ``LR_POINTS``, else
    ``LR_POINTS`` evenly spaced ones and the ``corners`` in range (Eq. 3's peak at each warmup's end),
    so that a corner is drawn where it is and not cut off between two points."""
    if steps <= LR_POINTS:
        return np.arange(1, steps + 1)
    x = np.linspace(1, steps, LR_POINTS).round().astype(np.int64)
    return np.unique(np.concatenate([x, [int(c) for c in corners if 1 <= c <= steps]]).astype(np.int64))


def lr_curves(pairs, steps: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Steps (N,) from 1 to ``steps`` (``lr_steps``) and Eq. 3's learning rates (P, N), one row per
    (d_model, warmup) pair."""
    x = lr_steps(steps, [w for _, w in pairs])
    return x, np.array([[noam_lr(int(s), d, w, scale) for s in x] for d, w in pairs])


def plot_lr(out: str | Path, pairs=LR_PAIRS, steps: int = 20000, scale: float = 1.0) -> Path:
    """Write the Eq. 3 curves of ``pairs`` to the PNG ``out``."""
    plt = agg_pyplot()
    x, lrs = lr_curves(pairs, steps, scale)
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for (d, w), y in zip(pairs, lrs):
        ax.plot(x, y, label=f"d_model={d}, warmup={w}")
    ax.set_xlabel("training step")
    ax.set_ylabel("learning rate")
    ax.set_title("Eq. 3: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)" + (f" x {scale:g}" if scale != 1 else ""))
    ax.legend()
    ax.grid(alpha=0.3)
    return save_figure(fig, out)


SMOOTHING_NUMBERS = 30  # vocabularies up to this size get each probability written in its cell
SMOOTHING_MAX = 200  # tokens (columns) and targets (rows) drawn at most: each still some pixels wide


def plot_smoothing(out: str | Path, targets=(2, 1, 0, 3, 3), vocab_size: int = 5, eps_ls: float = 0.4,
                   pad_id: int = 0) -> Path:
    """Write the heat map of q = smoothed_targets(targets) (N targets x V tokens) to the PNG ``out``.
    Up to ``SMOOTHING_NUMBERS`` tokens each cell shows its probability; a larger vocabulary, up to
    ``SMOOTHING_MAX``, gets a colour scale instead, in a figure of bounded size (at most 10 inches of
    tokens across and 8 of targets down; the rows labelled every n-th where they are too many to fit).
    A real model's vocabulary (37,000) would leave a token less than a pixel: its column would vanish."""
    if not (3 <= vocab_size <= SMOOTHING_MAX and 1 <= len(targets) <= SMOOTHING_MAX):
        raise ValueError(f"vocab_size {vocab_size} and {len(targets)} targets: each must be in [3, {SMOOTHING_MAX}]")
    plt = agg_pyplot()
    q = smoothed_targets(torch.tensor(targets), vocab_size, eps_ls, pad_id).numpy()  # (N,V)
    N = len(targets)
    cell_w, cell_h = min(0.8, 10.0 / vocab_size), min(0.6, 8.0 / N)  # inches per token, per target
    numbers = vocab_size <= SMOOTHING_NUMBERS
    fig, ax = plt.subplots(figsize=((1.2 if numbers else 2.2) + cell_w * vocab_size, 1.2 + cell_h * N),
                           constrained_layout=True)
    image = ax.imshow(q, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    if numbers:
        for (n, v), p in np.ndenumerate(q):
            ax.text(v, n, f"{p:.2f}", ha="center", va="center", fontsize=8, color="w" if p < 0.5 else "k")
        ax.set_xticks(range(vocab_size))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(image, ax=ax, label="q")
    every = math.ceil(0.15 / cell_h - 1e-9)  # a row label takes some 0.15 inches (8-point text)
    ax.set_yticks(range(0, N, every), [f"target {t}" + (" (pad)" if t == pad_id else "") for t in targets][::every])
    ax.set_xlabel("vocabulary id")
    ax.set_title(f"label smoothing (§5.4), eps_ls={eps_ls:g}, pad id {pad_id}")
    return save_figure(fig, out)
