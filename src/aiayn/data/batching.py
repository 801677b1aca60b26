"""Token-bounded batches of similar-length pairs (§5.1) and their padded tensors.

§5.1: "Sentence pairs were batched together by approximate sequence length. Each training batch
contained a set of sentence pairs containing approximately 25000 source tokens and 25000 target
tokens." ``TokenBatchSampler`` bounds the padded size of each batch (``TokenBounds``): B * max
length in the batch <= max_src_tokens (source) and <= max_tgt_tokens (target), counting the lengths
the caller passes (the model's view: ids + 1 for the EOS on the source / the BOS or EOS on the target).

Rules, all per epoch from (seed, epoch) only, so every rank and every resumed run agrees:

* order: sort by (longer side, target length, source length), ties broken by a random key
  (on Multi30k at 4096/4096 tokens this pads 5.7% of source and 2.6% of target slots in 119
  batches; sorting by target then source pads 11.9% / 0.6% in 128 batches);
* cut: walk that order and close a batch when adding the next pair would break a bound;
  batch boundaries depend only on the lengths, so the number of batches is the same every epoch;
* an example that alone breaks a bound is its own batch (default: no pair is ever lost, which
  valid/test need), or is dropped with ``TokenBounds.drop_oversize``;
* batch order is shuffled (``shuffle=True``), else kept shortest first (translation);
* data parallel: with ``num_replicas`` R the last ``n_batches % R`` batches of the (shuffled)
  order are dropped, so fewer than R batches (less than one per rank) go unused per epoch, and
  which ones changes with the epoch's shuffle (without shuffle: always the last, longest ones);
  rank r takes batches r, r+R, r+2R, ...

``state_dict()`` records the epoch and the data position: how many batches of the epoch's order
the ranks together have been handed (``batches_done``: this rank's count times R, plus where the
iteration began), a place in the epoch's order, not in one rank's share of it. After
``load_state_dict`` the next ``__iter__`` deals the batches of the order from that place out to
this sampler's R ranks, which may differ from the saved run's: the rest of the epoch is re-cut
for R (its last ``remaining % R`` batches dropped, as above), so no batch is handed twice or
skipped before those (later iterations, like any fresh one, start the epoch from its first
batch). The count is of batches handed out: a consumer that prefetches (a DataLoader with
workers) must save the count it actually trained on instead.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np
import torch

from aiayn.data.vocab import BOS_ID, EOS_ID, PAD_ID
from aiayn.errors import UserError


_CUT_CHUNK = 1 << 16  # pairs whose lengths TokenBatchSampler._cut holds as Python ints at a time


@dataclasses.dataclass(frozen=True)
class TokenBounds:
    """How the sorted pairs are cut into batches (module docstring): a batch's padded size, B * max
    length, at most ``max_src_tokens`` on the source side and ``max_tgt_tokens`` on the target side
    (§5.1); a pair that alone breaks a bound is its own batch, or dropped with ``drop_oversize``."""

    max_src_tokens: int
    max_tgt_tokens: int
    drop_oversize: bool = False

    def __post_init__(self) -> None:
        if self.max_src_tokens <= 0 or self.max_tgt_tokens <= 0:
            raise ValueError("max_src_tokens and max_tgt_tokens must be positive")


class TokenBatchSampler:
    """Yields lists of example indices; see the module docstring for the rules. ``bounds``: how the
    batches are cut; ``seed`` and ``shuffle``: their order; ``num_replicas`` and ``rank``: this
    rank's share of them."""

    def __init__(self, src_lens: Sequence[int], tgt_lens: Sequence[int], bounds: TokenBounds, *,
                 seed: int = 1, shuffle: bool = True, num_replicas: int = 1, rank: int = 0):
        src_lens, tgt_lens = _compact(src_lens), _compact(tgt_lens)
        if src_lens.shape != tgt_lens.shape:
            raise ValueError(f"src_lens has {len(src_lens)} entries, tgt_lens {len(tgt_lens)}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        self.bounds = bounds
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.epoch = 0
        self._position = 0  # batches of this epoch handed to this rank by the current iteration
        self._start = 0  # batches of the epoch's order (all ranks) before the current iteration's first
        self._resume_at = 0  # where in the epoch's order the next __iter__ begins (set by load_state_dict only)
        self._set_lengths(src_lens, tgt_lens)

    def _set_lengths(self, src_lens: np.ndarray, tgt_lens: np.ndarray) -> None:
        self.src_lens, self.tgt_lens = src_lens, tgt_lens
        self._slices, self.n_oversize = self._cut()

    def _sorted_order(self, epoch: int) -> tuple[np.ndarray, np.random.Generator | None]:
        """The epoch's order (int32 below 2^31 pairs: what an epoch's batches hold, 4 bytes a pair)."""
        n = len(self.src_lens)
        longer = np.maximum(self.src_lens, self.tgt_lens)
        if not self.shuffle:
            return _index(np.lexsort((np.arange(n), self.src_lens, self.tgt_lens, longer))), None
        rng = np.random.default_rng([self.seed, epoch])
        return _index(np.lexsort((rng.random(n), self.src_lens, self.tgt_lens, longer))), rng

    def _cut(self) -> tuple[list[tuple[int, int]], int]:
        """(start, end) slices of the sorted order; oversize pairs alone or skipped. The lengths are
        walked in chunks of ``_CUT_CHUNK`` (Python lists of a whole WMT-sized corpus would hold
        ~70 MB more for nothing)."""
        order = np.lexsort((self.src_lens, self.tgt_lens, np.maximum(self.src_lens, self.tgt_lens)))
        max_s, max_t = int(self.bounds.max_src_tokens), int(self.bounds.max_tgt_tokens)
        slices: list[tuple[int, int]] = []
        start, ms, mt, oversize = 0, 0, 0, 0
        for c0 in range(0, len(order), _CUT_CHUNK):
            chunk = order[c0:c0 + _CUT_CHUNK]
            for k, sk, tk in zip(range(c0, c0 + len(chunk)), self.src_lens[chunk].tolist(), self.tgt_lens[chunk].tolist()):
                if sk > max_s or tk > max_t:
                    if k > start:
                        slices.append((start, k))
                    oversize += 1
                    if not self.bounds.drop_oversize:
                        slices.append((k, k + 1))
                    start, ms, mt = k + 1, 0, 0
                    continue
                ns, nt, size = max(ms, sk), max(mt, tk), k - start + 1
                if size * ns > max_s or size * nt > max_t:
                    slices.append((start, k))
                    start, ns, nt = k, sk, tk
                ms, mt = ns, nt
        if start < len(order):
            slices.append((start, len(order)))
        return slices, oversize

    @property
    def n_batches_total(self) -> int:
        """Batches per epoch over all ranks, before evening out the ranks."""
        return len(self._slices)

    def __len__(self) -> int:
        return len(self._slices) // self.num_replicas

    def set_lengths(self, src_lens: Sequence[int], tgt_lens: Sequence[int]) -> None:
        """New lengths for the same examples (an epoch's BPE-dropout segmentation): the batches
        are cut again by the rules above, so their number may change; epoch and position stay."""
        src_lens, tgt_lens = _compact(src_lens), _compact(tgt_lens)
        if src_lens.shape != self.src_lens.shape or tgt_lens.shape != self.tgt_lens.shape:
            raise ValueError(f"set_lengths: {len(src_lens)}/{len(tgt_lens)} lengths for {len(self.src_lens)} examples")
        self._set_lengths(src_lens, tgt_lens)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; a different epoch starts from its first batch."""
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self._position = self._start = self._resume_at = 0

    def epoch_batches(self, epoch: int | None = None, start: int = 0) -> list[np.ndarray]:
        """This rank's batches of ``epoch`` (default: the current one), in order: those of the epoch's
        batch order from its ``start``-th on, dealt out to the R ranks."""
        epoch = self.epoch if epoch is None else epoch
        order, rng = self._sorted_order(epoch)
        n = len(self._slices)
        rest = (rng.permutation(n) if rng is not None else np.arange(n))[start:]
        kept = rest[: len(rest) - len(rest) % self.num_replicas]
        return [order[slice(*self._slices[j])] for j in kept[self.rank::self.num_replicas]]

    def __iter__(self) -> Iterator[list[int]]:
        """The epoch's batches for this rank; after ``load_state_dict``, only those not yet seen."""
        self._start, self._resume_at = self._resume_at, 0
        self._position = 0
        for batch in self.epoch_batches(start=self._start):
            self._position += 1
            yield batch.tolist()

    @property
    def batches_done(self) -> int:
        """Batches of the epoch's order handed to all ranks so far (the data position)."""
        return self._start + self._position * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.batches_done, "seed": self.seed,
                "num_replicas": self.num_replicas, "rank": self.rank, "n_examples": len(self.src_lens),
                "n_batches_total": self.n_batches_total, "n_batches": len(self)}

    def same_cut(self, state: dict) -> bool:
        """Whether ``state`` was saved from batches cut as this sampler's are (their number; a state
        written before ``n_batches_total`` was saved holds the count per rank)."""
        if "n_batches_total" in state:
            return state["n_batches_total"] == self.n_batches_total
        return state["n_batches"] == self.n_batches_total // state["num_replicas"]

    def load_state_dict(self, state: dict) -> None:
        """Continue ``state``'s epoch from its data position, on this sampler's number of ranks."""
        for key, what in (("seed", "train.seed"), ("n_examples", "the data directory's training pairs")):
            mine = self.state_dict()[key]
            if state[key] != mine:
                raise UserError(f"cannot resume the batch order: {what} {state[key]} in the run, now {mine}; "
                                f"resume with the run's settings (its config.json) and data directory")
        if not self.same_cut(state):
            b = self.bounds
            raise UserError(f"cannot resume the batch order: the saved epoch was cut into other batches than the "
                            f"{self.n_batches_total} of these lengths and token bounds (now train.max_src_tokens="
                            f"{b.max_src_tokens}, train.max_tgt_tokens={b.max_tgt_tokens}); resume with the run's "
                            f"(its config.json)")
        done = state["batches_done"] if "batches_done" in state else state["position"] * state["num_replicas"]
        self.epoch = int(state["epoch"])
        self._start = self._resume_at = int(done)
        self._position = 0


