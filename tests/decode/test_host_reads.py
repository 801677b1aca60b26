"""What a search step reads back on the host: on a GPU every read waits for the device's queued work.

Counted on the CPU, where nothing waits: every operation that returns a device value to Python
(``item``, ``bool``, ``tolist``, ``torch.equal``, ``nonzero``, ``unique_consecutive``, boolean
indexing, ...) and every tensor made from host data (on a GPU, a copy to the device that waits).
The search runs as it does on a GPU (``reads_wait`` patched true: merges without asking whether
a hypothesis ended, the cache copies rows without finding which ones moved), on a tiny model
through the cached decoder, with sentences finishing at different steps.
"""
from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aiayn
from aiayn.decode.adapter import CachedDecoder, EnsembleDecoder
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import Constraints, SpecialIds, search

search_module = importlib.import_module("aiayn.decode.search")  # (aiayn.decode.search is also the function)
adapter_module = importlib.import_module("aiayn.decode.adapter")

READS = {"aten.item.default", "aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default",
         "aten.nonzero.default", "aten.unique_consecutive.default", "aten._unique2.default", "aten.unique_dim.default",
         "aten.masked_select.default", "aten.repeat_interleave.Tensor"}
INDEXING = {"aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default"}


class HostReads(TorchDispatchMode):
    """Counts reads back to the host (``reads``) and tensors made from host data (``copies``)."""

    def __init__(self):
        super().__init__()
        self.reads = self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in READS:
            self.reads += 1
        elif name in INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.reads += 1  # a boolean index is a nonzero, whose size the host must know
        elif name == "aten.lift_fresh.default":
            self.copies += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """A ``HostReads`` that also counts ``tolist``, ``numpy`` and ``cpu`` (no operation on the CPU), with
    the search on its GPU path."""
    mode = HostReads()
    for name in ("tolist", "numpy", "cpu"):
        real = getattr(torch.Tensor, name)

        def counting(self, *args, _real=real, **kwargs):
            mode.reads += 1
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counting)
    monkeypatch.setattr(search_module, "reads_wait", lambda device: True)
    monkeypatch.setattr(adapter_module, "reads_wait", lambda device: True)
    return mode


class StepCounts:
    """A decoder that notes the counts of ``mode`` at each of its steps."""

    def __init__(self, decoder, mode: HostReads):
        self.decoder, self.mode, self.at_step, self.rows = decoder, mode, [], []

    def start(self, src, max_len):
        return self.decoder.start(src, max_len)

    def _note(self, tokens):
        self.at_step.append((self.mode.reads, self.mode.copies))
        self.rows.append(tokens.numel())

    def step(self, tokens, state):
        self._note(tokens)
        return self.decoder.step(tokens, state)

    def step_topk(self, tokens, state, k, banned):
        self._note(tokens)
        fused = getattr(self.decoder, "step_topk", None)
        if fused is None:
            log_probs, state = self.decoder.step(tokens, state)
            return (*search_module.select_topk(log_probs, k, banned), state)
        return fused(tokens, state, k, banned)

    def per_step(self) -> list[tuple[int, int]]:
        """(reads, copies) between each step and the next."""
        return [(r1 - r0, c1 - c0) for (r0, c0), (r1, c1) in zip(self.at_step, self.at_step[1:])]


def _model():
    cfg = aiayn.get_preset("tiny", vocab_size=40, p_drop=0.0, d_model=32, d_ff=64, n_heads=2, d_k=16, d_v=16)
    torch.manual_seed(3)
    return aiayn.Transformer(cfg).eval()


