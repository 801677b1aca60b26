"""Checkpoints as untrusted input and as the record of a run (docs/checkpoints.md): they load with
``weights_only`` (a file naming code is refused before any of it runs), carry a content checksum
(a flipped bit is an error naming the file; resume falls back to the newest intact step
checkpoint), keep every rank's RNG state, survive a full disk with a clear error, and the run
directory is guarded (one training at a time, stale temporaries removed, config.json kept
through a refused resume, keep_last 0 keeping everything)."""
from __future__ import annotations

import copy
import errno
import hashlib
import io
import logging
import os
import random
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import aiayn
from aiayn.cli import main
from aiayn.config import to_dict
from aiayn.errors import UserError
from aiayn.files import atomic_write, write_json_atomic
from aiayn import checkpoint as ck
from aiayn.train import runtime as rt
from tests.train.test_training import FAST, _free_port, _train_cmd, _wait_for_all


def _handmade(step: int = 0) -> dict:
    cfg = aiayn.get_preset("tiny", vocab_size=10)
    return {"format": ck.FORMAT, "model": aiayn.Transformer(cfg).state_dict(), "model_config": to_dict(cfg),
            "step": step, "rng": rt.rng_state(), "valid": {"valid_loss": 1.5}, "tokenizers": {"src": b"\x00\xff"}}


