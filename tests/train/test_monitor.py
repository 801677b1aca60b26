"""What a training run shows (``aiayn.train.monitor``): a bar on a terminal with the log lines above
it, a log line per logged step into a pipe, rates of training time alone, every output closed when
the run is interrupted, and each line said once (one rank, one resume line)."""
from __future__ import annotations

import io
import json
import logging
import math
import sys
import types

import pytest
import torch

from aiayn.checkpoint.run import TrainState
from aiayn.cli import main
from aiayn.data.dataset import DataDir
from aiayn.model.config import ModelConfig
from aiayn.train import monitor as monitor_module
from aiayn.train.config import TrainConfig
from aiayn.train.monitor import Monitor
from aiayn.train.runtime import Dist, Place
from aiayn.train.validation import Validator

FAST = ["--preset", "tiny", "--set", "train.save_every_min=0", "--set", "train.precision=fp32",
        "--set", "train.threads=1", "--set", "train.max_src_tokens=600", "--set", "train.max_tgt_tokens=600",
        "--set", "train.log_every_steps=2", "--set", "train.validate_every_steps=2"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


def test_a_pipe_gets_a_log_line_per_logged_step_and_no_bar(tmp_path, monkeypatch, caplog):
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    state = TrainState()
    monitor = Monitor(tmp_path, state, True, True, 60)
    state.step = 10
    monitor.advance()
    with caplog.at_level(logging.INFO, logger="aiayn"):
        # sums over 4 target tokens: loss 8 and NLL 4 nats, 1 nat per token: ppl e
        monitor.train_step(loss=8.0, nll=4.0, kl=None, tokens=4.0, lr=1e-3, norm=0.5)
    assert pipe.getvalue() == ""  # no carriage returns piling up in a log file
    assert "step 10/60: loss 2.000 nll 1.000 ppl 2.72 lr 0.001 grad_norm 0.500" in caplog.text
    (row,) = _rows(tmp_path)
    assert row["train_ppl"] == math.exp(row["train_nll"]) and row["train_nll"] == 1.0
    monitor.end()


def test_log_lines_go_above_the_bar_on_a_terminal(tmp_path, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr("aiayn.progress.QUIET", False)  # (an earlier command's --quiet in this process)
    console = logging.StreamHandler(sys.stderr)
    logging.root.addHandler(console)
    try:
        monitor = Monitor(tmp_path, TrainState(), True, True, 60)
        assert "step" in terminal.getvalue()  # the bar, drawn
        logging.getLogger("aiayn.train").warning("a line while the bar is drawn")
        text = terminal.getvalue()
        at = text.index("a line while the bar is drawn")
        assert text[at - 1] in "\r\n"  # starts a line of its own, not glued to the bar's last column
        monitor.end()
        assert console in logging.root.handlers  # the console's own handler back
    finally:
        logging.root.removeHandler(console)
    assert terminal.getvalue().endswith("\n")  # the bar ended with its line


def test_tokens_per_second_leave_out_what_is_not_training(tmp_path, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(monitor_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    state = TrainState()
    monitor = Monitor(tmp_path, state, True, False, 60)
    monitor.count(1000)
    now[0] = 1.0
    with monitor.paused():  # a validation of 2 s
        now[0] = 3.0
    now[0] = 4.0
    state.step = 10
    monitor.train_step(loss=8.0, nll=4.0, kl=None, tokens=4.0, lr=1e-3, norm=0.5)
    monitor.end()
    assert _rows(tmp_path)[0]["tokens_per_s"] == 1000 / 2  # 4 s, 2 of them validating


def test_validation_warnings_come_from_the_main_rank_alone(small_data_dir, caplog):
    data = DataDir(small_data_dir)
    t = TrainConfig(max_src_tokens=8, max_tgt_tokens=8)  # every validation pair is cut: one warning
    m = ModelConfig(vocab_size=data.vocab_size)
    for rank, said in ((0, 1), (1, 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="aiayn"):
            Validator(data, t, m, Place(Dist(rank, 2), torch.device("cpu"), "fp32"))
        assert sum("are cut to" in r.getMessage() for r in caplog.records) == said, rank


def test_an_interrupted_run_closes_its_outputs_and_resumes_them(small_data_dir, tmp_path, monkeypatch, caplog, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    from aiayn.train.loop import _Run
    # the resumed run's event file ends ".10", the first run's ".9": by name, the later sorts first
    monkeypatch.setattr(event_file_writer._global_uid, "_value", 9)
    run = tmp_path / "run"
    argv = ["train", "--data", str(small_data_dir), "--out", str(run), *FAST, "--set", "train.save_every_steps=2"]
    validate = _Run.validate

    def interrupted(self):
        if self.state.step == 4:
            raise KeyboardInterrupt
        return validate(self)

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr("aiayn.progress.QUIET", False)  # (an earlier command's --quiet in this process)
    monkeypatch.setattr(_Run, "validate", interrupted)
    assert main(argv + ["--max-steps", "6"]) == 130
    # the bar ended with its line: the message starts one of its own
    assert terminal.getvalue().endswith(f"\naiayn train: interrupted; the same command resumes from {run / 'last.pt'}\n")
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()  # written when the run stopped
    assert [e.step for e in events.Scalars("train_loss")] == [2, 4]
    monkeypatch.setattr(_Run, "validate", validate)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="aiayn"):
        assert main(argv + ["--max-steps", "6", "--no-progress"]) == 0
    said = capsys.readouterr().out + caplog.text
    assert said.count("resuming from") == 1 and f"resuming from {run / 'last.pt'} at step 2 (epoch 0)" in said
    rows = _rows(run)
    assert [(r["step"], "valid_loss" in r) for r in rows] == [(s, v) for s in (2, 4, 6) for v in (False, True)]
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for tag, every in (("train_loss", [2, 4, 6]), ("valid_loss", [2, 4, 6])):
        logged = {r["step"]: r[tag] for r in rows if tag in r}
        points = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in points] == every, tag  # once each: the interrupted run's step 4 purged
        assert all(v == pytest.approx(logged[s], rel=2 ** -23) for s, v in points), tag  # float32 of the log's


def test_a_new_event_file_is_made_in_a_later_second_than_the_folders_last(tmp_path, monkeypatch):
    """TensorBoard orders a folder's event files by name: whole seconds, then an unpadded count. A
    resumed run's writer made in the second of the earlier file waits into the next one; one made
    later does not wait."""
    from aiayn.train import monitor
    slept = []
    now = [1_700_000_000.25]
    monkeypatch.setattr(monitor.time, "time", lambda: now[0])
    monkeypatch.setattr(monitor.time, "sleep", lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    (tmp_path / "events.out.tfevents.1700000000.host.123.9").touch()
    (tmp_path / "events.out.tfevents.1699999990.host.99.10").touch()
    monitor._after_earlier_events(tmp_path)
    assert slept == [pytest.approx(0.75)] and int(now[0]) == 1_700_000_001
    monitor._after_earlier_events(tmp_path)  # a second later now: no wait
    assert len(slept) == 1
    monitor._after_earlier_events(tmp_path / "none")  # a new run's folder
    assert len(slept) == 1
