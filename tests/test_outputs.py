"""Outputs: no command deletes or overwrites what it did not write. A non-empty output folder is
refused unless it is the same command's earlier output and ``--overwrite`` is given; an existing
output file needs ``--overwrite``; replacements happen in one step; what interrupted writes left
behind is deleted by the next write in that folder."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from aiayn import checkpoint as ck
from aiayn import files
from aiayn.cli import main
from aiayn.data.prepare import PrepareConfig, SplitFiles, prepare
from aiayn.errors import UserError
from tests.conftest import copy_lines

TINY_DATA = PrepareConfig(vocab_size=29, num_workers=1)


def _foreign(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("keep me")
    return folder


def _kept(folder: Path) -> bool:
    return (folder / "notes.txt").read_text() == "keep me"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> SplitFiles:
    d = tmp_path_factory.mktemp("corpus")
    text = "\n".join(copy_lines(300, 1)) + "\n"
    (d / "train.src").write_text(text)
    (d / "train.tgt").write_text(text)
    return SplitFiles(d / "train.src", d / "train.tgt")


@pytest.fixture(scope="module")
def model_file(untrained_checkpoint) -> Path:
    return untrained_checkpoint


def _err(capsys) -> str:
    return capsys.readouterr().err


# -- export --------------------------------------------------------------------------------------

@pytest.mark.parametrize("overwrite", [False, True])
def test_export_never_deletes_a_folder_it_did_not_write(model_file, tmp_path, capsys, overwrite):
    out = _foreign(tmp_path / "run")
    argv = ["export", "--checkpoint", str(model_file), "--out", str(out)] + (["--overwrite"] if overwrite else [])
    assert main(argv) == 2
    assert f"{out}: not empty and not a model aiayn exported" in _err(capsys)
    assert _kept(out) and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporaries left


def test_export_replaces_an_earlier_export_only_with_overwrite(model_file, tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    out = tmp_path / "ct2"
    out.mkdir()  # an empty folder takes an export without --overwrite
    assert main(["export", "--checkpoint", str(model_file), "--out", str(out)]) == 0
    first = (out / "model.bin").stat().st_ino
    assert json.loads((out / "aiayn.json").read_text())["checkpoint"] == str(model_file)
    assert main(["export", "--checkpoint", str(model_file), "--out", str(out)]) == 2
    assert "pass --overwrite to replace it" in _err(capsys)
    assert main(["export", "--checkpoint", str(model_file), "--out", str(out), "--overwrite"]) == 0
    assert (out / "model.bin").stat().st_ino != first and (out / "source.spm").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2"]


def test_export_refuses_the_current_directory(model_file, tmp_path, capsys, monkeypatch):
    (tmp_path / "aiayn.json").write_text("{}")  # even one that looks like an export
    monkeypatch.chdir(tmp_path)
    assert main(["export", "--checkpoint", str(model_file), "--out", ".", "--overwrite"]) == 2
    assert "holds the current directory" in _err(capsys)


def test_export_into_a_folder_it_cannot_write_is_refused_before_the_work(model_file, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.access(locked, os.W_OK):  # the superuser writes anywhere: answer as for any other user
        real = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real(path, mode))
    monkeypatch.setattr("aiayn.decode.loading.load_model_for_inference", _never_loaded)
    assert main(["export", "--checkpoint", str(model_file), "--out", str(locked / "sub" / "ct2")]) == 2
    assert _err(capsys).strip().endswith(f"its folder {locked} is not writable; choose another --out")


def _never_loaded(*args, **kwargs):
    raise AssertionError("the checkpoint was read before --out was checked")


def test_export_refuses_quantizing_a_hugging_face_model_before_reading_the_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("aiayn.decode.loading.load_model_for_inference", _never_loaded)
    argv = ["export", "--format", "hf", "--quantization", "int8", "--checkpoint", str(tmp_path / "model.pt"),
            "--out", str(tmp_path / "hf")]
    assert main(argv) == 2
    assert _err(capsys) == "aiayn export: error: --quantization applies to --format ct2\n"


def test_export_where_no_folder_can_be_made_is_one_line(model_file, tmp_path, capsys, monkeypatch):
    """A file system that refuses what the access check allows (read-only to root too): one line,
    no traceback, nothing left behind."""
    pytest.importorskip("ctranslate2")

    def refused(path, mark=files.TMP_MARK, *, folder):
        raise PermissionError(1, "Operation not permitted", str(path))
    monkeypatch.setattr(files, "locked_temporary", refused)
    out = tmp_path / "ct2"
    assert main(["export", "--checkpoint", str(model_file), "--out", str(out)]) == 2
    assert _err(capsys).strip().endswith(f"{out}: cannot write its folder {tmp_path} (Operation not permitted); "
                                         f"choose another --out")
    assert list(tmp_path.iterdir()) == []


# -- files: average, ensemble, upgrade-checkpoint -------------------------------------------------

def test_checkpoint_outputs_need_overwrite(model_file, tmp_path, capsys):
    mine = tmp_path / "mine.pt"
    mine.write_bytes(b"not yours")
    for argv in (["average", str(model_file), "--out", str(mine)],
                 ["ensemble", str(model_file), "--out", str(mine)],
                 ["upgrade-checkpoint", str(model_file), "--out", str(mine)]):
        assert main(argv) == 2, argv
        assert f"{mine}: already exists (pass --overwrite to replace it)" in _err(capsys)
        assert mine.read_bytes() == b"not yours"
    assert main(["average", str(model_file), "--out", str(mine), "--overwrite"]) == 0
    ck.load_checkpoint(mine)
    folder = tmp_path / "folder.pt"
    folder.mkdir()
    assert main(["average", str(model_file), "--out", str(folder), "--overwrite"]) == 2
    assert "is not a regular file" in _err(capsys)


# -- prepare and parse prepare -------------------------------------------------------------------

def test_prepare_never_replaces_a_foreign_folder(corpus, tmp_path, capsys):
    out = _foreign(tmp_path / "out")
    argv = ["prepare", "--train-src", str(corpus.src), "--train-tgt", str(corpus.tgt), "--vocab-size", "29",
            "--num-workers", "1", "--out", str(out)]
    assert main(argv + ["--overwrite"]) == 2
    assert "not empty and not a data directory" in _err(capsys)
    assert _kept(out)


def test_prepare_overwrite_swaps_the_folder_in_one_step(corpus, tmp_path, monkeypatch):
    """The old data directory is never renamed away before the new one takes its place: with
    the two-rename fallback disabled, the replacement still succeeds, and no moment is without one."""
    out = tmp_path / "data"
    prepare({"train": corpus}, out, TINY_DATA)
    old_manifest = json.loads((out / "manifest.json").read_text())

    def no_rename_of_out(src, dst, *a, **kw):
        if Path(src) == out:
            raise AssertionError("the existing folder was moved away before its replacement was in place")
        return real_replace(src, dst, *a, **kw)
    real_replace = os.replace
    monkeypatch.setattr(files.os, "replace", no_rename_of_out)
    prepare({"train": corpus}, out, PrepareConfig(vocab_size=28, num_workers=1), force=True)
    assert json.loads((out / "manifest.json").read_text())["options"]["vocab_size"] == 28 != \
        old_manifest["options"]["vocab_size"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_parse_prepare_refuses_foreign_folders_and_replaces_its_own(shared_data, tmp_path, capsys):
    treebank = tmp_path / "mrg"
    treebank.mkdir()
    with zipfile.ZipFile(shared_data / "ptb-wsj-nltk-sample" / "treebank.zip") as zf:
        for n in ("0001", "0160", "0180"):  # train, dev, test
            (treebank / f"wsj_{n}.mrg").write_bytes(zf.read(f"treebank/combined/wsj_{n}.mrg"))
    out = _foreign(tmp_path / "ptb")
    argv = ["parse", "prepare", "--treebank", str(treebank), "--no-data", "--out", str(out)]
    assert main(argv + ["--overwrite"]) == 2
    assert "not empty and not a prepared treebank" in _err(capsys)
    assert _kept(out) and len(list(out.iterdir())) == 1
    fresh = tmp_path / "fresh"
    assert main(argv[:-1] + [str(fresh)]) == 0
    capsys.readouterr()
    assert (fresh / "splits.json").is_file() and (fresh / "train.words").is_file()
    assert main(argv[:-1] + [str(fresh)]) == 2
    assert "pass --overwrite" in _err(capsys)
    assert main(argv[:-1] + [str(fresh), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "mrg", "ptb"]


# -- the demos -----------------------------------------------------------------------------------

class _Reached(Exception):
    pass


def _stop_at_prepare(*args, **kwargs):
    raise _Reached


def test_demo_refuses_a_folder_it_did_not_write(tmp_path, monkeypatch):
    pytest.importorskip("sacremoses")
    from aiayn.demo import stages
    from aiayn.demo.config import DemoConfig
    from aiayn.demo.multi30k import run_demo
    monkeypatch.setattr(stages, "stage_prepare", _stop_at_prepare)
    out = _foreign(tmp_path / "out")
    for overwrite in (False, True):
        with pytest.raises(UserError, match=f"{out}: holds files that aiayn demo did not write \\(notes.txt\\)"):
            run_demo(DemoConfig(out=str(out), overwrite=overwrite))
    assert _kept(out)
    # its own folder resumes, or with --overwrite starts afresh
    own = tmp_path / "own"
    (own / "run").mkdir(parents=True)
    (own / "results.json").write_text("{}")
    with pytest.raises(_Reached):
        run_demo(DemoConfig(out=str(own)))
    assert (own / "results.json").exists()
    with pytest.raises(_Reached):
        run_demo(DemoConfig(out=str(own), overwrite=True))
    assert own.is_dir() and list(own.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "own"]


def test_parse_demo_refuses_a_folder_it_did_not_write(tmp_path, monkeypatch):
    from aiayn.parsing import demo
    monkeypatch.setattr(demo, "_stage_prepare", _stop_at_prepare)
    out = _foreign(tmp_path / "out")
    with pytest.raises(UserError, match="holds files that aiayn parse demo did not write"):
        demo.run_parse_demo(demo.ParseDemoConfig(out=str(out)))
    assert _kept(out)


# -- what interrupted writes leave behind ----------------------------------------------------------

def _aged(path: Path, seconds: float = 120.0) -> Path:
    t = time.time() - seconds
    os.utime(path, (t, t))
    return path


def test_leftovers_of_interrupted_writes_are_removed_by_the_next_write(tmp_path):
    old_file = tmp_path / ".summary.json.aiayn-tmp-ab12cd_9"
    old_file.write_bytes(b"x")
    _aged(old_file)
    young = tmp_path / ".summary.json.aiayn-tmp-zzzzzzzz"
    young.write_bytes(b"a killed writer's, a moment ago (unlocked)")
    busy = tmp_path / ".summary.json.aiayn-tmp-busybusy"
    busy.write_bytes(b"being written")
    _aged(busy)
    others = [tmp_path / n for n in (".notes.tmp", "summary.json.aiayn-tmp-k2j4h5g6", ".summary.json.aiayn-tmp-short",
                                     ".summary.json.ab12cd_9.tmp", ".model.pt.aiayn-tmp-ab12cd_9")]
    for p in others:  # not aiayn's, or another output's (its writer may still be at work)
        p.write_bytes(b"not ours")
        _aged(p)
    with open(busy, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a writer still at work (a slow disk)
        files.write_json_atomic(tmp_path / "summary.json", {"a": 1})
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["summary.json", busy.name, *(p.name for p in others)])


_KILLED_PREPARE = """
import os, signal, sys
from aiayn.cli import main
from aiayn.data import store
store.NpyAppender.append = lambda self, values: os.kill(os.getpid(), signal.SIGKILL)  # mid-way
main(sys.argv[1:])
"""


def test_a_rerun_of_a_killed_prepare_removes_its_folder_at_once(corpus, tmp_path):
    """``aiayn prepare`` killed (SIGKILL) while it fills its temporary folder leaves that folder
    beside --out; the next prepare of the same --out, run straight after, deletes it (no process
    holds its lock), and keeps the temporary of a concurrent run still at work (locked)."""
    out = tmp_path / "data"
    args = ["prepare", "--train-src", str(corpus.src), "--train-tgt", str(corpus.tgt), "--vocab-size", "29",
            "--num-workers", "1", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    killed = subprocess.run([sys.executable, "-c", _KILLED_PREPARE, *args], env=env, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    left = [p for p in tmp_path.iterdir() if files.leftovers_of("data").match(p.name)]
    assert len(left) == 1 and (left[0] / "spm.model").is_file() and not out.exists()
    at_work = tmp_path / ".data.aiayn-tmp-atwork_1"  # another prepare of the same --out, at work
    at_work.mkdir()
    fd = os.open(at_work, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert main(args) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["data", at_work.name])
    finally:
        os.close(fd)


@pytest.mark.parametrize("folder", [False, True])
def test_a_temporary_taken_before_it_was_locked_is_made_anew(tmp_path, monkeypatch, folder):
    """A remover in another process may delete a temporary in the moment between its making and
    its lock (it is unlocked then): the writer makes another, and works only in one it holds."""
    made = []

    def make_then_lose(real):
        def make(*args, **kwargs):
            got = real(*args, **kwargs)
            made.append(got)
            if len(made) == 1:
                assert files.remove_leftovers(tmp_path, "out") != []
            return got
        return make
    name = "mkdtemp" if folder else "mkstemp"
    monkeypatch.setattr(files.tempfile, name, make_then_lose(getattr(files.tempfile, name)))
    tmp, fd = files.locked_temporary(tmp_path / "out", folder=folder)
    try:
        assert len(made) == 2 and tmp.exists() and files.remove_leftovers(tmp_path, "out") == []
    finally:
        os.close(fd)

def test_an_output_folder_removes_only_its_own_leftovers(tmp_path):
    mine = [tmp_path / ".data.aiayn-tmp-k2j4h5g6", tmp_path / ".data.aiayn-old-q1w2e3r4"]
    theirs = tmp_path / ".other.aiayn-tmp-k2j4h5g6"
    for d in (*mine, theirs):
        (d / "d").mkdir(parents=True)
        (d / "d" / "train.npy").write_bytes(b"x")
        _aged(d)
    with files.OutputDir(tmp_path / "data", ours=lambda d: True, what="a test") as tmp:
        (tmp / "mark").write_text("1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name, "data"]


def test_a_users_dot_files_beside_an_output_are_never_leftovers(corpus, tmp_path):
    """Names a person chose that end as aiayn's temporaries once did: ``aiayn prepare --out`` in
    a home folder kept them all, folders too, however old."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc.old-20240101").write_text("alias ll='ls -l'\n")
    (home / ".notes.20240101.tmp").write_text("call the bank\n")
    (home / ".config.old-20231201" / "app").mkdir(parents=True)
    (home / ".config.old-20231201" / "app" / "settings").write_text("x=1\n")
    for p in home.iterdir():
        _aged(p, 3600.0)
    assert main(["prepare", "--train-src", str(corpus.src), "--train-tgt", str(corpus.tgt), "--vocab-size", "29",
                 "--num-workers", "1", "--out", str(home / "x")]) == 0
    files.write_json_atomic(home / "summary.json", {"a": 1})
    assert sorted(p.name for p in home.iterdir()) == sorted([".bashrc.old-20240101", ".notes.20240101.tmp",
                                                             ".config.old-20231201", "x", "summary.json"])
    assert (home / ".config.old-20231201" / "app" / "settings").read_text() == "x=1\n"
    for name in (".bashrc.old-20240101", ".notes.20240101.tmp", ".config.old-20231201"):
        assert not files.LEFTOVER.match(name) and not files.leftovers_of(name.split(".")[1]).match(name)