class _RunsCode:
    """Unpickling this runs a shell command (what a shared ``model.pt`` could hold)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_runs_code_is_refused_before_it_runs(tmp_path, capsys):
    marker = tmp_path / "ran"
    evil = tmp_path / "model.pt"
    torch.save({"format": ck.FORMAT, "model": {}, "payload": _RunsCode(marker)}, evil)
    with pytest.raises(UserError, match=f"{evil}: refused: .*system"):
        ck.load_checkpoint(evil)
    assert not marker.exists()
    # every command reads checkpoints through load_checkpoint: translate too
    (tmp_path / "in.txt").write_text("a\n")
    assert main(["translate", "--checkpoint", str(evil), "--input", str(tmp_path / "in.txt")]) == 2
    assert f"{evil}: refused" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("make, said", [
    (lambda p: p.mkdir(), "a directory, not a checkpoint file (a run directory's model is its best.pt or last.pt"),
    (lambda p: p.write_text("A man rides a horse.\n"), "not a checkpoint: it begins b'A ma', not as torch.save"),
    (lambda p: p.write_bytes(b"\x1f\x8b\x08\x00rest"), "not a checkpoint: it begins b'\\x1f\\x8b\\x08\\x00'"),
    (lambda p: p.write_bytes(b""), "empty, not a checkpoint"),
    (lambda p: None, "checkpoint not found"),
    (lambda p: p.write_bytes(b"PK\x03\x04 cut short"), "not a readable checkpoint ("),
    (lambda p: p.write_bytes(b"\x80\x02K\x01."), "not a readable checkpoint (RuntimeError: Invalid magic number")])
def test_what_is_not_a_checkpoint_says_what_it_is(make, said, tmp_path, capsys):
    """A run directory, a text file, gzip, an empty, missing or cut file, a pickle of a number: each
    named for what it is, by every reader (``load_checkpoint``, ``upgrade_checkpoint``, the commands)."""
    path = tmp_path / "model.pt"
    make(path)
    assert f"{path}: " in refused_by_every_reader(path, said, tmp_path, capsys)


def refused_by_every_reader(path: Path, said: str, tmp_path: Path, capsys) -> str:
    """``load_checkpoint`` and ``upgrade_checkpoint`` refuse ``path`` with an error that begins
    "PATH: SAID", and ``aiayn translate`` exits 2: its standard error."""
    for read in (ck.load_checkpoint, lambda p: ck.upgrade_checkpoint(p, tmp_path / "new.pt")):
        with pytest.raises(UserError) as error:
            read(path)
        assert str(error.value).startswith(f"{path}: {said}"), str(error.value)
    (tmp_path / "in.txt").write_text("a\n")
    assert main(["translate", "--checkpoint", str(path), "--input", str(tmp_path / "in.txt")]) == 2
    return capsys.readouterr().err


def test_the_checksum_golden():
    """The bytes hashed, written out by hand for a small dict."""
    obj = {"a": 1, "b": [None, 0.5, b"x"], "t": torch.tensor([1, 2], dtype=torch.uint8)}
    by_hand = (b"D3" + b"S1:a" + b"I1;" + b"S1:b" + b"L3" + b"None" + b"F0x1.0000000000000p-1;" + b"B1:x"
               + b"S1:t" + b"Ttorch.uint8(2,)" + b"\x01\x02")
    assert ck.content_sha256(obj) == hashlib.sha256(by_hand).hexdigest()
    assert ck.content_sha256({**obj, "a": 2}) != ck.content_sha256(obj)
    assert ck.content_sha256({**obj, "b": (None, 0.5, b"x")}) != ck.content_sha256(obj)  # tuple != list
    with pytest.raises(TypeError, match="ndarray"):  # what weights_only would refuse, caught at save
        ck.content_sha256({"a": np.zeros(2)})
    with pytest.raises(TypeError, match="float64"):
        ck.content_sha256({"a": np.float64(0.5)})


def _flip_a_tensor_bit(path: Path) -> None:
    """Flip the lowest bit of a byte in the middle of the largest tensor's data in the zip file."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = (int.from_bytes(raw[info.header_offset + o:info.header_offset + o + 2], "little")
                           for o in (26, 28))
    raw[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 1
    path.write_bytes(bytes(raw))


def test_a_flipped_bit_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "c.pt"
    ck.atomic_save(_handmade(), path)
    ck.load_checkpoint(path)
    _flip_a_tensor_bit(path)
    with pytest.raises(UserError, match=f"{path}: damaged"):
        ck.load_checkpoint(path)


def test_an_older_checkpoint_is_refused_with_the_way_to_convert_it(tmp_path, capsys):
    """The previous layout: numpy's RNG state as numpy objects and no checksum. The loader refuses
    it (naming the converter, not falling back to unsafe loading); the converter reads it without
    running code and the result resumes the same generators."""
    old = tmp_path / "old.pt"
    state = _handmade()
    state["rng"] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    torch.save(state, old)
    with pytest.raises(UserError, match="older format.*aiayn upgrade-checkpoint"):
        ck.load_checkpoint(old)
    assert main(["upgrade-checkpoint", str(old), "--out", str(tmp_path / "new.pt")]) == 0
    new = ck.load_checkpoint(tmp_path / "new.pt")
    rt.set_rng_state(new["rng"])
    a = np.random.rand(3), random.random()
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    assert np.array_equal(a[0], np.random.rand(3)) and a[1] == random.random()
    # a file without a checksum (older averaged models) converts as well
    torch.save({k: v for k, v in _handmade().items() if k != "rng"}, old)
    with pytest.raises(UserError, match="no checksum"):
        ck.load_checkpoint(old)
    assert main(["upgrade-checkpoint", str(old)]) == 0
    ck.load_checkpoint(old)


def test_an_older_training_checkpoint_resumes_with_the_fields_it_lacks(tmp_path):
    """A training checkpoint of before ``best_valid_bleu``, ``valid_seconds`` and ``valid_bleu_seconds``
    (and of one process: no per-rank states) reads as ``Contents`` with their defaults, and
    ``aiayn upgrade-checkpoint`` writes them in."""
    from aiayn.checkpoint.contents import Contents
    from aiayn.checkpoint.run import TrainState
    cfg = aiayn.get_preset("tiny", vocab_size=50)
    old = {"format": ck.FORMAT, "run_config": {}, "model_config": to_dict(cfg), "model": aiayn.Transformer(cfg).state_dict(),
           "optimizer": {"state": {}},
           "sampler": {}, "rng": rt.rng_state(), "tokenizers": {}, "step": 7, "epoch": 1, "tokens": 70,
           "flops": 1.0, "train_seconds": 3.0, "best_valid_loss": 2.5, "bad_validations": 0, "valid": None}
    saved = Contents.from_dict(old)
    assert (saved.best_valid_bleu, saved.valid_seconds, saved.rank_optimizers, saved.ema) == (-float("inf"), 0.0,
                                                                                             None, None)
    assert TrainState.of(saved) == TrainState(step=7, epoch=1, tokens=70, flops=1.0, train_seconds=3.0,
                                              best_valid_loss=2.5)
    torch.save(old, tmp_path / "old.pt")
    assert main(["upgrade-checkpoint", str(tmp_path / "old.pt")]) == 0
    assert list(ck.load_checkpoint(tmp_path / "old.pt"))[:-1] == list(Contents.from_dict(old).to_dict())


def test_the_docs_table_is_the_checkpoint_fields():
    """docs/checkpoints.md's table of keys is ``Contents``' fields with their help, in order."""
    from aiayn.checkpoint.contents import docs_table
    text = (Path(__file__).parents[2] / "docs" / "checkpoints.md").read_text()
    start = text.index("| key | what |")
    assert text[start:text.index("\n\n", start)] == docs_table()


def test_the_docs_name_every_key_beside_the_fields(tmp_path):
    """An average's and an ensemble file's keys outside ``Contents`` are each named in the paragraph
    after the table."""
    import dataclasses

    from aiayn.checkpoint.contents import Contents
    text = (Path(__file__).parents[2] / "docs" / "checkpoints.md").read_text()
    besides = text[text.index("Besides them, every file"):].split("\n\n")[0]
    for i in (1, 2):
        ck.atomic_save(_handmade(i), tmp_path / f"c{i}.pt")
    average = ck.average_checkpoints([tmp_path / "c1.pt", tmp_path / "c2.pt"])
    ck.atomic_save(average, tmp_path / "a.pt")
    ensemble = ck.ensemble_checkpoint([tmp_path / "a.pt", tmp_path / "c2.pt"])
    fields = {f.name for f in dataclasses.fields(Contents)} | {"sha256"}
    for key in (set(average) | set(ensemble)) - fields:
        assert f"`{key}`" in besides, key


def test_rng_state_round_trips_every_generator():
    state = rt.rng_state()
    want = torch.rand(3), np.random.rand(3), random.random()
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    rt.set_rng_state(state)
    got = torch.rand(3), np.random.rand(3), random.random()
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]


