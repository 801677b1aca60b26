"""How ``aiayn`` ends on an error: one line and exit 2 for bad input and for out of memory (naming
the setting to lower and by how much), the traceback with --debug. Each command's work is
replaced by a function that raises, so nothing runs out of memory for real."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.errors import UserError

CUDA_OOM = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")
CPU_OOM = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)")


def _raiser(exc):
    def raise_(*args, **kwargs):
        raise exc
    return raise_


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_translate_out_of_memory_names_batch_tokens(monkeypatch, capsys):
    monkeypatch.setattr("aiayn.decode.translator.Translator.from_checkpoint", _raiser(CUDA_OOM))
    args = ["translate", "--checkpoint", "m.pt", "--batch-tokens", "3000"]
    assert main(args) == 2
    assert _error_line(capsys) == ("aiayn translate: error: out of memory on the GPU: lower --batch-tokens (now 3000): "
                                   "halve it, --batch-tokens 1500, and again if it still runs out; "
                                   "--debug shows the traceback")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        main(args + ["--debug"])
    with pytest.raises(torch.cuda.OutOfMemoryError):
        main(["--debug", *args])


def test_evaluate_out_of_memory_in_ram(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("aiayn.decode.translator.Translator.from_checkpoint", _raiser(CPU_OOM))
    (tmp_path / "s").write_text("a\n")
    assert main(["evaluate", "--checkpoint", "m.pt", "--src", str(tmp_path / "s"), "--ref", str(tmp_path / "s")]) == 2
    assert "out of memory in RAM: lower --batch-tokens (now 4096): halve it, --batch-tokens 2048" in _error_line(capsys)


def test_translate_out_of_memory_names_a_huge_output_length(monkeypatch, capsys):
    """The search holds room for the maximum output length from its first step, for one sentence
    too: where --max-len-a/--max-len-b allow a huge one, they are the advice, not --batch-tokens."""
    monkeypatch.setattr("aiayn.decode.translator.Translator.from_checkpoint", _raiser(CPU_OOM))
    assert main(["translate", "--checkpoint", "m.pt", "--max-len-a", "1e9"]) == 2
    line = _error_line(capsys)
    assert ("out of memory in RAM: the maximum output length floor(1e+09 x |x| + 50) (--max-len-a, --max-len-b) "
            "allows 1,024,000,000,050 tokens for a line of 1024 tokens (--max-input-tokens)") in line
    assert "lower --max-len-a or --max-len-b" in line and "halve it" not in line
    assert main(["translate", "--checkpoint", "m.pt", "--max-len-a", "1e9", "--max-input-tokens", "2"]) == 2
    assert "allows 2,000,000,050 tokens for a line of 2 tokens" in _error_line(capsys)
    assert main(["translate", "--checkpoint", "m.pt", "--max-len-a", "2", "--max-len-b", "300"]) == 2  # in use: 2,348
    assert "lower --batch-tokens (now 4096): halve it" in _error_line(capsys)


def test_train_out_of_memory_names_the_token_budgets(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("aiayn.train.loop.train", _raiser(CUDA_OOM))
    args = ["train", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--preset", "tiny",
            "--set", "train.max_src_tokens=3000", "--set", "train.max_tgt_tokens=2000", "--set", "train.accum_steps=2"]
    assert main(args) == 2
    assert _error_line(capsys) == (
        "aiayn train: error: out of memory on the GPU: halve train.max_src_tokens and train.max_tgt_tokens "
        "(now 3000 and 2000) and double train.accum_steps (now 2) to keep the batch: --set train.max_src_tokens=1500 "
        "--set train.max_tgt_tokens=1000 --set train.accum_steps=4; the same command resumes from the last "
        "checkpoint; --debug shows the traceback")


def test_demo_prepare_and_average_out_of_memory(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("aiayn.demo.multi30k.run_demo", _raiser(MemoryError()))
    assert main(["demo", "--quick"]) == 2
    assert "out of memory in RAM: halve train.max_src_tokens and train.max_tgt_tokens (now " in _error_line(capsys)
    monkeypatch.setattr("aiayn.commands.prepare.prepare", _raiser(MemoryError()))
    (tmp_path / "t").write_text("a\n")
    assert main(["prepare", "--train-src", str(tmp_path / "t"), "--train-tgt", str(tmp_path / "t"),
                 "--out", str(tmp_path / "d")]) == 2
    assert "halve --spm-sample-pairs (now 1000000" in _error_line(capsys)
    monkeypatch.setattr("aiayn.checkpoint.average_checkpoints", _raiser(CPU_OOM))
    assert main(["average", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--out", str(tmp_path / "avg.pt")]) == 2
    assert "out of memory in RAM: free memory" in _error_line(capsys)


def test_other_errors_keep_their_traceback_and_user_errors_one_line(monkeypatch, capsys):
    monkeypatch.setattr("aiayn.decode.translator.Translator.from_checkpoint", _raiser(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["translate", "--checkpoint", "m.pt"])
    monkeypatch.setattr("aiayn.decode.translator.Translator.from_checkpoint", _raiser(UserError("m.pt: no such file")))
    assert main(["translate", "--checkpoint", "m.pt"]) == 2
    assert _error_line(capsys) == "aiayn translate: error: m.pt: no such file"
    with pytest.raises(UserError):
        main(["translate", "--checkpoint", "m.pt", "--debug"])



@pytest.mark.parametrize("argv, command, unknown", [
    (["demo", "--eval", "20"], "demo", "--eval 20"), (["train", "--data", "d", "--out", "r", "--foo"], "train", "--foo"),
    (["data", "ptb-sample", "--out", "x", "--bogus"], "data ptb-sample", "--bogus")])
def test_an_unknown_option_is_named_by_its_command(argv, command, unknown, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"aiayn {command}: error: unrecognized arguments: {unknown}"


def test_debug_and_quiet_after_a_nested_commands_name():
    from aiayn.cli import build_parser
    args = build_parser().parse_args(["data", "ptb-sample", "--out", "x", "--quiet", "--debug"])
    assert args.quiet and args.debug
    args = build_parser().parse_args(["parse", "score", "--gold", "g", "--test", "t", "--debug"])
    assert args.debug and not getattr(args, "quiet", False)


def test_ctrl_c_in_training_says_where_the_run_resumes(small_data_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C (KeyboardInterrupt) at step 3, after the checkpoint of step 2: one line naming last.pt
    (resume's file, which a best validation may write between step checkpoints), no traceback; the
    same command then resumes from it."""
    from aiayn.checkpoint import load_checkpoint
    from aiayn.train import loop
    from tests.train.test_training import FAST
    log_step = loop._Run.log_step

    def interrupted_at_3(run, s, due):
        if run.state.step == 3:
            raise KeyboardInterrupt
        log_step(run, s, due)

    monkeypatch.setattr(loop._Run, "log_step", interrupted_at_3)
    run = tmp_path / "run"
    argv = ["train", "--data", str(small_data_dir), "--out", str(run), "--preset", "tiny", "--no-progress", *FAST,
            "--set", "train.save_every_steps=2", "--max-steps", "4"]
    assert main(argv) == 130
    assert _error_line(capsys) == f"aiayn train: interrupted; the same command resumes from {run / 'last.pt'}"
    assert load_checkpoint(run / "last.pt")["step"] == 2
    monkeypatch.setattr(loop._Run, "log_step", log_step)
    assert main(argv) == 0
    assert "resuming from" in capsys.readouterr().out


