"""Plots of the training recipe, drawn from the training code itself.

- ``plot_lr``: the learning rate of Eq. 3 (§5.3) over steps for (d_model, warmup_steps)
  pairs, as the Annotated Transformer draws for (512, 4000), (512, 8000), (256, 4000).
- ``plot_smoothing``: the label-smoothed target distribution q of §5.4 for a few targets
  (rows) over the vocabulary (columns), from ``aiayn.train.objective.smoothed_targets``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from aiayn.train.objective import noam_lr, smoothed_targets
from aiayn.viz.attention import agg_pyplot, save_figure

LR_PAIRS: tuple[tuple[int, int], ...] = ((512, 4000), (512, 8000), (256, 4000))


def lr_curves(pairs, steps: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1..steps (N,) and Eq. 3's learning rates (P, N), one row per (d_model, warmup) pair."""
    x = np.arange(1, steps + 1)
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


def plot_smoothing(out: str | Path, targets=(2, 1, 0, 3, 3), vocab_size: int = 5, eps_ls: float = 0.4,
                   pad_id: int = 0) -> Path:
    """Write the heat map of q = smoothed_targets(targets) (N targets x V tokens) to the PNG ``out``."""
    plt = agg_pyplot()
    q = smoothed_targets(torch.tensor(targets), vocab_size, eps_ls, pad_id).numpy()  # (N,V)
    fig, ax = plt.subplots(figsize=(1.2 + 0.8 * vocab_size, 1.2 + 0.6 * len(targets)), constrained_layout=True)
    ax.imshow(q, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    if vocab_size <= 30:
        for (n, v), p in np.ndenumerate(q):
            ax.text(v, n, f"{p:.2f}", ha="center", va="center", fontsize=8, color="w" if p < 0.5 else "k")
    ax.set_xticks(range(vocab_size))
    ax.set_yticks(range(len(targets)), [f"target {t}" + (" (pad)" if t == pad_id else "") for t in targets])
    ax.set_xlabel("vocabulary id")
    ax.set_title(f"label smoothing (§5.4), eps_ls={eps_ls:g}, pad id {pad_id}")
    return save_figure(fig, out)