def test_resume_falls_back_to_the_newest_intact_step_checkpoint(tmp_path, caplog):
    from aiayn.checkpoint.run import resume_checkpoint
    for step in (2, 4):
        ck.atomic_save(_handmade(step), tmp_path / f"ckpt_step{step:08d}.pt")
    assert resume_checkpoint(tmp_path)[1]["step"] == 4  # last.pt lost (killed before its copy)
    assert resume_checkpoint(tmp_path)[0] == tmp_path / "ckpt_step00000004.pt"  # the file the run names
    ck.atomic_copy(tmp_path / "ckpt_step00000004.pt", tmp_path / "last.pt")
    assert resume_checkpoint(tmp_path)[0] == tmp_path / "last.pt"
    _flip_a_tensor_bit(tmp_path / "last.pt")
    _flip_a_tensor_bit(tmp_path / "ckpt_step00000004.pt")
    with caplog.at_level(logging.WARNING):
        assert resume_checkpoint(tmp_path)[1]["step"] == 2
    assert "last.pt: damaged" in caplog.text and "resuming from" in caplog.text
    assert "ckpt_step00000002.pt (step 2) instead" in caplog.text
    _flip_a_tensor_bit(tmp_path / "ckpt_step00000002.pt")
    with pytest.raises(UserError, match="last.pt: damaged"):  # nothing intact: last.pt's error
        resume_checkpoint(tmp_path)


class _FullDisk(io.RawIOBase):
    """A file that takes 1,000 bytes and then fails as a full disk does."""

    def __init__(self):
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.n += len(b)
        if self.n > 1000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return len(b)

    def fileno(self) -> int:
        raise OSError("no descriptor")


def test_a_full_disk_is_a_clear_error_and_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    ck.atomic_save(_handmade(1), path)
    real_fdopen = os.fdopen

    def fdopen(fd, *args, **kwargs):
        os.close(fd)
        return io.BufferedWriter(_FullDisk())
    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(UserError, match=f"{path}: cannot write \\(No space left on device\\); free some space"):
        ck.atomic_save(_handmade(2), path)
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    assert ck.load_checkpoint(path)["step"] == 1
    assert not list(tmp_path.glob(".*.aiayn-tmp-*"))


def test_a_full_disk_anywhere_in_training_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """Beyond the checkpoints (which name their file): the train log, a segmentation, ..."""
    from aiayn.train import loop

    def train(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "train_log.jsonl"))
    monkeypatch.setattr(loop, "train", train)
    assert main(["train", "--data", str(tmp_path), "--out", str(tmp_path), "--preset", "tiny"]) == 2
    assert "train_log.jsonl: cannot write (No space left on device); free some space" in capsys.readouterr().err