def _compact(lens: Sequence[int]) -> np.ndarray:
    """Lengths as int16 where they fit (2 bytes a pair; a WMT-sized corpus's sampler holds two such
    arrays), else int32."""
    lens = np.asarray(lens)
    small = np.iinfo(np.int16)
    fits = lens.size == 0 or (int(lens.min()) >= small.min and int(lens.max()) <= small.max)
    return lens.astype(np.int16 if fits else np.int32)


def _index(order: np.ndarray) -> np.ndarray:
    """Positions as int32 below 2^31 entries (4 bytes a pair instead of 8)."""
    return order.astype(np.int32) if len(order) < 2 ** 31 else order


@dataclasses.dataclass(frozen=True)
class Batch:
    """Padded tensors of one batch (§3: the decoder sees the target shifted right by one)."""

    src: torch.Tensor           # (B, S) long: ids + [eos], padded with pad_id
    tgt_in: torch.Tensor        # (B, T) long: [bos] + ids, the decoder input
    tgt_out: torch.Tensor       # (B, T) long: ids + [eos], what the decoder must predict
    n_src_tokens: int           # non-pad entries of src
    n_tgt_tokens: int           # non-pad entries of tgt_out (the tokens the loss counts)
    indices: torch.Tensor | None = None  # (B,) positions of the pairs in their split
    src_padded: bool = True     # whether src holds padding: known when it is made, never read back from a device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        move = lambda x: None if x is None else x.to(device, non_blocking=non_blocking)  # noqa: E731
        return dataclasses.replace(self, src=move(self.src), tgt_in=move(self.tgt_in),
                                   tgt_out=move(self.tgt_out), indices=move(self.indices))

    def pin_memory(self) -> "Batch":
        """The batch in page-locked host memory, so ``to(cuda, non_blocking=True)`` copies it while
        the device works."""
        pin = lambda x: None if x is None else x.pin_memory()  # noqa: E731
        return dataclasses.replace(self, src=pin(self.src), tgt_in=pin(self.tgt_in),
                                   tgt_out=pin(self.tgt_out), indices=pin(self.indices))

    def __len__(self) -> int:
        return self.src.shape[0]


