"""``aiayn plot lr --run``: a run's logged rate beside the one its config.json gives through the
training's own schedule (tiny runs, matplotlib's Agg backend); and the figures' bounds."""
from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from aiayn.cli import main
from aiayn.errors import WriteError
from aiayn.train.objective import Schedule, noam_lr
from aiayn.viz import run_lr
from tests.viz.test_plots import assert_real_png

D_MODEL, WARMUP = 64, 4  # the tiny preset's d_model; a warmup the runs below pass
TINY = ["--preset", "tiny", "--no-progress", "--set", "train.save_every_min=0", "--set", "train.validate_every_steps=0",
        "--set", "train.precision=fp32", "--set", "train.threads=1", "--set", "train.max_src_tokens=600",
        "--set", "train.max_tgt_tokens=600", "--set", f"train.warmup_steps={WARMUP}", "--set", "train.log_every_steps=1"]


def _train(data, run, steps: int, *sets: str) -> None:
    argv = ["train", "--data", str(data), "--out", str(run), "--max-steps", str(steps), *TINY]
    assert main(argv + [a for kv in sets for a in ("--set", kv)]) == 0


def _log(run) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


def eq3(step: float) -> float:
    """Eq. 3 for the tiny preset and WARMUP, written out."""
    return D_MODEL ** -0.5 * min(step ** -0.5, step * WARMUP ** -1.5)


@pytest.fixture(scope="module")
def ramp_run(tmp_path_factory, small_data_dir):
    """6 steps of Eq. 3 times a ramp to 0 over the last half of them (train.lr_decay_frac=0.5)."""
    run = tmp_path_factory.mktemp("ramp") / "run"
    _train(small_data_dir, run, 6, "train.lr_decay_frac=0.5")
    return run


@pytest.fixture
def drawn(monkeypatch):
    """The figures plot_run_lr saves: {line label: (x, y)}, the title and the legend's title."""
    figures = []
    real = run_lr.save_figure

    def spy(fig, out):
        ax = fig.axes[0]
        figures.append({"lines": {ln.get_label(): (np.asarray(ln.get_xdata()), np.asarray(ln.get_ydata()))
                                  for ln in ax.get_lines()},
                        "title": ax.get_title(), "legend": ax.get_legend().get_title().get_text().replace("\n", " ")})
        return real(fig, out)

    monkeypatch.setattr(run_lr, "save_figure", spy)
    return figures


def _line(figure: dict, prefix: str):
    found = [xy for label, xy in figure["lines"].items() if label.startswith(prefix)]
    assert len(found) == 1, (prefix, list(figure["lines"]))
    return found[0]


def _copy_run(run, to, config=None, lines=None):
    """A run directory holding ``run``'s config.json (with ``config``'s train fields changed) and its
    train log (or ``lines``, written as given)."""
    to.mkdir()
    cfg = json.loads((run / "config.json").read_text())
    cfg["train"].update(config or {})
    (to / "config.json").write_text(json.dumps(cfg))
    text = (run / "train_log.jsonl").read_text() if lines is None else lines
    (to / "train_log.jsonl").write_text(text)
    return to