def test_a_link_named_like_a_leftover_is_not_followed(tmp_path):
    target = tmp_path / "precious"
    (target / "d").mkdir(parents=True)
    folder = tmp_path / "out"
    folder.mkdir()
    link = folder / ".data.aiayn-tmp-k2j4h5g6"
    link.symlink_to(target)
    os.utime(link, (time.time() - 120,) * 2, follow_symlinks=False)
    assert files.remove_leftovers(folder, "data") == []
    assert (target / "d").is_dir() and link.is_symlink()


def test_without_an_atomic_exchange_the_folder_is_still_replaced_whole(tmp_path, monkeypatch):
    """Where renameat2 cannot swap (another system, some file systems), the old folder is moved
    aside just before the new one takes its name, then deleted."""
    monkeypatch.setattr(files, "exchange", lambda a, b: False)
    out = tmp_path / "out"
    for n in (1, 2):
        with files.OutputDir(out, overwrite=True, ours=lambda d: (d / "mark").is_file(), what="a test") as tmp:
            (tmp / "mark").write_text(str(n))
    assert (out / "mark").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# -- an output that is one of the inputs ---------------------------------------------------------

GOLD = "(S (NP (DT The) (NN cat)) (VP (VBD sat)) (. .))\n"


@pytest.fixture
def inputs(tmp_path, model_file) -> dict[str, Path]:
    """A gold tree file, a source text, a copy of the checkpoint; and other names for the gold file
    (a symbolic link, a hard link)."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "gold.trees").write_text(GOLD)
    (d / "src.json").write_text("a b c\n")  # a text that --attention-out could name
    (d / "model.pt").write_bytes(model_file.read_bytes())
    (d / "link.trees").symlink_to(d / "gold.trees")
    os.link(d / "gold.trees", d / "hard.trees")
    return {p.stem: p for p in d.iterdir()}


# each command with inputs and an output file, its output named as one of its inputs: the
# arguments (from the input files by name), the output's option and the input it names
SAME_AS_INPUT = {
    "parse baseline": (lambda i: ["parse", "baseline", "--gold", i["gold"], "--out", i["gold"]], "--out", "gold"),
    "parse baseline, a link": (lambda i: ["parse", "baseline", "--gold", i["gold"], "--out", i["link"]], "--out", "link"),
    "parse baseline, a hard link": (lambda i: ["parse", "baseline", "--gold", i["gold"], "--out", i["hard"]], "--out",
                                    "hard"),
    "parse decode": (lambda i: ["parse", "decode", "--checkpoint", i["model"], "--gold", i["gold"], "--out", i["gold"]],
                     "--out", "gold"),
    "parse text": (lambda i: ["parse", "text", "--checkpoint", i["model"], "--input", i["src"], "--output", i["src"]],
                   "--output", "src"),
    "evaluate": (lambda i: ["evaluate", "--checkpoint", i["model"], "--src", i["src"], "--ref", i["src"], "--out",
                            i["src"]], "--out", "src"),
    "evaluate, the checkpoint": (lambda i: ["evaluate", "--checkpoint", i["model"], "--src", i["src"], "--ref",
                                            i["src"], "--out", i["model"]], "--out", "model"),
    "translate": (lambda i: ["translate", "--checkpoint", i["model"], "--input", i["src"], "--attention-out", i["src"]],
                  "--attention-out", "src"),
    "average": (lambda i: ["average", i["model"], "--out", i["model"], "--overwrite"], "--out", "model"),
    "ensemble": (lambda i: ["ensemble", i["model"], "--out", i["model"], "--overwrite"], "--out", "model"),
}


@pytest.mark.parametrize("case", list(SAME_AS_INPUT))
def test_an_output_that_is_one_of_the_inputs_is_refused(inputs, capsys, case):
    argv, option, name = SAME_AS_INPUT[case]
    before = {p: p.read_bytes() for p in inputs.values()}
    assert main(argv({k: str(p) for k, p in inputs.items()})) == 2
    err = _err(capsys).strip().splitlines()
    assert len(err) == 1 and f"error: {option} {inputs[name]}: the same file as the input " in err[0], err
    assert {p: p.read_bytes() for p in inputs.values()} == before and inputs["link"].is_symlink()


def test_import_refuses_an_output_inside_the_model_it_reads(tmp_path, capsys):
    model = tmp_path / "opus-mt"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    assert main(["import", str(model), "--out", str(model / "model.safetensors"), "--overwrite"]) == 2
    assert "--out " + str(model / "model.safetensors") + ": the same file as the input" in _err(capsys)
    assert (model / "model.safetensors").read_bytes() == b"weights"


def test_outputs_named_by_a_person_are_written_whole(inputs, tmp_path, capsys):
    """Through the atomic writer: a link at the output's name is replaced, not written through
    (the file it names is kept); no temporaries are left; /dev/null takes an output as it is."""
    elsewhere = tmp_path / "elsewhere.trees"
    elsewhere.write_text("kept\n")
    out = tmp_path / "rb.trees"
    out.symlink_to(elsewhere)
    assert main(["parse", "baseline", "--gold", str(inputs["gold"]), "--out", str(out)]) == 0
    assert not out.is_symlink() and out.read_text().startswith("(S (DT The)") and elsewhere.read_text() == "kept\n"
    assert main(["parse", "baseline", "--gold", str(inputs["gold"]), "--out", os.devnull]) == 0
    assert main(["parse", "baseline", "--gold", str(inputs["gold"]), "--out", str(tmp_path)]) == 2
    assert f"{tmp_path}: a folder; name a file to write" in _err(capsys)
    assert not [p for p in tmp_path.iterdir() if files.LEFTOVER.match(p.name)]