def _pad(rows: list[np.ndarray], pad_id: int, prefix: int | None, suffix: int | None) -> np.ndarray:
    extra = (prefix is not None) + (suffix is not None)
    out = np.full((len(rows), max(len(r) for r in rows) + extra), pad_id, dtype=np.int64)
    for b, r in enumerate(rows):
        j = 0
        if prefix is not None:
            out[b, 0], j = prefix, 1
        out[b, j:j + len(r)] = r
        if suffix is not None:
            out[b, j + len(r)] = suffix
    return out


def collate(pairs: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int = PAD_ID,
            bos_id: int = BOS_ID, eos_id: int = EOS_ID,
            indices: Sequence[int] | None = None) -> Batch:
    """Pad (src ids, tgt ids) pairs into a ``Batch``: src+[eos], [bos]+tgt, tgt+[eos]."""
    if not pairs:
        raise ValueError("collate: empty batch")
    src = [np.asarray(p[0], dtype=np.int64) for p in pairs]
    tgt = [np.asarray(p[1], dtype=np.int64) for p in pairs]
    src_t = torch.from_numpy(_pad(src, pad_id, None, eos_id))          # (B, S)
    tgt_in = torch.from_numpy(_pad(tgt, pad_id, bos_id, None))          # (B, T)
    tgt_out = torch.from_numpy(_pad(tgt, pad_id, None, eos_id))         # (B, T)
    return Batch(src=src_t, tgt_in=tgt_in, tgt_out=tgt_out,
                 n_src_tokens=sum(len(s) + 1 for s in src), n_tgt_tokens=sum(len(t) + 1 for t in tgt),
                 indices=None if indices is None else torch.as_tensor(list(indices), dtype=torch.long),
                 src_padded=len({len(s) for s in src}) > 1)