def test_a_full_disk_at_a_checkpoint_in_training_says_the_run_resumes(small_data_dir, tmp_path, monkeypatch, capsys):
    def no_room(path, write):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr("aiayn.checkpoint.format.atomic_write", no_room)  # the checkpoints' writes, no other
    run = tmp_path / "run"
    assert main(["train", "--data", str(small_data_dir), "--out", str(run), "--preset", "tiny", "--no-progress",
                 *FAST, "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"aiayn train: error: {run}/") and err.endswith(
        ": cannot write (No space left on device); free some space; the files already there are intact; "
        "the same command resumes from the last checkpoint once it can write")


def test_an_output_whose_folder_is_missing_is_refused_before_the_work(tmp_path, capsys):
    """average, ensemble, import, upgrade-checkpoint and translate's --attention-out write at the
    end: a folder that is not there is said first."""
    out = tmp_path / "gone" / "avg.pt"
    assert main(["average", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"aiayn average: error: {out}: its folder {out.parent} does not exist"
    (tmp_path / "in.txt").write_text("a\n")
    att = tmp_path / "gone" / "att.json"
    assert main(["translate", "--checkpoint", str(tmp_path / "m.pt"), "--input", str(tmp_path / "in.txt"),
                 "--attention-out", str(att)]) == 2
    assert capsys.readouterr().err.strip() == f"aiayn translate: error: {att}: its folder {att.parent} does not exist"
    for given, said in ((tmp_path / "nope", "not found"), (tmp_path / "in.txt", "not a directory")):
        assert main(["import", str(given), "--out", str(tmp_path / "x.pt")]) == 2
        assert capsys.readouterr().err.strip() == (f"aiayn import: error: {given}: {said} (the folder that "
                                                   f"MarianMTModel.save_pretrained writes)")


def test_atomic_writes_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        ck.atomic_save(_handmade(), tmp_path / "c.pt")
        write_json_atomic(tmp_path / "manifest.json", {"a": 1})
        assert (tmp_path / "c.pt").stat().st_mode & 0o777 == 0o644
        assert (tmp_path / "manifest.json").stat().st_mode & 0o777 == 0o644
        os.umask(0o077)
        atomic_write(tmp_path / "private", lambda f: f.write(b"x"))
        assert (tmp_path / "private").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_keep_last_zero_keeps_every_step_checkpoint(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / f"ckpt_step{step:08d}.pt").write_bytes(b"")
    ck.prune(tmp_path, 0)
    assert len(ck.step_checkpoints(tmp_path)) == 3
    ck.prune(tmp_path, 2)
    assert [p.name for p in ck.step_checkpoints(tmp_path)] == ["ckpt_step00000002.pt", "ckpt_step00000003.pt"]
    from aiayn.config import ConfigError
    from aiayn.train.config import TrainConfig
    with pytest.raises(ConfigError, match="keep_last must be >= 0"):
        TrainConfig(keep_last=-1)


def test_validation_cuts_a_pair_longer_than_a_batch(tmp_path, caplog):
    """One 3,000-token line in the validation split: validation reads it cut to one batch's
    bound (no batch longer than the training batches), with one warning at the start."""
    from aiayn.config import replace
    from aiayn.train.config import run_config_from_preset
    from aiayn.train.validation import validate

    class Split:
        src_lens = np.array([5, 3000, 7])
        tgt_lens = np.array([6, 2900, 4])

        def __len__(self):
            return 3

        def src(self, i):
            return np.full(self.src_lens[i], 5, dtype=np.int64)

        def tgt(self, i):
            return np.full(self.tgt_lens[i], 6, dtype=np.int64)

        def __getitem__(self, i):
            return self.src(i), self.tgt(i)

    cfg = run_config_from_preset("tiny")
    cfg = replace(cfg, model=aiayn.get_preset("tiny", vocab_size=10),
                  train=replace(cfg.train, max_src_tokens=64, max_tgt_tokens=48, c_kernels=False))
    model = aiayn.Transformer(cfg.model)
    shapes = []
    forward = model.forward
    model.forward = lambda src, tgt_in, *a, **k: (shapes.append((src.shape, tgt_in.shape)), forward(src, tgt_in, *a, **k))[1]
    out = validate(model, Split(), cfg.train, rt.Place(rt.Dist(), torch.device("cpu"), "fp32"))
    assert max(s.numel() for s, _ in shapes) <= 64 and max(t.numel() for _, t in shapes) <= 48
    assert max(s[1] for s, _ in shapes) == 64 and max(t[1] for _, t in shapes) == 48  # the cut pair: 63 + EOS, BOS + 47
    assert np.isfinite(out["valid_loss"])
    from aiayn.train.validation import warn_long_pairs
    with caplog.at_level(logging.WARNING):
        warn_long_pairs("valid", Split(), cfg.train)
    assert caplog.text.count("cut to 63 source and 47 target tokens") == 1 and "pair(s) 2" in caplog.text


def test_run_directory_guards(small_data_dir, tiny_checkpoint, tmp_path, capsys):
    """Stale temporaries of a killed run are removed at the next start; a refused resume leaves
    config.json as it was; a second training of a locked run directory is an error naming the
    holder's pid."""
    import fcntl
    run = tmp_path / "run"
    shutil.copytree(tiny_checkpoint.parent, run)  # a run of 3 steps
    config = (run / "config.json").read_text()
    (run / ".last.pt.aiayn-tmp-abc123de").write_bytes(b"half")
    (run / ".avg.pt.aiayn-tmp-abc123de").write_bytes(b"another command's, writing now")
    argv = ["train", "--data", str(small_data_dir), "--out", str(run), "--preset", "tiny", "--no-progress", *FAST,
            "--max-steps", "2"]
    assert main(argv + ["--set", "model.d_ff=64"]) == 2
    d_ff = aiayn.get_preset("tiny").d_ff
    assert (f"the run was trained with another model (model.d_ff {d_ff}, now 64); resume with its settings "
            f"(--recipe {run / 'config.json'})") in capsys.readouterr().err
    assert (run / "config.json").read_text() == config
    assert not (run / ".last.pt.aiayn-tmp-abc123de").exists() and (run / ".avg.pt.aiayn-tmp-abc123de").exists()
    with open(run / "train.lock", "w") as lock:  # held as a training holds it (rundir.RunLock)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert main(argv) == 2
        assert f"another training (pid {os.getpid()}) is writing this run directory" in capsys.readouterr().err
    assert ck.load_checkpoint(run / "last.pt")["step"] == 3  # the refused one wrote nothing
    # what the refusal says resumes it: the run's own config.json as the recipe
    assert main(["train", "--data", str(small_data_dir), "--out", str(run), "--recipe", str(run / "config.json"),
                 "--no-progress", "--max-steps", "4"]) == 0
    assert ck.load_checkpoint(run / "last.pt")["step"] == 4


@pytest.mark.slow
def test_two_process_resume_with_dropout_is_exact(small_data_dir, tmp_path):
    """2 data-parallel ranks with dropout 0.1: stopped at step 5 and resumed to 10, the weights are
    those of 10 uninterrupted steps, bit for bit (each rank resumes its own dropout generator)."""
    extra = ["--set", "model.p_drop=0.1", "--set", "train.max_time_min=1000"]  # (no lr_decay_frac: Eq. 3 alone)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(out: Path, steps: int) -> None:
        """The two ranks started directly, as torchrun would (its launcher is a third Python)."""
        argv = _train_cmd(small_data_dir, out, steps, extra)
        port = _free_port()
        logs = [open(tmp_path / f"rank{r}.log", "a") for r in range(2)]
        ranks = [subprocess.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                                  stdout=subprocess.DEVNULL, stderr=logs[r]) for r in range(2)]
        assert _wait_for_all(ranks, logs) == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]

    run(tmp_path / "whole", 10)
    run(tmp_path / "resumed", 5)
    run(tmp_path / "resumed", 10)
    a, b = (ck.load_checkpoint(tmp_path / d / "last.pt") for d in ("whole", "resumed"))
    assert a["step"] == b["step"] == 10
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert not torch.equal(b["rank_rng"][0]["torch"], b["rank_rng"][1]["torch"])  # the ranks' generators differ


def test_an_older_checkpoint_s_execution_settings_move_to_the_training_section(tmp_path):
    """Checkpoints of older versions kept ``fast_dropout`` and ``attn_fp32`` in their model sections:
    loaded, the model sections are today's ModelConfig, and the settings are the run's training
    section's (where it does not set them itself)."""
    from aiayn.config import from_dict
    from aiayn.model import ModelConfig
    from aiayn.train.config import RunConfig, run_config_from_dict
    old = _handmade()
    old["model_config"] = {**old["model_config"], "fast_dropout": False, "attn_fp32": False}
    run = to_dict(RunConfig(model=aiayn.get_preset("tiny", vocab_size=10)))
    for name in ("fast_dropout", "attn_fp32"):
        del run["train"][name]
    run["model"] = {**run["model"], "fast_dropout": False, "attn_fp32": False}
    old["run_config"] = run
    ck.atomic_save(old, tmp_path / "old.pt")
    ckpt = ck.load_checkpoint(tmp_path / "old.pt")
    assert from_dict(ModelConfig, ckpt["model_config"]) == aiayn.get_preset("tiny", vocab_size=10)
    cfg = run_config_from_dict(ckpt["run_config"])
    assert cfg.model == aiayn.get_preset("tiny", vocab_size=10)
    assert (cfg.train.fast_dropout, cfg.train.attn_fp32) == (False, False)
    old["run_config"]["train"]["attn_fp32"] = True  # the training section's own setting stays
    ck.atomic_save(old, tmp_path / "mixed.pt")
    cfg = run_config_from_dict(ck.load_checkpoint(tmp_path / "mixed.pt")["run_config"])
    assert (cfg.train.fast_dropout, cfg.train.attn_fp32) == (False, True)


def test_a_checkpoint_and_config_json_written_before_attn_bias_load_with_the_biases(tiny_checkpoint, tmp_path):
    """Versions before ``model.attn_bias`` had biases on every attention projection and wrote no such
    field: their checkpoints load as models with the biases (and translate as before), and their
    run's config.json (a whole configuration) as a recipe with them; a recipe's few fields on a preset
    keep the preset's (the paper's: none)."""
    import json
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.loading import load_model_for_inference
    from aiayn.decode.translator import Translator
    from aiayn.train.config import load_recipe
    ckpt = ck.load_checkpoint(tiny_checkpoint)
    cfg = aiayn.ModelConfig(**{**ckpt["model_config"], "attn_bias": True})
    torch.manual_seed(0)
    biased = aiayn.Transformer(cfg).eval()
    biased.load_state_dict(ckpt["model"], strict=False)  # the trained weights, and random biases:
    with torch.no_grad():
        for name, p in biased.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.5)
    old = {**ckpt, "model": biased.state_dict()}
    old["model_config"] = {k: v for k, v in ckpt["model_config"].items() if k != "attn_bias"}
    old["run_config"] = {**ckpt["run_config"], "model": dict(old["model_config"])}
    ck.atomic_save(old, tmp_path / "old.pt")
    model, src_tok, tgt_tok = load_model_for_inference(tmp_path / "old.pt")
    assert model.cfg == cfg and model.cfg.attn_bias
    for k, v in biased.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    lines = ["a b c", "the quick brown fox", "x"]
    decode = DecodeConfig(beam_size=2, max_len_a=0.0, max_len_b=8)
    with Translator(biased, src_tok, tgt_tok, decode) as tr:
        want = tr.translate(lines)
    with Translator.from_checkpoint(tmp_path / "old.pt", decode) as tr:
        assert tr.translate(lines) == want
    whole = {"preset": "tiny", "model": old["model_config"], "train": ckpt["run_config"]["train"]}
    (tmp_path / "config.json").write_text(json.dumps(whole))
    assert load_recipe(tmp_path / "config.json").model == cfg
    (tmp_path / "recipe.json").write_text(json.dumps({"preset": "base", "model": {"d_model": 256, "eos_id": 3}}))
    assert not load_recipe(tmp_path / "recipe.json").model.attn_bias