SRC = torch.tensor([[9, 8, 7, 6, 5, 4, 3], [9, 8, 3, 0, 0, 0, 0], [9, 8, 7, 6, 3, 0, 0], [5, 3, 0, 0, 0, 0, 0]])
IDS = SpecialIds(pad=0, bos=2, eos=3)
CASES = {"beam": (DecodeConfig(beam_size=3, nbest=2, max_len_a=1.0, max_len_b=2), None),
         "beam-prefix": (DecodeConfig(beam_size=3, max_len_a=1.0, max_len_b=2), torch.tensor([[5, 6], [7, -1], [-1, -1], [8, 9]])),
         "greedy": (DecodeConfig(beam_size=1, max_len_a=1.0, max_len_b=2), None),
         "greedy-prefix": (DecodeConfig(beam_size=1, max_len_a=1.0, max_len_b=2), torch.tensor([[5, 6], [7, -1], [-1, -1], [8, 9]])),
         "sampling": (DecodeConfig(sampling=True, nbest=2, max_len_a=1.0, max_len_b=2), None),
         # no repeated bigrams: each hypothesis's bans found and written on the device
         "beam-ngram": (DecodeConfig(beam_size=3, nbest=2, max_len_a=1.0, max_len_b=2, no_repeat_ngram=2), None),
         "beam-prefix-ngram": (DecodeConfig(beam_size=3, max_len_a=1.0, max_len_b=2, no_repeat_ngram=2),
                               torch.tensor([[5, 6, 5, 6], [7, -1, -1, -1], [-1, -1, -1, -1], [8, 9, 8, -1]])),
         "greedy-prefix-ngram": (DecodeConfig(beam_size=1, max_len_a=1.0, max_len_b=2, no_repeat_ngram=2),
                                 torch.tensor([[5, 6, 5, 6], [7, -1, -1, -1], [-1, -1, -1, -1], [8, 9, 8, -1]])),
         "sampling-ngram": (DecodeConfig(sampling=True, nbest=2, max_len_a=1.0, max_len_b=2, no_repeat_ngram=1), None)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("ensemble", [False, True])
def test_a_search_step_reads_the_device_once(counted, case, ensemble):
    """Beam search, greedy search and sampling: at most one read per step (which sentences are done),
    and no tensor made from host data after the start, while sentences leave the batch."""
    cfg, prefix = CASES[case]
    model = _model()
    decoder = EnsembleDecoder([CachedDecoder(model), CachedDecoder(model)]) if ensemble else CachedDecoder(model)
    steps = StepCounts(decoder, counted)
    with counted:
        search(steps, SRC, cfg, IDS, Constraints(prefix=prefix))
    assert len(steps.rows) >= 6 and len(set(steps.rows)) >= 3  # sentences finished at several steps
    assert all(reads <= 1 for reads, _ in steps.per_step()), steps.per_step()
    assert all(copies == 0 for _, copies in steps.per_step()), steps.per_step()


def test_the_counter_sees_the_reads_the_search_once_made(counted):
    """The count is not blind: the old step's reads (``bool(done.any())``, ``nonzero``, ``torch.equal``,
    a boolean index, ``tolist``) each count, and ``torch.tensor`` counts as a copy."""
    x = torch.tensor([True, False, True])
    with counted:
        bool(x.any())
        x.nonzero()
        torch.equal(x, x)
        torch.arange(3)[x]
        x.tolist()
        torch.unique_consecutive(x)
        torch.tensor([1, 2])
    assert (counted.reads, counted.copies) == (6, 1)


@pytest.mark.parametrize("share_slots", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_the_gpu_path_gives_the_cpu_path_s_hypotheses(monkeypatch, case, share_slots):
    """With ``reads_wait`` true (the GPU's choices: merge every step, copy rows without finding which
    moved), the same hypotheses, bit for bit, as the CPU's choices."""
    cfg, prefix = CASES[case]
    model = _model()
    cpu = search(CachedDecoder(model, share_slots=share_slots), SRC, cfg, IDS, Constraints(prefix=prefix))
    monkeypatch.setattr(search_module, "reads_wait", lambda device: True)
    monkeypatch.setattr(adapter_module, "reads_wait", lambda device: True)
    assert search(CachedDecoder(model, share_slots=share_slots), SRC, cfg, IDS, Constraints(prefix=prefix)) == cpu