def _pad_flat(flat: np.ndarray, lens: np.ndarray, pad_id: int, prefix: int | None,
              suffix: int | None) -> np.ndarray:
    """``_pad`` of rows given end to end (``flat``) with their lengths (B,): the same (B, L) array."""
    first = int(prefix is not None)
    width = int(lens.max()) + first + int(suffix is not None)
    out = np.full((len(lens), width), pad_id, dtype=np.int64)
    cols = np.arange(width)[None, :]  # (1, L)
    out[(cols >= first) & (cols < first + lens[:, None])] = flat  # row-major: row by row, in order
    if prefix is not None:
        out[:, 0] = prefix
    if suffix is not None:
        out[np.arange(len(lens)), first + lens] = suffix
    return out


def collate_rows(src: tuple[np.ndarray, np.ndarray], tgt: tuple[np.ndarray, np.ndarray], pad_id: int = PAD_ID,
                 bos_id: int = BOS_ID, eos_id: int = EOS_ID, indices: Sequence[int] | None = None) -> Batch:
    """``collate`` of rows given side by side as (tokens end to end, lengths), as
    ``ParallelData.rows`` reads them: the same ``Batch``, by array operations instead of a loop over
    the rows (the host's time between two training steps)."""
    (src_flat, src_lens), (tgt_flat, tgt_lens) = src, tgt
    if not len(src_lens):
        raise ValueError("collate: empty batch")
    return Batch(src=torch.from_numpy(_pad_flat(src_flat, src_lens, pad_id, None, eos_id)),     # (B, S)
                 tgt_in=torch.from_numpy(_pad_flat(tgt_flat, tgt_lens, pad_id, bos_id, None)),  # (B, T)
                 tgt_out=torch.from_numpy(_pad_flat(tgt_flat, tgt_lens, pad_id, None, eos_id)),  # (B, T)
                 n_src_tokens=int(src_lens.sum()) + len(src_lens), n_tgt_tokens=int(tgt_lens.sum()) + len(tgt_lens),
                 indices=None if indices is None else torch.as_tensor(list(indices), dtype=torch.long),
                 src_padded=bool(src_lens.min() != src_lens.max()))


def batches(data, sampler: TokenBatchSampler, pad_id: int = PAD_ID, bos_id: int = BOS_ID,
            eos_id: int = EOS_ID) -> Iterator[Batch]:
    """``Batch`` objects of ``data`` (a ParallelData) in the sampler's order, with indices."""
    for idx in sampler:
        yield collate([data[i] for i in idx], pad_id, bos_id, eos_id, indices=idx)
