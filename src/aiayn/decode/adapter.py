"""``StepDecoder``s over ``aiayn.Transformer`` for the search in ``aiayn.decode.search``.

``CachedDecoder`` is the one to use: encoder-decoder keys/values are computed once per
sentence and self-attention keys/values are kept in the model's ``DecoderCache`` (one new
position per step). ``RecomputeDecoder`` re-runs the decoder over the whole prefix at every
step; it exists as the reference the cache is tested against and as the "no cache" baseline
of the speed measurement. ``EnsembleDecoder`` decodes with several models at once (the mean of
their next-token probabilities).

Shapes: B sentences, N decoding rows (sentences x beams), S source length, t prefix length,
V target vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from aiayn.kernels.loader import Kernels
from aiayn.decode.search import beam_rows, reads_wait, reorder_state
from aiayn.decode.topk import select_topk
from aiayn.decode.cache import DecoderCache, LayerCache, init_cache, share_slots
from aiayn.model import EncoderOutput, Transformer


def log_softmax_rows(logits: Tensor) -> Tensor:
    """(N, V) log-probabilities, in float32 unless the model runs in float64.

    On CPU the result overwrites a contiguous float32 ``logits`` (or its float32 copy, for bf16
    models): the kernel reads a row before it writes it, so the values are those of the
    out-of-place call (tested), without a second (N, V) buffer. ``logits`` is not used again.
    Elsewhere (CUDA upcasts bf16 inside the kernel) the call is out of place.
    """
    if logits.dtype == torch.float64:
        return logits.log_softmax(dim=-1)
    if logits.device.type != "cpu" or not logits.is_contiguous():
        return logits.log_softmax(dim=-1, dtype=torch.float32)
    x = logits.float()  # the same tensor when logits are float32
    return torch.log_softmax(x, dim=-1, out=x)


def _encoder_rows(entries: Tensor) -> tuple[int, Tensor]:
    """Group new decoder rows by the encoder-side row they read (entries (N',)).

    Returns (g, rows): g is the largest run length such that every block of g consecutive
    rows reads one encoder row (beam search: g = beam size), rows (N'/g,) those encoder rows.
    Anything else falls back to g = 1, one encoder-side row per decoder row.
    """
    n = entries.numel()
    runs = torch.unique_consecutive(entries).numel()
    if runs and n % runs == 0 and n // runs > 1:
        g = n // runs
        blocks = entries.view(runs, g)
        if bool((blocks == blocks[:, :1]).all()):
            return g, blocks[:, 0].contiguous()
    return 1, entries


@dataclass
class CachedState:
    """The model's ``DecoderCache`` plus what makes beam reordering cheap.

    Beam search (``share_slots``, the default): when the search first expands each sentence to
    K rows, the cache switches to shared beam slots (``DecoderCache.ancestors``): reordering
    the beams of a sentence then moves only the ancestor table, and keys/values are copied only
    when a sentence leaves the batch (``_reorder_shared``).

    The copying cache (``share_slots=False``, and the fallback for reorders that do not keep K
    rows per sentence): ``reorder`` keeps the encoder-decoder keys/values untouched while every
    row still decodes the same sentence as before (beams reordered within a sentence); they are
    gathered only when sentences leave the batch. For the self-attention keys/values it takes
    the cheaper of two exact paths:
    - few rows move (at most half: a beam usually keeps extending its own hypothesis): only
      the moved rows are copied, in place: their sources are gathered first, then written;
    - otherwise the filled part is gathered into preallocated spare buffers (no fresh
      allocation per step), which then become the cache.
    Either way the copy is the filled length only. A reordered state takes over the buffers
    of the old one: the old state must not be used again (as with the cache itself, which
    ``decode`` advances in place).
    """

    cache: DecoderCache
    sentence: Tensor  # (N,) the source sentence each row decodes
    spare: list[tuple[Tensor, Tensor]] | None = None  # per layer (N',H,Tmax,K), (N',H,Tmax,Dv)

    share_slots: bool = True  # group rows into shared beam slots when beam search expands them

    def reorder(self, idx: Tensor) -> "CachedState":
        c, n = self.cache, idx.numel()
        if c.shared_slots:
            group, enc_rows = _encoder_rows(idx // c.group)
            if group != c.group:  # not g rows per sentence: the plain layout
                return CachedState(c.unshared(), self.sentence, None, share_slots=False).reorder(idx)
            same = enc_rows.numel() == c.src_pad.size(0) and torch.equal(
                enc_rows, torch.arange(enc_rows.numel(), device=idx.device))
            return self._reorder_shared(idx, None if same else enc_rows)
        sentence = self.sentence.index_select(0, idx)
        same_rows = sentence.shape == self.sentence.shape and torch.equal(sentence, self.sentence)
        if same_rows:
            moved = (idx != torch.arange(n, device=idx.device)).nonzero().squeeze(1)  # (m,)
            if 2 * moved.numel() <= n:
                self._move_rows_in_place(moved, idx.index_select(0, moved))
                return CachedState(c, sentence, self.spare, self.share_slots)
            return self._copy_rows(idx, sentence, c.group, None)
        return self._copy_rows(idx, sentence, *_encoder_rows(idx // c.group))

    def reorder_beams(self, keep: Tensor | None, parent: Tensor | None) -> "CachedState":
        """``reorder`` of the rows keep[i] * g + parent[i, j] (``search.beam_rows``: ``keep`` (B',) the
        sentences that go on, None for all; ``parent`` (B', g), None for g = 1), told that structure:
        nothing is read back to find it in the indices (on a GPU each read waits for the device)."""
        c = self.cache
        g = 1 if parent is None else parent.size(1)
        idx = beam_rows(keep, parent, g)
        if g != c.group:
            return self.reorder(idx)
        if c.shared_slots:
            return self._reorder_shared(idx, keep)
        sentence = self.sentence.index_select(0, idx)
        if keep is not None:
            return self._copy_rows(idx, sentence, g, keep)
        if reads_wait(idx.device):
            return self._copy_rows(idx, sentence, g, None)
        return self.reorder(idx)  # on the CPU: moves only the rows that change, where few do

    def _copy_rows(self, idx: Tensor, sentence: Tensor, group: int, enc_rows: Tensor | None) -> "CachedState":
        """The copying cache's reorder: new row i continues old row idx[i], in the sentence of
        ``sentence[i]``; g = ``group`` new rows read each of the encoder-side rows ``enc_rows`` (None:
        the same sentences as before, in the same order)."""
        c, n, L = self.cache, idx.numel(), self.cache.length
        if enc_rows is not None and self.share_slots and group > 1 and c.group == 1 and L == 0:  # beam search starts
            enc = [LayerCache(lc.self_k, lc.self_v, lc.cross_k.index_select(0, enc_rows),
                              lc.cross_v.index_select(0, enc_rows)) for lc in c.layers]
            cache = share_slots(enc, c.src_pad.index_select(0, enc_rows), group, c.capacity, c.kernels)
            return CachedState(cache, sentence, None, self.share_slots)
        spare = self.spare  # (allocated only here: the shared-slot cache above needs none)
        if spare is None or spare[0][0].size(0) < n or spare[0][0].size(2) != c.capacity:
            spare = [(torch.empty((n,) + lc.self_k.shape[1:], dtype=lc.self_k.dtype, device=lc.self_k.device),
                      torch.empty((n,) + lc.self_v.shape[1:], dtype=lc.self_v.dtype, device=lc.self_v.device))
                     for lc in c.layers]
        layers = []
        for lc, (k, v) in zip(c.layers, spare):
            k, v = k[:n], v[:n]
            torch.index_select(lc.self_k[:, :, :L], 0, idx, out=k[:, :, :L])
            torch.index_select(lc.self_v[:, :, :L], 0, idx, out=v[:, :, :L])
            cross_k = lc.cross_k if enc_rows is None else lc.cross_k.index_select(0, enc_rows)
            cross_v = lc.cross_v if enc_rows is None else lc.cross_v.index_select(0, enc_rows)
            layers.append(LayerCache(k, v, cross_k, cross_v))
        src_pad = c.src_pad if enc_rows is None else c.src_pad.index_select(0, enc_rows)
        old = [(lc.self_k, lc.self_v) for lc in c.layers]
        return CachedState(DecoderCache(layers, src_pad, L, group, kernels=c.kernels), sentence, old, self.share_slots)

    def _reorder_shared(self, idx: Tensor, enc_rows: Tensor | None) -> "CachedState":
        """Shared beam slots: new row i continues old row idx[i], g new rows for each of the
        sentences ``enc_rows`` (None: all, in order). Within a sentence only the ancestor table
        moves; sentences that leave are dropped from the buffers (their filled part copied once)."""
        c, L, g = self.cache, self.cache.length, self.cache.group
        sentence = self.sentence.index_select(0, idx)
        Bs = idx.numel() // g
        parent = (idx % g).view(Bs, g, 1)  # slot of each new row's parent, within its sentence
        anc = c.ancestors if enc_rows is None else c.ancestors.index_select(0, enc_rows)
        if L:
            anc[:, :, :L] = anc[:, :, :L].gather(1, parent.expand(Bs, g, L))  # gathered, then written
        if enc_rows is None:
            return CachedState(DecoderCache(c.layers, c.src_pad, L, g, anc, c.kernels), sentence, None, True)
        layers = []
        for lc in c.layers:
            bufs = []
            for buf in (lc.self_k, lc.self_v):
                new = buf.new_empty((Bs,) + tuple(buf.shape[1:]))
                if L:
                    torch.index_select(buf[:, :, : L * g], 0, enc_rows, out=new[:, :, : L * g])
                bufs.append(new)
            layers.append(LayerCache(bufs[0], bufs[1], lc.cross_k.index_select(0, enc_rows),
                                     lc.cross_v.index_select(0, enc_rows)))
        return CachedState(DecoderCache(layers, c.src_pad.index_select(0, enc_rows), L, g, anc, c.kernels),
                           sentence, None, True)

    def _move_rows_in_place(self, rows: Tensor, sources: Tensor) -> None:
        """Row rows[i] of every self-attention buffer becomes (old) row sources[i]."""
        L = self.cache.length
        if rows.numel() == 0 or L == 0:
            return
        for lc in self.cache.layers:
            for buf in (lc.self_k, lc.self_v):
                filled = buf[:, :, :L]  # (N,H,L,K)
                filled.index_copy_(0, rows, filled.index_select(0, sources))  # gather first, then write


class CachedDecoder:
    """Incremental decoding with the model's ``DecoderCache`` (wrapped in ``CachedState``)."""

    def __init__(self, model: Transformer, share_slots: bool = True, kernels: Kernels | None = None):
        self.model = model
        self.share_slots = share_slots  # shared beam slots (``DecoderCache``); False = copy on reorder
        self.kernels = kernels  # C kernels for the attention of shared-slot steps (kernels/loader.py), or None

    def start(self, src: Tensor, max_len: int) -> CachedState:
        """src (B, S) -> a cache of B rows with room for max_len decoder positions."""
        cache = init_cache(self.model, self.model.encode(src), max_len)
        cache.kernels = self.kernels
        return CachedState(cache, torch.arange(src.size(0), device=src.device), None, self.share_slots)

    def _logits(self, tokens: Tensor, state: CachedState) -> tuple[Tensor, CachedState]:
        """tokens (N,) at position cache.length -> next-token logits (N, V) and the advanced state."""
        out = self.model.decode(tokens[:, None], cache=state.cache)
        return out.logits[:, -1], CachedState(out.cache, state.sentence, state.spare, state.share_slots)

    def step(self, tokens: Tensor, state: CachedState) -> tuple[Tensor, CachedState]:
        """tokens (N,) at position cache.length -> next-token log-probs (N, V)."""
        logits, new = self._logits(tokens, state)
        return log_softmax_rows(logits), new

    def step_topk(self, tokens: Tensor, state: CachedState, k: int, banned: Tensor) -> tuple[Tensor, Tensor, CachedState]:
        """``step`` then ``search.select_topk``: each row's min(k, V) best next tokens, never one of
        ``banned``, and their log-probs, (N, k) each. With the C kernels (CPU float32 or bfloat16
        logits) one pass per row over the logits (``Kernels.log_softmax_topk``) does it: the same
        tokens, log-probs equal up to the rounding of the exponentials (tested)."""
        logits, new = self._logits(tokens, state)  # (N, V)
        if self.kernels is not None and self.kernels.supports_rows(logits):
            values, ids = self.kernels.log_softmax_topk(logits, min(k, logits.size(1)), banned)
            return values, ids, new
        values, ids = select_topk(log_softmax_rows(logits), k, banned)
        return values, ids, new


@dataclass
class PrefixState:
    """Encoder output and the decoder inputs so far (BOS first), one row per hypothesis."""

    enc: EncoderOutput  # memory (N, S, D), src_pad (N, S)
    prefix: Tensor  # (N, t)

    def reorder(self, idx: Tensor) -> "PrefixState":
        enc = EncoderOutput(self.enc.memory.index_select(0, idx), self.enc.src_pad.index_select(0, idx))
        return PrefixState(enc, self.prefix.index_select(0, idx))


class RecomputeDecoder:
    """Decoding without a cache: each step runs the decoder over the full prefix."""

    def __init__(self, model: Transformer):
        self.model = model

    def start(self, src: Tensor, max_len: int) -> PrefixState:
        return PrefixState(self.model.encode(src), src.new_zeros(src.size(0), 0))

    def step(self, tokens: Tensor, state: PrefixState) -> tuple[Tensor, PrefixState]:
        prefix = torch.cat([state.prefix, tokens[:, None]], dim=1)  # (N, t)
        logits = self.model.decode(prefix, state.enc).logits[:, -1]  # (N, V)
        return log_softmax_rows(logits), PrefixState(state.enc, prefix)


@dataclass
class EnsembleState:
    """One state per member of an ``EnsembleDecoder``; reordering reorders them all alike."""

    members: tuple

    def reorder(self, idx: Tensor) -> "EnsembleState":
        return EnsembleState(tuple(s.reorder(idx) for s in self.members))

    def reorder_beams(self, keep: Tensor | None, parent: Tensor | None) -> "EnsembleState":
        """``reorder`` told its structure (``CachedState.reorder_beams``), for every member."""
        return EnsembleState(tuple(reorder_state(s, keep, parent, 1 if parent is None else parent.size(1))
                                   for s in self.members))


class EnsembleDecoder:
    """Several models decoding as one: the next-token distribution is the mean of the members'.

    log p(y) = log (1/M) sum_m p_m(y) = logsumexp_m log p_m(y) - log M, the ensemble of fairseq's
    ``--path a.pt:b.pt`` (Marian's ``-m a.npz b.npz`` adds the members' weighted log-probabilities
    instead; the paper has none: it averages the weights of one run's checkpoints, §6.1).
    The members share the target vocabulary (one tokenizer); their architectures may differ. Each
    keeps its own cache, so the ensemble costs the members' steps added together. One member is
    that member, bit for bit.
    """

    def __init__(self, members: list):
        if not members:
            raise ValueError("an ensemble needs at least one member")
        self.members = list(members)

    def start(self, src: Tensor, max_len: int) -> EnsembleState:
        return EnsembleState(tuple(m.start(src, max_len) for m in self.members))

    def step(self, tokens: Tensor, state: EnsembleState) -> tuple[Tensor, EnsembleState]:
        """tokens (N,) -> log of the members' mean probabilities (N, V)."""
        outs = [m.step(tokens, s) for m, s in zip(self.members, state.members)]
        new_state = EnsembleState(tuple(s for _, s in outs))
        if len(outs) == 1:
            return outs[0][0], new_state
        log_probs = torch.stack([lp for lp, _ in outs])  # (M, N, V)
        return torch.logsumexp(log_probs, dim=0) - math.log(len(outs)), new_state
