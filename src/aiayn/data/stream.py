"""The training batches as one stream (§5.1): ``BatchStream`` hands the training loop each optimizer
step's batches and the data position a checkpoint keeps, and holds everything behind them.

* what the batches follow: ``Batching``, the ``train`` fields of the same names (the training
  configuration's section for the stream, ``aiayn.train.config.batching``);
* the token-bounded sampler of this rank's share (``aiayn.data.batching``) and its epochs: a step
  holds ``accum_steps`` batches; an epoch that ends mid-step closes the step early; at the start
  of epoch ``max_epochs`` (0 = no limit) a step holds none, and the sampler stands at its first
  batch, so a run resumed with a higher limit trains that epoch whole;
* each epoch's pairs: the corpus mix draws them from (seed, epoch) (``aiayn.data.corpora``);
  BPE-dropout samples the epoch's segmentation on the main rank and saves it in the run directory
  before any rank uses it (``aiayn.data.dataset.Segmentation``), so ranks and resumed runs agree;
  either way the epoch's batches are cut again on its lengths;
* the prefetch: ``prefetch()`` draws the next step's batches, collated, pinned and sent with
  ``non_blocking``, while the device computes the current step; ``next_step()`` hands them out
  (or draws them then, without a prefetch: the same batches);
* the data position: ``state_dict()`` is the sampler's position after the batches ``next_step``
  handed out, not after those drawn ahead, so a resumed run draws the prefetched ones again; its
  format is ``TokenBatchSampler.state_dict``'s with one key more, ``segmentation``: the SHA-256 of
  the BPE-dropout segmentation its epoch is cut on (``Segmentation.sha256``; None: the stored one);
  it is the ``sampler`` entry of every checkpoint, and ``load_state_dict`` reads it on another
  number of ranks too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from aiayn.data.batching import TokenBatchSampler, TokenBounds, collate, collate_rows
from aiayn.data.corpora import corpus_mix
from aiayn.data.dataset import BpeDropoutData, DataDir, ParallelData, Segmentation
from aiayn.errors import UserError
from aiayn.model.config import ModelConfig

log = logging.getLogger(__name__)

CUT = "segmentation"  # the data position's key for the SHA-256 of the segmentation its epoch is cut on


def check_positions(m, splits: dict) -> None:
    """With learned positions (Table 3 row E) a sequence may not be longer than ``max_positions``:
    the source with its EOS, the target with its BOS (or EOS). A longer pair is an error naming its
    split and its number there, before training starts, not a failure at its first batch."""
    if not m.learned_positions:
        return
    for name, data in splits.items():
        if data is None or len(data) == 0:
            continue
        longest = np.maximum(data.src_lens, data.tgt_lens) + 1  # (N,)
        i = int(np.argmax(longest))
        if longest[i] > m.max_positions:
            raise UserError(f"{name}: pair {i + 1} needs {int(longest[i])} positions, more than "
                            f"model.max_positions={m.max_positions} of learned positional embeddings; "
                            f"raise model.max_positions or drop long pairs (aiayn prepare --max-len)")


def to_device(b, device: torch.device):
    """A collated batch on ``device``: on CUDA from page-locked memory without waiting
    (``non_blocking``), so the copy overlaps the device's work; on the CPU as it is."""
    return b.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else b


@dataclass(frozen=True)
class Batching:
    """What the training batches follow: the ``train`` fields of the same names, whose help texts say
    what each means (``aiayn.train.config.batching`` cuts this section out of them). §5.1's token
    bounds of a batch on one device, the batches of an optimizer step, the seed of their order, the
    epoch limit (0: none) and BPE-dropout's probability (0: off) and sides."""

    max_src_tokens: int
    max_tgt_tokens: int
    accum_steps: int
    seed: int
    max_epochs: int
    bpe_dropout: float
    bpe_dropout_target: bool

    @property
    def bounds(self) -> TokenBounds:
        """How the sampler cuts the batches: at the token bounds, no pair dropped."""
        return TokenBounds(self.max_src_tokens, self.max_tgt_tokens)


