"""Decoding in several worker processes (DecodeConfig.workers, decode/workers.py): the batches
are shared out and the translations are those of one process, in input order."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from aiayn.config import ConfigError
from aiayn.decode.config import DecodeConfig
from aiayn.decode.loading import load_model_for_inference
from aiayn.decode.translator import Translator
from aiayn.decode.workers import spread
from tests.conftest import int8_refusal

LINES = ["A dog runs.", "", "Two men are sitting on a bench in the park.", "A woman is reading a book.",
         "Children play football on a green field next to the old church.", "A cat.", "",
         "The man in the red shirt is cooking dinner for his family.", "People walk in the rain."]


def test_spread_halves_the_largest_batch_until_every_worker_has_one():
    lengths = [10, 8, 8, 7, 3, 3]  # sentence i has lengths[i] source tokens
    # one batch of 4 (4 x 10 = 40 padded tokens) and one of 2 (2 x 3 = 6): the first is halved
    assert spread([[0, 1, 2, 3], [4, 5]], lengths, 3) == [[0, 1], [2, 3], [4, 5]]
    # then [0, 1] (20) is the largest again: halved
    assert spread([[0, 1, 2, 3], [4, 5]], lengths, 4) == [[0], [1], [2, 3], [4, 5]]
    assert spread([[0], [1]], lengths, 4) == [[0], [1]]  # one sentence per batch: nothing left to split
    # the largest batch is one long sentence: the next largest that can be halved is
    assert spread([[0], [1, 2]], [100, 10, 10], 3) == [[0], [1], [2]]
    assert spread([[0, 1, 2]], lengths, 2) == [[0, 1], [2]]  # the odd one goes to the first half
    assert spread([[0, 1, 2]], lengths, 1) == [[0, 1, 2]]


def test_workers_must_be_positive():
    with pytest.raises(ConfigError, match="workers"):
        DecodeConfig(workers=0)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_two_workers_translate_as_one_process(tiny_checkpoint, precision):
    if precision == "int8" and (why := int8_refusal()):  # the workers, spawned, make their own decoding copies
        pytest.skip(f"decoding refuses int8 here: {why}")
    model, src_tok, tgt_tok = load_model_for_inference(tiny_checkpoint)
    cfg = DecodeConfig(beam_size=3, nbest=2, max_len_b=8, batch_tokens=40, precision=precision)
    one = Translator(model, src_tok, tgt_tok, cfg)
    with Translator(model, src_tok, tgt_tok, DecodeConfig(**{**cfg.__dict__, "workers": 2})) as two:
        assert len(two.batches(two.encode(LINES))) >= 2  # several batches to share
        got = two.translate_nbest(LINES)
        threads = torch.get_num_threads()
        torch.set_num_threads(two._pool.threads)  # a worker's share of the threads (its products split so too)
        try:
            want = one.translate_nbest(LINES)
        finally:
            torch.set_num_threads(threads)
        assert [[t.text for t in ts] for ts in got] == [[t.text for t in ts] for ts in want]
        # as many batches as workers or more, so each goes whole to a worker, which runs this process's
        # operations on the same shapes and the same weights with as many threads (its flushing of
        # denormals changes no sum: aiayn/host/denormals.py): the same scores bit for bit
        assert [t.score for ts in got for t in ts] == [t.score for ts in want for t in ts]
        assert got[1] == [] and got[6] == []  # empty lines stay empty, in place
        assert "models" not in two.__dict__  # only the workers made decoding copies
        # one batch only: it is halved so that both workers decode; the same translations
        single = two.translate(LINES[:4])
        assert single == one.translate(LINES[:4])
        assert two._pool is not None and two._pool.threads >= 1
        # settings changed on the Translator after its workers started reach them (the demo tunes α so)
        one.cfg = DecodeConfig(beam_size=2, alpha=1.4, max_len_b=8, batch_tokens=40, precision=precision)
        two.cfg = DecodeConfig(**{**one.cfg.__dict__, "workers": 2})
        assert two.translate(LINES) == one.translate(LINES)
        # MBR: the workers return the whole beam, the choice is made in the calling process
        one.cfg = DecodeConfig(beam_size=3, max_len_b=8, batch_tokens=40, precision=precision, mbr=True)
        two.cfg = DecodeConfig(**{**one.cfg.__dict__, "workers": 2})
        assert two.translate(LINES) == one.translate(LINES)
    assert two._pool is None  # closed by the with block


def test_translate_command_with_workers(tiny_checkpoint, tmp_path, capsys):
    from aiayn.cli import main

    src = tmp_path / "in.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    assert main(["translate", "--checkpoint", str(tiny_checkpoint), "--input", str(src), "--beam-size", "2",
                 "--max-len-b", "6", "--batch-tokens", "40"]) == 0
    one = capsys.readouterr().out
    assert main(["translate", "--checkpoint", str(tiny_checkpoint), "--input", str(src), "--beam-size", "2",
                 "--max-len-b", "6", "--batch-tokens", "40", "--workers", "2"]) == 0
    two = capsys.readouterr().out
    assert two == one and len(two.splitlines()) == len(LINES)


def test_workers_refuse_a_packed_copy(tiny_checkpoint):
    """A packed decoding copy's state is not a float model's (the tied output projection becomes a
    module of its own): workers refuse it with the same clear error as an int8 copy."""
    from aiayn.decode.packed import packed_copy, resolve_library
    from aiayn.errors import UserError

    library = resolve_library("auto")
    if library is None:
        pytest.skip("no packing library in this PyTorch")
    model, src_tok, tgt_tok = load_model_for_inference(tiny_checkpoint)
    with Translator(packed_copy(model, library), src_tok, tgt_tok, DecodeConfig(workers=2)) as tr:
        with pytest.raises(UserError, match="float model"):
            tr.translate(LINES)


def test_workers_refuse_an_int8_copy(tiny_checkpoint, int8_anywhere):
    from aiayn.decode.int8 import int8_copy
    from aiayn.errors import UserError

    model, src_tok, tgt_tok = load_model_for_inference(tiny_checkpoint)
    with Translator(int8_copy(model), src_tok, tgt_tok, DecodeConfig(precision="int8", workers=2)) as tr:
        with pytest.raises(UserError, match="float model"):
            tr.translate(LINES)


def test_workers_started_without_the_main_guard_fail_at_once(tiny_checkpoint, tmp_path):
    """A script without ``if __name__ == "__main__":`` makes each spawned worker die starting. The weights
    reach the workers in a file, so the start message is small: the pool breaks (a UserError saying
    why) instead of this process waiting forever on a full pipe; the file is removed at close."""
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from aiayn.decode.config import DecodeConfig\n"
        "from aiayn.decode.translator import Translator\n"
        f"t = Translator.from_checkpoint({str(tiny_checkpoint)!r}, DecodeConfig(workers=2))\n"
        "print(t.translate(['a b c']))\n")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode != 0
    assert "must start them under `if __name__ == \"__main__\":`" in res.stderr.splitlines()[-1], res.stderr[-2000:]


def test_the_pools_file_is_removed_when_it_closes(tiny_checkpoint, tmp_path, monkeypatch):
    """The weights' file is gone after close; on Linux its name is gone at once (the workers read it
    through this process's descriptor) and the descriptor is closed at close."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    linux = sys.platform.startswith("linux")
    with Translator.from_checkpoint(tiny_checkpoint, DecodeConfig(workers=2)) as t:
        assert t.translate(["a b c"]) == Translator.from_checkpoint(tiny_checkpoint).translate(["a b c"])
        assert len(list(tmp_path.glob("aiayn-workers-*"))) == (0 if linux else 1)
        if linux:
            assert len(_open_weights_files()) == 1
    assert list(tmp_path.glob("aiayn-workers-*")) == []
    if linux:
        assert _open_weights_files() == []