def test_a_resume_drops_what_the_interrupted_run_logged_after_its_checkpoint(small_data_dir, tmp_path):
    """Killed after step 4 was logged but before its checkpoint, in the middle of a line: the resumed
    run trains steps 3 and 4 again from step 2's checkpoint, and the train log holds each step once,
    the resumed run's (the lost steps' lines and the cut line are gone), and the lines before."""
    import json
    from tests.train.test_training import _train_in_process
    run = tmp_path / "run"
    _train_in_process(small_data_dir, run, 4, "train.save_every_steps=2", "model.p_drop=0.1")
    shutil.copyfile(run / "ckpt_step00000002.pt", run / "last.pt")  # as if killed before step 4's save
    (run / "ckpt_step00000004.pt").unlink()
    (run / "summary.json").unlink()
    log = run / "train_log.jsonl"
    before = [json.loads(line) for line in log.read_text().splitlines()]
    with open(log, "a") as f:
        f.write('{"step": 5, "train_lo')
    _train_in_process(small_data_dir, run, 4, "train.save_every_steps=2", "model.p_drop=0.1")
    after = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(d["step"], "valid_loss" in d) for d in after] == [(1, False), (2, False), (2, True), (3, False),
                                                               (4, False), (4, True)]
    assert after[:3] == before[:3]  # up to the checkpoint, as logged
    assert [d["train_loss"] for d in after[3:5]] == [d["train_loss"] for d in before[3:5]]  # trained again alike