@dataclass
class _Draw:
    """One optimizer step's batches, drawn ahead of their step."""
    batches: list  # collated batches, already on (or on their way to) the device
    epoch: int  # the sampler's epoch once they were drawn
    state: dict  # the sampler's position just after them


class BatchStream:
    """This rank's training batches, one optimizer step at a time (module docstring). ``batching``:
    what they follow; ``m``: the model's configuration (its ids and positions); ``dist`` this
    process's place in the run (rank, world size); ``run_dir`` keeps BPE-dropout's segmentations;
    ``start``: a data position to continue from (``load_state_dict``; None: the first batch)."""

    def __init__(self, data: DataDir, batching: Batching, m: ModelConfig, run_dir: Path, dist,
                 device: torch.device, start: dict | None = None):
        b, self.m = batching, m
        self.accum_steps, self.max_epochs = b.accum_steps, b.max_epochs
        self.run_dir, self.dist, self.device = run_dir, dist, device
        train = data.split("train")
        self.bpe = None
        if b.bpe_dropout > 0:
            self.bpe = train = BpeDropoutData(
                train, data.src_tokenizer, data.tgt_tokenizer, b.bpe_dropout,
                num_threads=torch.get_num_threads(), sides=("src", "tgt") if b.bpe_dropout_target else ("src",))
        check_positions(self.m, {"train": train})
        self.mix = corpus_mix(data, train, b.seed)  # corpora of weights other than 1: an epoch's draw
        self.data = self.mix if self.mix is not None else train
        self.sampler = TokenBatchSampler(self.data.src_lens + 1, self.data.tgt_lens + 1, b.bounds, seed=b.seed,
                                         shuffle=True, num_replicas=dist.world_size, rank=dist.rank)
        if len(self.sampler) == 0:
            raise UserError(f"{data.path}: too few training batches for {dist.world_size} device(s)")
        self.epoch = 0  # of the batches handed out last
        self._it = None  # the sampler's epoch being drawn (None: not begun)
        self._ahead: _Draw | None = None
        self._cut: str | None = None  # SHA-256 of the BPE-dropout segmentation in use (None: the stored one)
        self._state = self._position()
        if start is not None:
            self.load_state_dict(start)

    def state_dict(self) -> dict:
        """The data position after the batches handed out (the sampler's state then)."""
        return dict(self._state)

    @property
    def epochs(self) -> float:
        """The epochs the batches handed out complete, fractional: the epoch plus the share of its
        batches handed to all ranks (the same on every rank)."""
        state = self._state
        return state["epoch"] + state["batches_done"] / max(1, state["n_batches_total"])

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (a checkpoint's ``sampler`` entry), on this stream's number of
        ranks. BPE-dropout (and corpus weights): the batches are cut on the saved epoch's lengths.
        SentencePiece's draws cannot be repeated, so an epoch whose segmentation is not the one
        ``state`` was cut on (another SHA-256: its file was gone and is sampled again, or
        train.bpe_dropout was turned on or off) restarts from its first batch, with a warning that
        says what differs (in the middle of the epoch); so does an epoch saved before its first batch
        (at train.max_epochs)."""
        epoch = int(state["epoch"])
        kept = self.bpe is not None and Segmentation.path(self.run_dir, epoch).exists()
        if self.bpe is not None and self.dist.enabled:
            torch.distributed.barrier()  # every rank has looked before the main rank may sample it
        self._segment(epoch)
        other = self._other_cut(state, kept)
        if other is not None:
            if state.get("batches_done", state.get("position")):  # (none: saved at the epoch's start)
                log.warning("%s: epoch %d is cut on another segmentation than the checkpoint's (%s); that epoch "
                            "starts over from its first batch", self.run_dir, epoch, other)
            state = {**state, "n_batches_total": self.sampler.n_batches_total, "batches_done": 0}
        self.sampler.load_state_dict(state)  # on another number of ranks, the epoch's rest is re-cut for these
        self._begin()

    def _other_cut(self, state: dict, kept: bool) -> str | None:
        """How the segmentation of ``state``'s epoch differs from this stream's (None: the same);
        ``kept``: whether its file was in the run directory before this stream looked. A position
        saved before positions recorded it (no ``segmentation`` key) is taken for the file's."""
        path = Segmentation.path(self.run_dir, int(state["epoch"]))
        if CUT not in state:
            return None if self.bpe is None or kept else f"{path} was not in the run directory: sampled again"
        saved, now = state[CUT], self._cut
        if saved == now:
            return None
        if now is None:
            return "it was a BPE-dropout segmentation, and train.bpe_dropout is 0 now"
        if saved is None:
            return f"it was the stored one, and train.bpe_dropout is {self.bpe.p:g} now"
        where = f"{path} holds" if kept else f"{path} was not in the run directory: sampled again,"
        return f"{where} SHA-256 {now[:12]}..., the checkpoint's is {saved[:12]}..."

    def saved(self) -> None:
        """A checkpoint holds ``state_dict()`` now: the main rank deletes the BPE-dropout segmentations
        of the epochs before it."""
        if self.bpe is not None and self.dist.is_main:
            Segmentation.prune(self.run_dir, self._state["epoch"])

    def prefetch(self) -> None:
        """Draw the next step's batches now (on their way to the device while it computes)."""
        if self._ahead is None:
            self._ahead = self._draw()

    def next_step(self) -> list:
        """The next optimizer step's batches (none: the epoch limit is reached)."""
        self.prefetch()
        drawn, self._ahead = self._ahead, None
        self.epoch, self._state = drawn.epoch, drawn.state
        return drawn.batches

    def _begin(self) -> None:
        """Iterate the sampler's epoch from its position."""
        self.epoch = self.sampler.epoch
        self._it = iter(self.sampler)
        self._state = self._position()

    def _position(self) -> dict:
        """The sampler's position and the SHA-256 of the segmentation its epoch is cut on (``CUT``)."""
        return {**self.sampler.state_dict(), CUT: self._cut}

    def _draw(self) -> _Draw:
        """Up to ``accum_steps`` collated batches, sent to the device (``to_device``)."""
        if self._it is None:  # a new run: epoch 0
            self._segment(0)
            self._begin()
        out = []
        while len(out) < self.accum_steps:
            try:
                idx = next(self._it)
            except StopIteration:
                if out:
                    break
                epoch = self.sampler.epoch + 1
                self.sampler.set_epoch(epoch)
                if self.max_epochs and epoch >= self.max_epochs:
                    break
                self._segment(epoch)
                self._it = iter(self.sampler)
                continue
            m = self.m
            if isinstance(self.data, ParallelData):  # the stored tokens, gathered at once
                out.append(collate_rows(self.data.rows("src", idx), self.data.rows("tgt", idx), m.pad_id, m.bos_id,
                                        m.eos_id, indices=idx))
            else:  # a corpus mix or BPE-dropout's segmentations: pair by pair
                out.append(collate([self.data[i] for i in idx], m.pad_id, m.bos_id, m.eos_id, indices=idx))
        return _Draw([to_device(b, self.device) for b in out], self.sampler.epoch, self._position())

    def _segment(self, epoch: int) -> None:
        """The epoch's pairs and their batches (module docstring)."""
        if self.mix is not None and self.mix.set_epoch(epoch) and self.bpe is None:
            self.sampler.set_lengths(self.mix.src_lens + 1, self.mix.tgt_lens + 1)
        if self.bpe is None:
            return
        path = Segmentation.path(self.run_dir, epoch)
        if self.dist.is_main and not path.exists():
            self.bpe.sample().save(path)
        if self.dist.enabled:
            torch.distributed.barrier()
        seg = Segmentation.load(path)
        self.bpe.use(seg)
        self._cut = seg.sha256()
        check_positions(self.m, {f"train (BPE-dropout segmentation {path})": self.bpe})
        self.sampler.set_lengths(self.data.src_lens + 1, self.data.tgt_lens + 1)
