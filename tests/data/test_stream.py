"""The training batches as one stream (aiayn.data.stream.BatchStream): its state round trip, the
prefetch, epochs with BPE-dropout and corpus weights, a resume on another segmentation, and data
positions saved before it existed."""
from __future__ import annotations

import logging

import pytest
import torch

from aiayn.config import replace
from aiayn.data.corpora import Corpus
from aiayn.data.dataset import DataDir, Segmentation
from aiayn.data.prepare import SplitFiles, prepare
from aiayn.data.stream import BatchStream
from aiayn.errors import UserError
from aiayn.model.config import ModelConfig
from aiayn.train.config import TrainConfig, batching
from aiayn.train.runtime import Dist
from tests.data.conftest import SMALL, write_lines

CPU = torch.device("cpu")
# 2000 pairs at 1500 tokens a batch: about 40 batches an epoch, 14 steps of 3
TRAIN = TrainConfig(max_src_tokens=1500, max_tgt_tokens=1500, accum_steps=3, seed=5)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, train_lines):
    """Two corpora of weights 2 and 0.5 (600 and 400 Multi30k pairs)."""
    d = tmp_path_factory.mktemp("mixed")
    en, de = train_lines
    a = Corpus("a", write_lines(d / "a.en", en[:600]), write_lines(d / "a.de", de[:600]), weight=2)
    b = Corpus("b", write_lines(d / "b.en", en[600:1000]), write_lines(d / "b.de", de[600:1000]), weight=0.5)
    prepare({"valid": SplitFiles(write_lines(d / "v.en", en[1900:]), write_lines(d / "v.de", de[1900:]))},
            d / "data", SMALL, corpora=[a, b])
    return d / "data"


def _stream(data_dir, run_dir, **train) -> BatchStream:
    return BatchStream(DataDir(data_dir), batching(replace(TRAIN, **train)), ModelConfig(), run_dir, Dist(), CPU)


def _steps(stream: BatchStream, n: int, prefetch: bool = True) -> list[list[list[int]]]:
    """The pair indices of the next ``n`` steps' batches, drawn as the loop draws them (the next
    step's prefetched while this one trains) or, without ``prefetch``, each when it is asked for."""
    out = []
    for _ in range(n):
        batches = stream.next_step()
        if prefetch:
            stream.prefetch()
        out.append([b.indices.tolist() for b in batches])
    return out


@pytest.fixture(params=["plain", "bpe_dropout", "corpora"])
def case(request, prepared, mixed, tmp_path):
    """(data directory, train settings, run directory) of each kind of stream."""
    if request.param == "plain":
        return prepared, {}, tmp_path
    if request.param == "bpe_dropout":
        return prepared, {"bpe_dropout": 0.1}, tmp_path
    return mixed, {}, tmp_path


@pytest.mark.parametrize("k", [0, 5, 14, 20])
def test_a_stream_from_the_state_draws_the_same_next_batches(case, k):
    """k steps, the state saved (with the next step already prefetched: it is not in the state), and
    a new stream from that state: the next steps are the original's, across the epoch's end."""
    data_dir, train, run_dir = case
    first = _stream(data_dir, run_dir, **train)
    _steps(first, k)
    state = first.state_dict()
    assert state["epoch"] == first.epoch
    again = _stream(data_dir, run_dir, **train)  # (BPE-dropout: the epoch's segmentation saved in run_dir)
    again.load_state_dict(state)
    assert _steps(again, 12) == _steps(first, 12)
    assert again.state_dict() == first.state_dict()


def test_prefetch_gives_the_batches_of_no_prefetch(case):
    data_dir, train, run_dir = case
    ahead, plain = _stream(data_dir, run_dir, **train), _stream(data_dir, run_dir, **train)
    drawn, epochs = [], []
    while ahead.epoch < 2:  # two epochs' ends
        drawn += _steps(ahead, 1)
        epochs.append(ahead.epoch)
    assert drawn == _steps(plain, len(drawn), prefetch=False) and plain.epoch == 2
    first = [i for step, e in zip(drawn, epochs) if e == 0 for b in step for i in b]
    assert len(first) == len(set(first))  # no pair twice in an epoch (corpus weights: no index twice)