def _open_weights_files() -> list[str]:
    """The files this process holds open whose names were the pools' (Linux)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (listdir's own descriptor, closed meanwhile)
            continue
        if "aiayn-workers-" in target:
            out.append(target)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the weights' file is unnamed on Linux only")
def test_a_killed_process_leaves_no_copy_of_the_weights(tiny_checkpoint, tmp_path):
    """`aiayn translate --workers 2` ended by a signal (kill, timeout, the out-of-memory killer) runs no
    clean-up code: its temporary folder must not keep a copy of the weights for each such run."""
    import signal
    import subprocess
    script = tmp_path / "hold.py"
    script.write_text(
        "import sys, time\n"
        "from aiayn.decode.config import DecodeConfig\n"
        "from aiayn.decode.translator import Translator\n"
        "if __name__ == '__main__':\n"
        f"    t = Translator.from_checkpoint({str(tiny_checkpoint)!r}, DecodeConfig(workers=2))\n"
        "    t.translate(['a b c', 'd e f g h'])\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline() == "ready\n"
        assert list(tmp.glob("aiayn-workers-*")) == []  # no name while it runs
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.stdout.close()
    assert list(tmp.glob("aiayn-workers-*")) == []


def test_from_checkpoint_decodes_with_the_settings_the_checkpoint_carries(tiny_checkpoint, tmp_path):
    """The demo stores the α it chose in model.pt; the library decodes with it, as the commands do,
    unless given a DecodeConfig."""
    from aiayn.checkpoint import atomic_save, load_checkpoint
    path = tmp_path / "with_alpha.pt"
    atomic_save({**load_checkpoint(tiny_checkpoint), "decode": {"alpha": 1.4}}, path)
    assert Translator.from_checkpoint(path).cfg.alpha == 1.4
    assert Translator.from_checkpoint(path, DecodeConfig()).cfg.alpha == 0.6
    assert Translator.from_checkpoint(tiny_checkpoint).cfg == DecodeConfig()


def test_an_ensemble_decodes_with_the_settings_its_members_share(tiny_checkpoint, tmp_path, caplog):
    """Two checkpoints, or an `aiayn ensemble` file of them, that carry the same α decode with it; if
    they carry different ones (or one carries none), the defaults, and the warning names each."""
    import logging
    from aiayn.checkpoint import atomic_save, ensemble_checkpoint, load_checkpoint
    plain = load_checkpoint(tiny_checkpoint)
    paths = {}
    for name, decode in (("a", {"alpha": 1.4}), ("b", {"alpha": 1.4}), ("c", {"alpha": 1.0}), ("none", None)):
        paths[name] = tmp_path / f"{name}.pt"
        atomic_save({**plain, "decode": decode} if decode else plain, paths[name])
    atomic_save(ensemble_checkpoint([paths["a"], paths["b"]]), tmp_path / "ab.pt")
    atomic_save(ensemble_checkpoint([paths["a"], paths["c"]]), tmp_path / "ac.pt")
    assert Translator.from_checkpoint([paths["a"], paths["b"]]).cfg.alpha == 1.4
    assert Translator.from_checkpoint(tmp_path / "ab.pt").cfg.alpha == 1.4
    for agreeing_not in ([paths["a"], paths["c"]], [tmp_path / "ac.pt"], [paths["a"], paths["none"]]):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert Translator.from_checkpoint(agreeing_not).cfg == DecodeConfig()
        assert "carry different decoding settings" in caplog.text and "1.4" in caplog.text


def test_an_ensemble_file_decodes_with_the_alpha_the_demo_chose_for_it(tiny_checkpoint, tmp_path):
    """`aiayn demo --members N` stores the α it chose on validation in the ensemble file itself (its
    own ``decode`` entry, beside ``members``): the ensemble was tuned, not its members, so that entry
    is the file's settings, in place of its members' own."""
    from aiayn.checkpoint import atomic_save, ensemble_checkpoint, load_checkpoint
    from aiayn.decode.loading import stored_settings
    from aiayn.demo.stages import record_alpha
    member = tmp_path / "member.pt"
    atomic_save({**load_checkpoint(tiny_checkpoint), "decode": {"alpha": 1.0}}, member)
    ens = tmp_path / "ens.pt"
    atomic_save(ensemble_checkpoint([tiny_checkpoint, member]), ens)
    record_alpha(ens, 1.4)
    assert stored_settings([str(ens)]) == {"alpha": 1.4}
    assert Translator.from_checkpoint(ens).cfg.alpha == 1.4
    assert Translator.from_checkpoint([ens, ens]).cfg.alpha == 1.4


def test_a_worker_gives_the_heaps_holes_back_every_few_batches(monkeypatch):
    """A decoding worker runs with the aiayn command's allocator setting (freed memory kept in the
    heap, aiayn/host/allocator.py): every TRIM_EVERY_BATCHES batches it gives the holes back where
    the heap has grown since (a heap that keeps its size reuses them)."""
    from aiayn.decode import workers
    from aiayn.host import allocator

    class Stub:
        cfg = None

        def translate_ids(self, rows):
            return [[] for _ in rows]

    calls = []
    monkeypatch.setattr(workers, "_WORKER", Stub())
    monkeypatch.setattr(workers, "_HEAP", allocator.HeapGrowth(workers.TRIM_EVERY_BATCHES, when="grown"))
    monkeypatch.setattr(allocator, "release_free_memory", lambda: calls.append(1) or True)
    sizes = iter([100, 100, 200])  # grown, the same, grown by more than a quarter
    monkeypatch.setattr(allocator, "heap_bytes", lambda: next(sizes))
    for _ in range(3 * workers.TRIM_EVERY_BATCHES + 1):
        assert workers._translate([[5, 3]], DecodeConfig()) == [[]]
    assert len(calls) == 2


@pytest.mark.parametrize("var,value", [("AIAYN_DENORMALS", "maybe"), ("AIAYN_ONEDNN_CACHE", "big")])
def test_a_bad_process_setting_is_refused_before_the_workers_start(var, value, tiny_checkpoint, monkeypatch):
    """Each worker applies the aiayn command's process settings (aiayn/host/process.py): through the
    Python API a bad value is one UserError naming the variable, in this process, before any worker
    starts (not a traceback from each worker, and a broken pool blamed on the __main__ guard)."""
    from aiayn.decode import workers
    from aiayn.errors import UserError

    monkeypatch.setenv(var, value)
    monkeypatch.setattr(workers, "ProcessPoolExecutor", lambda *a, **k: pytest.fail("workers started"))
    with Translator.from_checkpoint(tiny_checkpoint, DecodeConfig(workers=2)) as tr:
        with pytest.raises(UserError, match=f"^{var} must be"):
            tr.translate(LINES)