def test_ctrl_c_before_the_command_starts_is_one_line(monkeypatch, capsys):
    """Ctrl-C while the modules load (the first second or two, before the command runs): status 130
    and one line, as later; --debug keeps the traceback."""
    import aiayn.cli

    def loading():
        raise KeyboardInterrupt

    monkeypatch.setattr(aiayn.cli, "build_parser", loading)
    assert main(["presets"]) == 130
    assert _error_line(capsys) == "aiayn: interrupted"
    with pytest.raises(KeyboardInterrupt):
        main(["presets", "--debug"])


def test_the_command_line_starts_before_pytorch_loads():
    """What runs before ``main`` (the ``aiayn`` script's import of ``aiayn.cli``) loads no PyTorch: a
    Ctrl-C while it loads falls in ``main``, one line, not a traceback from an import."""
    import subprocess
    import sys
    code = "import sys, aiayn.cli; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]", res.stdout


def test_the_top_level_names_load_at_their_first_use():
    import subprocess
    import sys
    code = ("import aiayn; from aiayn import Transformer, get_preset; "
            "print(aiayn.model.ModelConfig is aiayn.ModelConfig, aiayn.DecoderCache.__module__, "
            "Transformer is aiayn.Transformer, get_preset('base').d_model, aiayn.__version__ != '')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["True", "aiayn.decode.cache", "True", "512", "True"], res.stdout
    with pytest.raises(AttributeError, match="module 'aiayn' has no attribute 'nothing'"):
        import aiayn
        aiayn.nothing  # noqa: B018


def test_options_out_of_range_are_one_line(small_data_dir, tiny_checkpoint, tmp_path, capsys):
    """Each of these once ran into a traceback (or was silently read as another value)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x\n")
    refs = tmp_path / "ref.txt"
    refs.write_text("a b\nc d\n")
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "wmt14-ende-base.json")
    long_src = " ".join(["a man rides a bike down the street ."] * 150)
    cases = [
        (["train", "--data", str(small_data_dir), "--out", str(a_file), "--preset", "tiny", "--max-steps", "1"],
         f"{a_file}: exists and is not a folder"),
        (["train", "--data", str(small_data_dir), "--out", str(a_file / "sub"), "--preset", "tiny"],
         f"{a_file} is not a folder"),
        (["estimate", "--recipe", recipe, "--tokens-per-step", "0"], "--tokens-per-step must be >= 1, got 0"),
        (["estimate", "--recipe", recipe, "--tokens-per-step", "25000", "--max-device-tokens", "0"],
         "--max-device-tokens must be >= 1, got 0"),
        (["score", "--ref", str(refs), "--hyp", str(refs), "--compare", str(refs), "--samples", "0"],
         "--samples must be >= 1, got 0"),
        (["evaluate", "--checkpoint", str(tiny_checkpoint), "--src", str(refs), "--ref", str(refs), "--nbest", "2"],
         "--nbest 2: evaluate scores each sentence's best translation"),
        (["demo", "--average-last", "0", "--out", str(tmp_path / "d")], "--average-last must be >= 1, got 0"),
        (["parse", "demo", "--average-last", "0", "--out", str(tmp_path / "d")], "--average-last must be >= 1, got 0"),
        (["plot", "attention", "--checkpoint", str(tiny_checkpoint), "--src", long_src, "--out", str(tmp_path / "p")],
         "exceed the model's limit of"),
    ]
    for argv, says in cases:
        assert main(argv) == 2, argv
        assert says in _error_line(capsys), argv


@pytest.mark.parametrize("flag, value", [("--top-k", "5"), ("--top-p", "0.9"), ("--temperature", "0.7")])
@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_a_sampling_setting_without_sampling_is_refused(command, flag, value, tiny_checkpoint, tmp_path, capsys):
    """Beam search and greedy search read none of temperature, top-k and top-p: given without
    --sampling (fairseq refuses its --sampling-topk and --sampling-topp so), each was accepted and
    the translations came out as if it had not been given."""
    text = tmp_path / "in.txt"
    text.write_text("a dog runs .\n")
    io = ["--input", str(text)] if command == "translate" else ["--src", str(text), "--ref", str(text)]
    argv = [command, "--checkpoint", str(tiny_checkpoint), *io, "--quiet", "--max-len-b", "2"]
    assert main([*argv, flag, value]) == 2
    assert _error_line(capsys).endswith(f"{flag} {value} shapes sampling only: add --sampling "
                                        "(beam search and greedy search ignore it)")
    assert main([*argv, flag, value, "--sampling"]) == 0


@pytest.mark.parametrize("args, want", [
    (["translate", "--checkpoint", "m.pt", "--beam-size", "0"], "--beam-size must be >= 1, got 0"),
    (["translate", "--checkpoint", "m.pt", "--beam-size", "2", "--nbest", "5"], "--nbest must be in [1, --beam-size=2], got 5"),
    (["plot", "attention", "--checkpoint", "m.pt", "--src", "a", "--beam-size", "0"], "--beam-size must be >= 1, got 0"),
])
def test_a_refused_option_value_is_named_as_the_option(args, want, capsys):
    """A value a command-line option gave that the settings refuse is named by the option the user typed
    (``--beam-size``), not by the settings field behind it (``beam_size``), before any file is read."""
    assert main(args) == 2
    assert _error_line(capsys) == f"aiayn {args[0]}: error: {want}"


def test_under_torchrun_a_settings_error_is_said_once_and_a_ranks_own_names_it(monkeypatch, capsys):
    """Every rank of a torchrun launch reads the same settings, so a refused one is the main rank's
    line alone; an error that may be one rank's own (a file, its memory) names the rank; Ctrl-C,
    which reaches every rank, is said by the main rank. With -v every rank says all."""
    from aiayn.config import ConfigError
    monkeypatch.setattr("aiayn.cli._quiet_other_rank", lambda: None)  # (its logging filters would outlive the test)
    args = ["train", "--data", "d", "--out", "o"]
    for rank, exc, want in [("0", ConfigError("p_drop must be in [0, 1)"), "aiayn train: error: p_drop must be in [0, 1)"),
                            ("1", ConfigError("p_drop must be in [0, 1)"), ""),
                            ("1", UserError("d: no such data directory"), "aiayn train: error (rank 1): d: no such data directory"),
                            ("1", CPU_OOM, "aiayn train: error (rank 1): out of memory in RAM")]:
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr("aiayn.commands.train.run", _raiser(exc))
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(want) and (err.count("\n") == 1 if want else err == ""), (rank, err)
    monkeypatch.setattr("aiayn.commands.train.run", _raiser(ConfigError("p_drop must be in [0, 1)")))
    assert main(["-v", *args]) == 2
    assert capsys.readouterr().err == "aiayn train: error (rank 1): p_drop must be in [0, 1)\n"
    monkeypatch.setattr("aiayn.commands.train.run", _raiser(KeyboardInterrupt()))
    assert main(args) == 130
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(args) == 130
    assert capsys.readouterr().err.startswith("aiayn train: interrupted")