def test_an_epoch_that_ends_mid_step_closes_the_step(prepared, tmp_path):
    n = len(_stream(prepared, tmp_path).sampler)  # batches an epoch
    a = next(a for a in (3, 4, 5, 7) if n % a)
    sizes = [len(step) for step in _steps(_stream(prepared, tmp_path, accum_steps=a), n // a + 2)]
    assert sizes[n // a] == n % a and sum(sizes[:n // a + 1]) == n and sizes[n // a + 1] == a


def test_the_epoch_limit_draws_nothing_and_saves_the_next_epochs_start(prepared, tmp_path):
    stream = _stream(prepared, tmp_path, max_epochs=1, accum_steps=1)
    n = len(stream.sampler)
    assert all(_steps(stream, n))
    assert stream.next_step() == [] and stream.epoch == 1
    assert stream.state_dict()["epoch"] == 1 and stream.state_dict()["batches_done"] == 0


def test_data_positions_of_older_checkpoints_are_read(prepared, tmp_path):
    """The ``sampler`` entry of a checkpoint as the loop wrote it before the stream (the same format:
    ``TokenBatchSampler.state_dict``), and as older versions wrote it (``position`` per rank,
    ``n_batches`` per rank, no ``batches_done`` or ``n_batches_total``)."""
    first = _stream(prepared, tmp_path, accum_steps=1)
    _steps(first, 7)
    n = len(first.sampler)
    written = {"epoch": 0, "batches_done": 7, "seed": 5, "num_replicas": 1, "rank": 0,
               "n_examples": 2000, "n_batches_total": n, "n_batches": n}
    assert first.state_dict() == {**written, "segmentation": None}  # (the stored segmentation: no SHA-256)
    older = {"epoch": 0, "position": 7, "seed": 5, "num_replicas": 1, "rank": 0, "n_examples": 2000,
             "n_batches": n}
    want = _steps(first, 5)
    for saved in (written, older):
        stream = _stream(prepared, tmp_path, accum_steps=1)
        stream.load_state_dict(saved)
        assert _steps(stream, 5) == want


@pytest.mark.parametrize("how, said", [
    ("gone", "epoch00000.npz was not in the run directory: sampled again, SHA-256"),
    ("gone, saved before positions kept its SHA-256", "epoch00000.npz was not in the run directory: sampled again"),
    ("other ids, the same lengths", "epoch00000.npz holds SHA-256"),
    ("train.bpe_dropout off", "it was a BPE-dropout segmentation, and train.bpe_dropout is 0 now"),
    ("train.bpe_dropout on", "it was the stored one, and train.bpe_dropout is 0.1 now"),
])
def test_an_epoch_resumed_on_another_segmentation_starts_over(prepared, tmp_path, caplog, how, said):
    """A data position in the middle of an epoch, resumed where the epoch is not cut on the segmentation
    it was: its BPE-dropout file gone and sampled again (SentencePiece's draws cannot be repeated),
    replaced by one of the same lengths (the same batches of other tokens: no count of batches tells
    them apart), or BPE-dropout turned off or on. The epoch starts over from its first batch, saying
    what differs, and then holds every pair once; with the same segmentation it continues."""
    was, now = {"bpe_dropout": 0.0 if how.endswith(" on") else 0.1}, {"bpe_dropout": 0.0 if how.endswith(" off") else 0.1}
    first = _stream(prepared, tmp_path, accum_steps=1, **was)
    n = len(first.sampler)
    _steps(first, n // 2)
    state = first.state_dict()
    seg_file = Segmentation.path(tmp_path, 0)
    if how.startswith("gone"):
        seg_file.unlink()
    if how.startswith("gone, saved before"):
        del state["segmentation"]
    if how.startswith("other ids"):
        seg = Segmentation.load(seg_file)
        tokens, offsets = seg.arrays["src"]
        Segmentation({**seg.arrays, "src": (tokens[::-1].copy(), offsets)}).save(seg_file)
    again = _stream(prepared, tmp_path, accum_steps=1, **now)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.stream"):
        again.load_state_dict(state)
    assert caplog.text.count("epoch 0 is cut on another segmentation than the checkpoint's (") == 1, caplog.text
    assert said in caplog.text and "that epoch starts over from its first batch" in caplog.text
    assert again.state_dict()["epoch"] == 0 and again.state_dict()["batches_done"] == 0
    epoch = [i for step in _steps(again, len(again.sampler)) for b in step for i in b]
    assert sorted(epoch) == list(range(2000)) and again.epoch == 0
    caplog.clear()
    same = _stream(prepared, tmp_path, accum_steps=1, **now)
    same.load_state_dict(again.state_dict())  # the segmentation it was cut on: no restart
    assert same.state_dict() == again.state_dict() and not caplog.text


def test_corpus_weights_resumed_with_other_token_bounds_are_refused(mixed, tmp_path):
    """Corpus weights draw each epoch from (seed, epoch) alone: a saved epoch cut into another number of
    batches means other token bounds, refused as without weights (not taken for a BPE-dropout file)."""
    first = _stream(mixed, tmp_path)
    _steps(first, 3)
    with pytest.raises(UserError, match="train.max_src_tokens=1000"):
        _stream(mixed, tmp_path, max_src_tokens=1000, max_tgt_tokens=1000).load_state_dict(first.state_dict())