def test_plot_run_draws_the_logged_rate_beside_the_configured_one(ramp_run, tmp_path, drawn, capsys):
    out = tmp_path / "lr.png"
    assert main(["plot", "lr", "--run", str(ramp_run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.split() == [str(out)]
    assert_real_png(out)
    fig, = drawn
    ramp = [max(0.0, min(1.0, (1 - s / 6) / 0.5)) for s in range(1, 7)]  # 1, 1, 1, 2/3, 1/3, 0
    x, y = _line(fig, "configured")
    assert list(x) == [1, 2, 3, 4, 5, 6]  # every step: this schedule follows the step alone
    np.testing.assert_allclose(y, [eq3(s) * r for s, r in zip(x, ramp)], rtol=run_lr.AGREE_REL, atol=0)
    x, y = _line(fig, "logged")
    logged = {r["step"]: r["lr"] for r in _log(ramp_run) if "lr" in r}
    assert list(x) == sorted(logged) == [1, 2, 3, 4, 5, 6] and list(y) == [logged[s] for s in x]
    assert y[-1] == 0.0  # the ramp's end
    assert f"learning rate of run {ramp_run}" in fig["title"]
    assert "warmup 4" in fig["title"] and "ramp to 0 over the last 50% of 6 steps" in fig["title"]
    assert "they agree at all 6 logged steps (largest relative difference 0)" in fig["legend"]
    assert not any(label.startswith("logged, not") for label in fig["lines"])


def test_a_budget_schedule_is_taken_at_the_logged_progress(small_data_dir, tmp_path, drawn, monkeypatch):
    """train.max_flops with train.lr_schedule_by_time and a ramp: each step counted as 1e9 FLOPs, the
    log records the FLOPs each step's rate was taken at (0, 1e9, ..., 5e9), and the configured curve,
    computed from them, is the logged rate at every step."""
    from aiayn.train import step
    monkeypatch.setattr(step, "train_flops", lambda *args: 1e9)  # one batch a step: 1e9 a step
    run = tmp_path / "run"
    _train(small_data_dir, run, 1000, "train.max_flops=6e9", "train.lr_decay_frac=0.5", "train.lr_schedule_by_time=true")
    lines = [r for r in _log(run) if "lr" in r]
    assert [r["lr_at"]["flops"] for r in lines] == [s * 1e9 for s in range(6)]
    assert set(lines[0]["lr_at"]) == run_lr.LR_AT_KEYS == {"elapsed", "flops", "epochs"}
    assert main(["plot", "lr", "--run", str(run), "--out", str(tmp_path / "lr.png")]) == 0
    fig, = drawn
    x, y = _line(fig, "configured")
    assert list(x) == [1, 2, 3, 4, 5, 6]  # at the logged steps, where the progress is known
    share = [s / 6 for s in range(6)]  # of the FLOPs budget, before each step
    expected = [eq3(max(s, p * 1000)) * max(0.0, min(1.0, (1 - p) / 0.5)) for s, p in zip(x, share)]
    np.testing.assert_allclose(y, expected, rtol=run_lr.AGREE_REL, atol=0)
    np.testing.assert_array_equal(_line(fig, "logged")[1], y)
    assert "agree at all 6" in fig["legend"] and "6e+09 FLOPs" in fig["title"]


def test_a_run_resumed_with_other_settings_shows_where_they_differ(ramp_run, tmp_path, drawn, caplog):
    """config.json is rewritten at each start: here as a resume with --max-steps 12 writes it. The ramp
    of 6 steps the log followed is not the one of 12 from step 4 on; those steps are marked and named."""
    run = _copy_run(ramp_run, tmp_path / "resumed", {"max_steps": 12})
    assert main(["plot", "lr", "--run", str(run), "--out", str(tmp_path / "lr.png")]) == 0
    fig, = drawn
    x, _ = _line(fig, "logged, not the configured rate")
    assert list(x) == [4, 5, 6]
    assert "they differ at 3 of 6 logged steps, from step 4" in fig["legend"]
    assert "from step 4" in caplog.text and str(run) in caplog.text


def test_a_log_without_progress_draws_what_it_can(ramp_run, tmp_path, drawn):
    """A log of an older aiayn (no lr_at): a schedule of the step alone is still drawn and agrees; one
    that follows the run's progress (here the epochs of train.max_epochs) cannot be, and says so."""
    old = "".join(json.dumps({k: v for k, v in r.items() if k != "lr_at"}) + "\n" for r in _log(ramp_run))
    steps_only = _copy_run(ramp_run, tmp_path / "a", lines=old)
    by_epochs = _copy_run(ramp_run, tmp_path / "b", {"max_epochs": 3}, lines=old)
    assert main(["plot", "lr", "--run", str(steps_only), "--out", str(tmp_path / "a.png")]) == 0
    assert main(["plot", "lr", "--run", str(by_epochs), "--out", str(tmp_path / "b.png")]) == 0
    assert "agree at all 6" in drawn[0]["legend"]
    assert not any(label.startswith("configured") for label in drawn[1]["lines"])
    assert "which this log does not record" in drawn[1]["legend"]
    assert_real_png(tmp_path / "b.png")


def test_a_last_line_cut_short_is_left_out_with_a_warning(ramp_run, tmp_path, drawn, caplog):
    lines = [line for line in (ramp_run / "train_log.jsonl").read_text().splitlines(keepends=True) if '"lr"' in line]
    run = _copy_run(ramp_run, tmp_path / "killed", lines="".join(lines)[:-40])  # step 6's line, cut
    assert main(["plot", "lr", "--run", str(run), "--out", str(tmp_path / "lr.png")]) == 0
    assert list(_line(drawn[0], "logged")[0]) == [1, 2, 3, 4, 5]
    assert f"{run / 'train_log.jsonl'}:6: the last line is cut short" in caplog.text


@pytest.mark.parametrize("case, message", [
    ("missing", "{run}: not found; --run takes a run directory"),
    ("checkpoint", "{run}: not a folder; --run takes a run directory that aiayn train wrote; its run directory is"),
    ("no config", "{run}/config.json: not found; --run takes a run directory"),
    ("config folder", "{run}/config.json: not a file; --run takes a run directory"),
    ("no log", "{run}/train_log.jsonl: not found"),
    ("no lr", "{run}/train_log.jsonl: no line holds an lr (1 line(s))"),
    ("bad line", "{run}/train_log.jsonl:2: not a train-log line"),
    ("bad lr", "{run}/train_log.jsonl:1: lr must be a finite number, got \"fast\""),
    ("bad lr_at", "{run}/train_log.jsonl:1: lr_at must be an object of elapsed, epochs, flops"),
    ("bad config", "{run}/config.json:1: invalid JSON"),
])
def test_bad_runs_are_one_line_naming_the_file(ramp_run, tmp_path, capsys, case, message):
    run = tmp_path / "run"
    good = (ramp_run / "train_log.jsonl").read_text()
    if case == "checkpoint":
        run = ramp_run / "last.pt"
    elif case == "no config":
        run.mkdir()
        (run / "train_log.jsonl").write_text(good)
    elif case != "missing":
        _copy_run(ramp_run, run, lines={
            "no log": "", "no lr": '{"step": 6, "valid_loss": 5.0}\n', "bad line": good.replace("\n", "\n}", 1),
            "bad lr": '{"step": 1, "lr": "fast"}\n', "bad lr_at": '{"step": 1, "lr": 0.1, "lr_at": {"time": 1}}\n',
        }.get(case, good))
        if case == "no log":
            (run / "train_log.jsonl").unlink()
        if case == "bad config":
            (run / "config.json").write_text("{")
        if case == "config folder":
            (run / "config.json").unlink()
            (run / "config.json").mkdir()
    out = tmp_path / "lr.png"
    assert main(["plot", "lr", "--run", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message.format(run=run) in err and err.count("\n") == 1, err
    assert not out.exists()


def test_run_and_eq3_options_do_not_mix(ramp_run, tmp_path, capsys):
    assert main(["plot", "lr", "--run", str(ramp_run), "--pairs", "512:4000", "--scale", "2",
                 "--out", str(tmp_path / "lr.png")]) == 2
    assert "--pairs, --scale: Eq. 3's curves; with --run the run's config.json sets the schedule" in capsys.readouterr().err


@pytest.mark.parametrize("train, follows", [
    ({}, False),
    ({"lr_decay_frac": 0.5}, False),  # the ramp in max_steps: the step alone
    ({"max_epochs": 3}, False),  # epochs without a ramp to move
    ({"lr_decay_frac": 0.5, "max_epochs": 3}, True),
    ({"by_budget": True, "max_time_min": 1.0}, False),  # the budget, nothing it moves
    ({"by_budget": True, "max_time_min": 1.0, "lr_decay_frac": 0.5}, True),
    ({"by_budget": True, "whole_by_time": True, "max_flops": 1e12}, True),
])
def test_follows_progress_is_whether_the_rate_reads_more_than_the_step(train, follows):
    fields = {"d_model": 64, "warmup_steps": 4, "lr_scale": 1.0, "max_steps": 100, "lr_decay_frac": 0.0,
              "by_budget": False, "whole_by_time": False, "max_time_min": 0.0, "max_flops": 0.0}
    s = Schedule(**{**fields, **train})
    assert s.follows_progress == follows
    late = {"elapsed": 50.0, "flops": 8e11, "epochs": 2.5}  # most of each budget spent
    assert any(s.rate(n) != s.rate(n, **late) for n in (1, 10, 50)) == follows


def test_lr_curves_are_drawn_at_a_bounded_number_of_steps():
    """--steps 10^6 (or 10^9) is drawn at LR_POINTS steps and each warmup's end (Eq. 3's peak), not
    at every step: the same figure in bounded time and memory."""
    from aiayn.viz.curves import LR_POINTS, lr_curves
    x, lrs = lr_curves([(512, 4000), (256, 7919)], 10 ** 6)
    assert len(x) <= LR_POINTS + 2 and x[0] == 1 and x[-1] == 10 ** 6 and (np.diff(x) > 0).all()
    assert x[lrs[0].argmax()] == 4000 and x[lrs[1].argmax()] == 7919
    assert lrs[1].max() == noam_lr(7919, 256, 7919)


def test_attention_figure_is_bounded_for_a_long_sentence():
    """300 tokens: each head's map at most MAP_INCHES a side (it was 0.12 inch a token, 36 inches), one
    token in 3 labelled, and the weights' colour scale drawn."""
    from aiayn.viz import attention as viz_attention
    H, Q, K = 4, 300, 290
    w = np.full((H, Q, K), 1.0 / K)
    fig = viz_attention.attention_figure(w, [f"q{i}" for i in range(Q)], [f"k{i}" for i in range(K)], "t")
    width, height = fig.get_size_inches()
    M = viz_attention.MAP_INCHES
    assert width <= 2 * (M + 1.3) + 1.0 and height <= 2 * (M + 1.5) + 0.4
    every = math.ceil(viz_attention.LABEL_INCHES / (M / Q))
    assert every == 3
    heads = [ax for ax in fig.axes if ax.images and ax.get_title().startswith("head")]
    assert [t.get_text() for t in heads[0].get_yticklabels()] == [f"q{i}" for i in range(0, Q, every)]
    assert "one token in 3 labelled" in fig.get_suptitle()
    assert any(ax.get_ylabel() == "attention weight" for ax in fig.axes)  # the colour bar
    viz_attention.agg_pyplot().close(fig)


def test_smoothing_figure_is_bounded_and_a_large_vocabulary_is_refused(tmp_path, monkeypatch, capsys):
    from aiayn.viz import curves
    shown = []
    monkeypatch.setattr(curves, "save_figure", lambda fig, out: shown.append(fig))
    curves.plot_smoothing(tmp_path / "x.png", targets=(5, 199, 0), vocab_size=200, eps_ls=0.1, pad_id=0)
    fig, = shown
    assert tuple(fig.get_size_inches()) <= (2.2 + 10.0, 1.2 + 8.0)  # (it was 161 inches wide)
    q = np.asarray(fig.axes[0].images[0].get_array())
    assert q.shape == (3, 200) and q[0, 5] == q[1, 199] == 0.9 and not q[2].any()
    assert any(ax.get_ylabel() == "q" for ax in fig.axes)  # no numbers in 200 cells: a colour scale
    with pytest.raises(ValueError, match="vocab_size 201"):
        curves.plot_smoothing(tmp_path / "x.png", targets=(5,), vocab_size=201)
    monkeypatch.undo()
    out = tmp_path / "big.png"
    assert main(["plot", "smoothing", "--vocab-size", "201", "--targets", "5", "--out", str(out)]) == 2
    assert "--vocab-size and the number of --targets: at most 200" in capsys.readouterr().err
    assert not out.exists()


def test_a_figure_replaces_an_earlier_one_in_one_step(tmp_path, monkeypatch):
    """--overwrite: the new PNG is written beside the old and renamed over it, so a write that fails
    (a full disk, a kill) leaves the earlier figure whole."""
    import matplotlib.figure
    mine = tmp_path / "lr.png"
    mine.write_bytes(b"the earlier figure")

    def failing(self, target, **kwargs):  # half a PNG written where savefig was told to write, then a full disk
        if isinstance(target, (str, os.PathLike)):
            Path(target).write_bytes(b"\x89PNG half")
        else:
            target.write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", failing)
    with pytest.raises(WriteError, match=r"lr.png: cannot write \(No space left on device\)"):  # one line without --debug
        main(["--debug", "plot", "lr", "--steps", "100", "--out", str(mine), "--overwrite"])
    assert mine.read_bytes() == b"the earlier figure"
    assert [p.name for p in tmp_path.iterdir()] == ["lr.png"]  # no temporary left behind
