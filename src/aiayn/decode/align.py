"""Word alignments from encoder-decoder attention (§3.2.3), in the Pharaoh format of fast_align.

    translator.attention(src_ids, tokens, eos)["cross"]   # (L, H, T, S), teacher-forced
    hard_alignment(cross, layer=-1, n_src, n_tgt)         # [(i, j), ...]
    pharaoh(pairs)                                        # "0-0 1-2 2-1"

The argmax rule most tools use (fairseq's ``--print-alignment``, Marian's ``--alignment``): each
target token j is aligned to the source token i that the chosen layer's encoder-decoder attention,
averaged over its heads, weights most when the decoder predicts j. The EOS that ends the source
and the EOS the model generates take no part (their row and column are dropped), so i and j
index the source and target subword tokens (SentencePiece pieces) from 0. Which layer aligns
best depends on the model (Garg et al., 2019 found the penultimate one for a 6-layer model);
the default is the last.
"""
from __future__ import annotations

import numpy as np

from aiayn.errors import UserError


def check_layer(layer: int, n_layers: int) -> None:
    """``layer`` must index one of ``n_layers`` decoder layers (negative from the last)."""
    if not -n_layers <= layer < n_layers:
        raise UserError(f"--alignment-layer {layer}: the model has {n_layers} decoder layers "
                        f"(0..{n_layers - 1}, or -1..-{n_layers})")


def hard_alignment(cross: np.ndarray, layer: int, n_src: int, n_tgt: int) -> list[tuple[int, int]]:
    """(i, j) pairs, one per target token j < n_tgt: i = argmax over the first n_src source tokens of
    ``cross[layer]`` (H, T, S) averaged over heads. ``layer`` indexes the decoder layers (negative
    from the last). Empty when either side is."""
    check_layer(layer, cross.shape[0])
    if n_src == 0 or n_tgt == 0:
        return []
    weights = cross[layer].mean(axis=0)[:n_tgt, :n_src]  # (T, S) heads averaged
    return [(int(i), j) for j, i in enumerate(weights.argmax(axis=1))]


def pharaoh(pairs: list[tuple[int, int]]) -> str:
    """"i-j" pairs separated by spaces (source index first), as fast_align and Marian print them."""
    return " ".join(f"{i}-{j}" for i, j in pairs)