def _first_format(ckpt: dict) -> dict:
    """``ckpt`` as the first format wrote it: numpy's and Python's generator states as their own
    objects, no checksum, no per-rank states, validation BLEU, validation times or moving average,
    the sampler's position per rank, and ``fast_dropout`` and ``attn_fp32`` in the model sections."""
    old = {k: v for k, v in ckpt.items() if k not in ("sha256", "rank_rng", "best_valid_bleu", "valid_seconds",
                                                       "valid_bleu_seconds", "ema")}
    n, p = ckpt["rng"]["numpy"], ckpt["rng"]["python"]
    old["rng"] = {"torch": ckpt["rng"]["torch"],
                  "numpy": (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                            n["cached_gaussian"]),
                  "python": (p["version"], tuple(p["words"].tolist()), p["gauss"])}
    s = ckpt["sampler"]
    old["sampler"] = {"epoch": s["epoch"], "position": s["batches_done"] // s["num_replicas"], "seed": s["seed"],
                      "num_replicas": s["num_replicas"], "rank": s["rank"], "n_examples": s["n_examples"],
                      "n_batches": s["n_batches_total"] // s["num_replicas"]}
    old["run_config"] = _first_format_config(ckpt["run_config"])
    old["model_config"] = old["run_config"]["model"]
    return old


def _first_format_config(run: dict) -> dict:
    train = dict(run["train"])
    return {"model": {**run["model"], **{k: train.pop(k) for k in ("fast_dropout", "attn_fp32")}}, "train": train}


def test_a_run_of_the_first_format_converted_resumes_exactly(small_data_dir, tmp_path, capsys):
    """A run directory as the first format left it at step 2 (its checkpoints and its config.json):
    resuming it is refused with the way to convert; converted, it resumes with its own config.json
    as the recipe and reaches step 4 with the weights of 4 uninterrupted steps, bit for bit."""
    import json
    from tests.train.test_training import _train_in_process
    whole, run = tmp_path / "whole", tmp_path / "old"
    _train_in_process(small_data_dir, whole, 4, "train.save_every_steps=2", "model.p_drop=0.1")
    run.mkdir()
    old = _first_format(torch.load(whole / "ckpt_step00000002.pt", weights_only=True))
    for name in ("ckpt_step00000002.pt", "last.pt"):
        torch.save(old, run / name)
    (run / "config.json").write_text(json.dumps(_first_format_config(json.loads((whole / "config.json").read_text()))))
    argv = ["train", "--data", str(small_data_dir), "--out", str(run), "--recipe", str(run / "config.json"),
            "--no-progress"]
    assert main(argv) == 2
    assert "older format" in capsys.readouterr().err
    for name in ("ckpt_step00000002.pt", "last.pt"):
        assert main(["upgrade-checkpoint", str(run / name)]) == 0
    assert main(argv) == 0
    a, b = (ck.load_checkpoint(d / "last.pt") for d in (whole, run))
    assert a["step"] == b["step"] == 4
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


@pytest.mark.parametrize("edit, said", [
    (lambda c: c.pop("step"), "not a training checkpoint: it lacks step (an average"),
    (lambda c: [c.pop(k) for k in ("optimizer", "sampler", "rng")], "it lacks optimizer, sampler, rng"),
    (lambda c: c.update(step="3"), "not a training checkpoint as aiayn writes one: step is str, not int"),
    (lambda c: c.update(flops=True), "flops is bool, not float"),
    (lambda c: c.update(rank_rng={}), "rank_rng is dict, not list or None"),
    (lambda c: c.update(surprise=1), "holds key(s) surprise, which this version of aiayn does not know")])
def test_a_resume_from_what_is_no_training_checkpoint_says_so(edit, said, small_data_dir, tiny_checkpoint, tmp_path,
                                                              capsys):
    """A sealed last.pt without a key a resume restores, with one of another type, or with one this
    version does not know: one line naming the file and the key, not a traceback."""
    run = tmp_path / "run"
    shutil.copytree(tiny_checkpoint.parent, run)
    for p in ck.step_checkpoints(run):
        p.unlink()
    ckpt = ck.load_checkpoint(run / "last.pt")
    edit(ckpt)
    ck.atomic_save(ckpt, run / "last.pt")
    assert main(["train", "--data", str(small_data_dir), "--out", str(run), "--recipe", str(run / "config.json"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"aiayn train: error: {run / 'last.pt'}: ") and said in err[-1], err
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("value, said", [
    (float("nan"), "holds NaN or infinite values"), (float("inf"), "holds NaN or infinite values")])
def test_weights_that_are_not_finite_are_refused(value, said, tmp_path):
    """Training never writes a NaN or an infinity into weights (``check_finite_weights``); a file
    that holds one is refused at load, naming the tensor, not translated with."""
    ckpt = _handmade()
    name = next(iter(ckpt["model"]))
    ckpt["model"][name].view(-1)[0] = value
    ck.atomic_save(ckpt, tmp_path / "c.pt")
    with pytest.raises(UserError, match=f"{tmp_path / 'c.pt'}: model.{name} {said}"):
        ck.load_checkpoint(tmp_path / "c.pt")


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_weights_that_are_not_floating_point_are_refused(dtype, tmp_path):
    """load_state_dict would cast integer, boolean or complex tensors into the weights silently."""
    ckpt = _handmade()
    name = next(iter(ckpt["model"]))
    ckpt["model"][name] = ckpt["model"][name].to(dtype)
    ck.atomic_save(ckpt, tmp_path / "c.pt")
    with pytest.raises(UserError, match=f"model.{name} holds {dtype} values, not floating point weights"):
        ck.load_checkpoint(tmp_path / "c.pt")


def test_bytes_after_the_archive_are_refused(tmp_path):
    """A file with bytes after torch.save's archive (appended to, or written over a longer file)
    loads as the archive alone; it is refused instead, by every reader."""
    path = tmp_path / "c.pt"
    ck.atomic_save(_handmade(), path)
    with open(path, "ab") as f:
        f.write(b"\x00" * 100)
    for read in (ck.load_checkpoint, lambda p: ck.upgrade_checkpoint(p, tmp_path / "new.pt")):
        with pytest.raises(UserError, match=f"{path}: damaged: bytes follow the end of its archive"):
            read(path)


def test_an_older_run_s_config_json_reads_as_a_recipe(tmp_path):
    """A run directory's config.json of the versions that kept ``fast_dropout`` and ``attn_fp32`` in the
    model section (the recipe a refused resume names): they are the training section's."""
    import json
    from aiayn.train.config import RunConfig, load_recipe
    run = to_dict(RunConfig(model=aiayn.get_preset("tiny", vocab_size=10)))
    run["train"]["fast_dropout"], run["train"]["attn_fp32"] = False, False
    (tmp_path / "config.json").write_text(json.dumps(_first_format_config(run)))
    cfg = load_recipe(tmp_path / "config.json")
    assert cfg.model == aiayn.get_preset("tiny", vocab_size=10)
    assert (cfg.train.fast_dropout, cfg.train.attn_fp32) == (False, False)


def _of_run(tmp_path: Path, name: str, lineage: dict | None, step: int = 0) -> Path:
    """A handmade checkpoint of the run ``lineage`` names (None: written before checkpoints kept one)."""
    ckpt = _handmade(step)
    if lineage is not None:
        ckpt["lineage"] = lineage
    ck.atomic_save(ckpt, tmp_path / name)
    return tmp_path / name


def test_average_refuses_checkpoints_of_two_runs(tmp_path, caplog, capsys):
    """Two runs begun apart (other seeds: other initial weights) average to no model: refused, naming
    both; --across-runs averages them with the same words as a warning, and the average keeps no lineage."""
    a = _of_run(tmp_path, "a.pt", {"seed": 1, "init_sha256": "a" * 64})
    b = _of_run(tmp_path, "b.pt", {"seed": 2, "init_sha256": "b" * 64})
    with pytest.raises(UserError, match=f"{b}: of another run than {a} \\(seed 2, initial weights bbbbbbbbbbbb; "
                                        f"seed 1, initial weights aaaaaaaaaaaa\\)"):
        ck.average_checkpoints([a, b])
    assert main(["average", str(a), str(b), "--out", str(tmp_path / "avg.pt")]) == 2
    assert "--across-runs" in capsys.readouterr().err and not (tmp_path / "avg.pt").exists()
    with caplog.at_level(logging.WARNING):
        assert main(["average", str(a), str(b), "--out", str(tmp_path / "avg.pt"), "--across-runs"]) == 0
    assert f"{b}: of another run than {a}" in caplog.text
    assert "lineage" not in ck.load_checkpoint(tmp_path / "avg.pt")


def test_average_of_one_run_or_of_fine_tunings_of_one_checkpoint_says_nothing(tmp_path, caplog):
    """A run's last checkpoints, and models fine-tuned from one checkpoint (their own seeds, its
    initial weights), average without a word; the average keeps the lineage, so a model fine-tuned
    from it is of the run too."""
    run = {"seed": 1, "init_sha256": "a" * 64}
    last = [_of_run(tmp_path, f"ckpt_step{s:08d}.pt", run, s) for s in range(1, 6)]
    tuned = [_of_run(tmp_path, f"tuned{s}.pt", {**run, "seed": s}) for s in (3, 4)]
    with caplog.at_level(logging.WARNING):
        assert ck.average_checkpoints(last)["lineage"] == run
        assert ck.average_checkpoints([*tuned, last[-1]])["lineage"]["init_sha256"] == run["init_sha256"]
    assert caplog.text == ""


def test_average_takes_a_model_fine_tuned_with_another_dropout_and_names_what_else_differs(tmp_path):
    """``train --init-from`` may change dropout (the same parameters and the same function at inference):
    such a model averages with its parent, to the exact mean (1 and 3 average to 2); any other field
    that differs is refused, named with both values."""
    run = {"seed": 1, "init_sha256": "a" * 64}
    parent = _handmade()
    tuned = copy.deepcopy(parent)
    tuned["model_config"]["p_drop"] = 0.3
    parent["model"] = {k: torch.full_like(v, 1.0) for k, v in parent["model"].items()}
    tuned["model"] = {k: torch.full_like(v, 3.0) for k, v in tuned["model"].items()}
    for name, ckpt in (("parent.pt", parent), ("tuned.pt", tuned)):
        ck.atomic_save({**ckpt, "lineage": run}, tmp_path / name)
    avg = ck.average_checkpoints([tmp_path / "parent.pt", tmp_path / "tuned.pt"])
    assert all(torch.equal(v, torch.full_like(v, 2.0)) for v in avg["model"].values())
    other = copy.deepcopy(tuned)
    other["model_config"]["eos_id"] = 4
    ck.atomic_save({**other, "lineage": run}, tmp_path / "other.pt")
    with pytest.raises(UserError, match=f"{tmp_path / 'other.pt'}: a different model from {tmp_path / 'parent.pt'} "
                                        f"\\(eos_id 3 there, 4 here\\); cannot average"):
        ck.average_checkpoints([tmp_path / "parent.pt", tmp_path / "other.pt"])


def test_average_names_files_of_one_name_by_their_paths(tmp_path, capsys):
    """A parent's and its fine-tuned models' ``last.pt`` averaged: the files read are told apart."""
    run = {"seed": 1, "init_sha256": "a" * 64}
    (tmp_path / "base").mkdir(), (tmp_path / "tuned").mkdir()
    files = [_of_run(tmp_path, f"{d}/last.pt", run) for d in ("base", "tuned")]
    assert main(["average", *map(str, files), "--out", str(tmp_path / "avg.pt")]) == 0
    assert capsys.readouterr().out.strip().endswith(f": {files[0]}, {files[1]}")


def test_average_warns_of_checkpoints_without_a_lineage(tmp_path, caplog):
    """A file written before checkpoints kept a lineage cannot say its run: averaged with others, a
    warning names it (alone, nothing to compare: no word)."""
    a = _of_run(tmp_path, "a.pt", {"seed": 1, "init_sha256": "a" * 64})
    old = _of_run(tmp_path, "old.pt", None)
    with caplog.at_level(logging.WARNING):
        avg = ck.average_checkpoints([a, old])
        assert caplog.text.count("no lineage") == 1 and f"{old}: no lineage" in caplog.text
        assert "lineage" not in avg
        caplog.clear()
        ck.average_checkpoints([old])
    assert caplog.text == ""


@pytest.mark.slow
def test_runs_record_their_lineage_and_fine_tuning_carries_it(small_data_dir, tmp_path, caplog):
    """A new run's checkpoints share one lineage (its seed, the checksum of its initial weights), kept by a
    resume; runs fine-tuned from it carry it whatever their seed; a run of another seed has another one;
    a fine-tuning of a file without one takes the checksum of that file's weights. Every file also says
    which aiayn, checkout and torch wrote it (a result repeated later needs to know)."""
    def train(out: Path, steps: int, *extra: str) -> Path:
        assert main(["train", "--data", str(small_data_dir), "--out", str(out), "--preset", "tiny", "--no-progress",
                     *FAST, "--max-steps", str(steps), "--set", "train.save_every_steps=1", *extra]) == 0
        return out
    run = train(tmp_path / "a", 2, "--set", "train.seed=1")
    train(run, 3, "--set", "train.seed=1")  # resumed
    lineage = ck.load_checkpoint(run / "ckpt_step00000001.pt")["lineage"]
    assert lineage["seed"] == 1 and len(lineage["init_sha256"]) == 64
    assert all(ck.load_checkpoint(p)["lineage"] == lineage for p in [*ck.step_checkpoints(run), run / "last.pt"])
    tuned = [train(tmp_path / f"t{s}", 1, "--init-from", str(run / "last.pt"), "--set", f"train.seed={s}")
             for s in (3, 4)]
    assert all(ck.load_checkpoint(t / "last.pt")["lineage"] == lineage for t in tuned)
    other = train(tmp_path / "b", 1, "--set", "train.seed=2")
    assert ck.load_checkpoint(other / "last.pt")["lineage"]["init_sha256"] != lineage["init_sha256"]
    with caplog.at_level(logging.WARNING):
        ck.average_checkpoints([*ck.step_checkpoints(run), *(t / "last.pt" for t in tuned)])
    assert caplog.text == ""
    with pytest.raises(UserError, match="of another run"):
        ck.average_checkpoints([run / "last.pt", other / "last.pt"])
    old = {k: v for k, v in ck.load_checkpoint(run / "last.pt").items() if k != "lineage"}
    ck.atomic_save(old, tmp_path / "old.pt")
    tuned_old = train(tmp_path / "t_old", 1, "--init-from", str(tmp_path / "old.pt"))
    assert ck.load_checkpoint(tuned_old / "last.pt")["lineage"] == {"seed": None,
                                                                    "init_sha256": ck.content_sha256(old["model"])}
    # and each file names the code that wrote it; an average keeps its last member's
    from aiayn.host.environment import source_commit
    written = ck.load_checkpoint(run / "last.pt")["written_by"]
    assert written == {"aiayn": aiayn.__version__, "torch": str(torch.__version__),
                       "source": source_commit(Path(aiayn.__file__).resolve().parent)}
    assert ck.average_checkpoints(ck.step_checkpoints(run))["written_by"] == written
