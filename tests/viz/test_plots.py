"""Figures: attention heat maps from the model's own weights, Eq. 3 curves, label smoothing."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from aiayn.cli import main
from aiayn.decode.config import DecodeConfig
from aiayn.decode.translator import Translator
from aiayn.errors import UserError
from aiayn.viz import attention as viz_attention
from aiayn.viz.curves import lr_curves
from tests.arith import softmax_sum_bound

SRC = "A man is riding a bicycle."


def assert_real_png(path, min_bytes=5000):
    """The file is a PNG of some size whose pixels are not all one colour."""
    import matplotlib.image as mpimg
    assert path.is_file() and path.stat().st_size > min_bytes, path
    img = mpimg.imread(path)  # (rows, cols, channels) floats in [0, 1]
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img[..., :3].var() > 1e-3, f"{path} looks blank"


@pytest.fixture(scope="module")
def translator(tiny_checkpoint) -> Translator:
    torch.set_num_threads(1)
    return Translator.from_checkpoint(tiny_checkpoint, DecodeConfig(max_len_b=6))


def test_plot_attention_draws_the_models_weights(translator, tmp_path, monkeypatch):
    drawn = []
    real = viz_attention.attention_figure

    def spy(weights, rows, cols, title):
        fig = real(weights, rows, cols, title)
        drawn.append((title, weights, rows, cols, [ax.images[0].get_array() for ax in fig.axes if ax.images]))
        return fig

    monkeypatch.setattr(viz_attention, "attention_figure", spy)
    paths = viz_attention.plot_attention(translator, SRC, tmp_path / "att")
    L, H = translator.model.cfg.n_layers, translator.model.cfg.n_heads
    assert [p.name for p in paths] == [f"{k}_layer{i}.png" for k in ("encoder", "decoder_self", "cross")
                                       for i in range(1, L + 1)]
    for p in paths:
        assert_real_png(p)

    # the plotted arrays are the model's own weights (teacher-forced on the best translation)
    src_ids = translator.encode([SRC])[0]
    best = translator.translate_ids([src_ids])[0][0]
    out_ids = list(best.tokens) + ([3] if best.eos else [])
    with torch.inference_mode():
        enc = translator.model.encode(torch.tensor([src_ids]), need_weights=True)
        dec = translator.model.decode(torch.tensor([[2] + out_ids[:-1]]), enc, need_weights=True)
    expected = [w[0] for w in enc.weights] + [w[0] for w in dec.self_weights] + [w[0] for w in dec.cross_weights]
    assert len(drawn) == 3 * L
    S, T = len(src_ids), len(out_ids)
    for (title, weights, rows, cols, images), ref in zip(drawn, expected):
        assert len(images) == H
        assert weights.shape == (H, len(rows), len(cols))
        np.testing.assert_array_equal(weights, ref.numpy())  # the same computation: the same numbers
        for img in images:  # each head's heat map: rows are probability distributions over the keys
            assert (np.abs(np.asarray(img).sum(-1) - 1.0) <= float(softmax_sum_bound(len(cols)))).all()
        if title.startswith("encoder-decoder"):
            assert weights.shape[1:] == (T, S) and cols == [translator.src_tok.piece(i) for i in src_ids]
        if title.startswith("decoder self"):  # causal: no weight on future positions
            assert np.triu(weights, k=1).max() == 0.0


def test_decoder_self_attention_columns_are_the_decoders_inputs(translator, tmp_path, monkeypatch):
    """Decoder position t predicts output token t from the inputs BOS, y_1 .. y_{t-1} (§3.1): its
    row is labelled with the prediction, its keys with the shifted inputs, so that the causal
    diagonal pairs a prediction with the token before it (never with itself)."""
    drawn = {}
    real = viz_attention.attention_figure

    def spy(weights, rows, cols, title):
        drawn[title] = (rows, cols)
        return real(weights, rows, cols, title)

    monkeypatch.setattr(viz_attention, "attention_figure", spy)
    viz_attention.plot_attention(translator, SRC, tmp_path / "att")
    src_ids = translator.encode([SRC])[0]
    best = translator.translate_ids([src_ids])[0][0]
    out_ids = list(best.tokens) + ([translator.ids.eos] if best.eos else [])
    piece = translator.tgt_tok.piece
    rows, cols = drawn["decoder self-attention, layer 1"]
    assert rows == [piece(i) for i in out_ids]
    assert cols == [piece(i) for i in [translator.ids.bos] + out_ids[:-1]]
    rows, cols = drawn["encoder-decoder attention, layer 1"]
    assert rows == [piece(i) for i in out_ids]


def test_attention_figure_rows_and_labels():
    w = np.random.default_rng(0).random((3, 2, 4))
    w /= w.sum(-1, keepdims=True)
    fig = viz_attention.attention_figure(w, ["x", "y"], ["a", "b", "c", "d"], "t")
    axes = [ax for ax in fig.axes if ax.images]
    assert len(axes) == 3
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["a", "b", "c", "d"]
    assert [t.get_text() for t in axes[0].get_yticklabels()] == ["x", "y"]
    np.testing.assert_array_equal(axes[2].images[0].get_array(), w[2])
    viz_attention.agg_pyplot().close(fig)


def test_plot_attention_empty_sentence_is_a_user_error(translator, tmp_path):
    with pytest.raises(UserError, match="empty"):
        viz_attention.plot_attention(translator, "   ", tmp_path)


def test_cli_plot_attention_prints_paths(tiny_checkpoint, tmp_path, capsys):
    assert main(["plot", "attention", "--checkpoint", str(tiny_checkpoint), "--src", "Two dogs.",
                 "--out", str(tmp_path / "a"), "--beam-size", "2", "--max-len-b", "4"]) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 3 * 2 and all((tmp_path / "a").joinpath(p.split("/")[-1]).is_file() for p in printed)


def test_lr_curves_follow_eq3():
    x, lrs = lr_curves([(512, 4000), (256, 4000)], 8000)
    # peak at step = warmup: d_model^-0.5 * warmup^-0.5
    assert x[lrs[0].argmax()] == 4000
    assert lrs[0].max() == pytest.approx(512 ** -0.5 * 4000 ** -0.5)
    assert lrs[0][0] == pytest.approx(512 ** -0.5 * 4000 ** -1.5)
    np.testing.assert_allclose(lrs[1] / lrs[0], 2 ** 0.5)


def test_cli_plot_lr_and_smoothing(tmp_path, capsys):
    assert main(["plot", "lr", "--out", str(tmp_path / "lr.png"), "--steps", "2000",
                 "--pairs", "512:400", "512:800", "256:400"]) == 0
    assert main(["plot", "smoothing", "--out", str(tmp_path / "ls.png")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "lr.png"), str(tmp_path / "ls.png")]
    assert_real_png(tmp_path / "lr.png")
    assert_real_png(tmp_path / "ls.png", min_bytes=3000)


def test_smoothing_plot_shows_smoothed_targets(tmp_path, monkeypatch):
    """The picture is smoothed_targets: gold 1 - eps, eps / (V - 2) elsewhere, 0 for pad and pad rows."""
    from aiayn.viz import curves
    shown = []
    monkeypatch.setattr(curves, "save_figure", lambda fig, out: shown.append(fig.axes[0].images[0].get_array()))
    curves.plot_smoothing(tmp_path / "x.png", targets=(2, 0), vocab_size=5, eps_ls=0.4, pad_id=0)
    np.testing.assert_allclose(np.asarray(shown[0]), [[0, 0.4 / 3, 0.6, 0.4 / 3, 0.4 / 3], [0, 0, 0, 0, 0]])


@pytest.mark.parametrize("argv, msg", [
    (["plot", "lr", "--pairs", "512-4000"], "D_MODEL:WARMUP"),
    (["plot", "smoothing", "--targets", "7"], "--targets"),
    (["plot", "lr", "--scale", "nan"], "--scale"),
    (["plot", "lr", "--scale", "inf"], "--scale"),
    (["plot", "lr", "--scale", "0"], "--scale"),
    (["plot", "lr", "--scale", "-1"], "--scale"),
    (["plot", "lr", "--pairs", "\u00b2:4000"], "D_MODEL:WARMUP"),  # a digit to str.isdigit, not to int()
    (["plot", "lr", "--pairs", "\u0665\u0661\u0662:4000"], "D_MODEL:WARMUP"),  # Arabic-Indic digits
    (["plot", "lr", "--pairs", "9" * 400 + ":4000"], "d_model must be in [1, 65,536]"),
    (["plot", "lr", "--pairs", "512:" + "9" * 400], "warmup at most 2^53"),
    (["plot", "lr", "--steps", str(2 ** 53 + 1)], "--steps must be in [1, 2^53]"),
    (["plot", "lr", "--steps", str(10 ** 20)], "--steps must be in [1, 2^53]"),
])
def test_cli_plot_bad_arguments_exit_2(argv, msg, tmp_path, capsys):
    assert main(argv + ["--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "x.png").exists()


def test_the_largest_steps_and_pairs_allowed_draw(tmp_path, capsys):
    """The bounds of --steps and --pairs are values the curves are computed at."""
    out = tmp_path / "x.png"
    assert main(["plot", "lr", "--steps", str(2 ** 53), "--pairs", f"65536:{2 ** 53}", "1:1", "--out", str(out)]) == 0
    assert_real_png(out, min_bytes=3000)


def aiayn_with_file_size_limit(argv: list[str], limit: int) -> subprocess.CompletedProcess:
    """``aiayn ARGV`` in a new process whose files may grow to ``limit`` bytes (RLIMIT_FSIZE: a write
    past it fails as on a full disk, with EFBIG; Python ignores SIGXFSZ)."""
    code = (f"import resource, sys\nresource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
            f"from aiayn.cli import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("figure", ["lr", "smoothing"])
def test_a_figure_that_cannot_be_written_is_one_line_and_keeps_the_earlier_one(figure, tmp_path):
    """A full disk (here a file-size limit smaller than the PNG) stops with one line naming --out; the
    earlier figure is as it was and no temporary is left beside it."""
    out = tmp_path / "figure.png"
    out.write_bytes(b"earlier figure")
    proc = aiayn_with_file_size_limit(["plot", figure, "--out", str(out), "--overwrite"], 2000)
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (
        2, [f"aiayn plot: error: {out}: cannot write (File too large); an earlier figure there is intact"])
    assert out.read_bytes() == b"earlier figure" and sorted(p.name for p in tmp_path.iterdir()) == ["figure.png"]


def test_plots_never_replace_what_they_did_not_write(tiny_checkpoint, tmp_path, capsys):
    """--out: a .png for lr and smoothing, replaced only with --overwrite; attention's folder holds
    only an earlier plot, replaced whole with --overwrite (a file of another kind is never touched)."""
    mine = tmp_path / "mine.png"
    mine.write_text("important")
    assert main(["plot", "lr", "--out", str(mine)]) == 2
    assert f"{mine}: already exists (pass --overwrite to replace it)" in capsys.readouterr().err
    assert mine.read_text() == "important"
    assert main(["plot", "lr", "--out", str(tmp_path / "foo")]) == 2
    assert "--out" in capsys.readouterr().err and not (tmp_path / "foo.png").exists()
    assert main(["plot", "smoothing", "--out", str(mine), "--overwrite"]) == 0
    assert_real_png(mine)
    attention = ["plot", "attention", "--checkpoint", str(tiny_checkpoint), "--src", "Two dogs.", "--max-len-b", "4",
                 "--out", str(tmp_path / "a")]
    assert main(attention) == 0
    capsys.readouterr()
    assert main(attention) == 2
    assert "holds an earlier plot (pass --overwrite to replace it)" in capsys.readouterr().err
    assert main(attention + ["--overwrite"]) == 0
    (tmp_path / "a" / "notes.txt").write_text("mine")
    assert main(attention + ["--overwrite"]) == 2
    assert "holds files that aiayn plot attention did not write (notes.txt)" in capsys.readouterr().err
    assert (tmp_path / "a" / "notes.txt").read_text() == "mine"
    assert main([*attention[:-1], str(mine)]) == 2  # a file where the folder goes: one line, no traceback
    assert f"{mine}: exists and is not a folder" in capsys.readouterr().err


def test_a_failed_plot_attention_overwrite_keeps_the_earlier_plot(tiny_checkpoint, tmp_path, capsys):
    """--overwrite replaces the folder once the new figures are drawn: a run that stops before (an empty
    sentence, a checkpoint not found) leaves the earlier plot as it was (docs/plots.md)."""
    out = tmp_path / "a"
    attention = ["plot", "attention", "--checkpoint", str(tiny_checkpoint), "--src", "Two dogs.", "--max-len-b", "4",
                 "--out", str(out)]
    assert main(attention) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main([*attention[:5], "   ", *attention[6:], "--overwrite"]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["plot", "attention", "--checkpoint", str(tmp_path / "none.pt"), *attention[4:], "--overwrite"]) == 2
    assert "not found" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main(attention + ["--overwrite"]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(out / name) for name in before)  # the paths at --out, not a temporary's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temporary left beside it


def test_plot_attention_decodes_with_the_settings_the_checkpoint_carries(tiny_checkpoint, tmp_path, monkeypatch):
    """The translation drawn is the one `aiayn translate` gives: the settings the checkpoint carries (the
    demo's α, an imported model's generation settings) where no flag is given, each flag over them."""
    from aiayn.checkpoint import atomic_save, load_checkpoint
    path = tmp_path / "with_settings.pt"
    atomic_save({**load_checkpoint(tiny_checkpoint), "decode": {"alpha": 1.4, "length_norm": "power"}}, path)
    seen = []
    monkeypatch.setattr(viz_attention, "plot_attention", lambda translator, src, out: seen.append(translator.cfg) or [])
    assert main(["plot", "attention", "--checkpoint", str(path), "--src", "Two dogs.", "--out", str(tmp_path / "a")]) == 0
    assert (seen[-1].alpha, seen[-1].length_norm, seen[-1].beam_size) == (1.4, "power", 4)
    assert main(["plot", "attention", "--checkpoint", str(path), "--src", "Two dogs.", "--alpha", "0.6",
                 "--beam-size", "2", "--out", str(tmp_path / "b")]) == 0
    assert (seen[-1].alpha, seen[-1].length_norm, seen[-1].beam_size) == (0.6, "power", 2)
    assert seen[-1].long_lines == "error"  # a sentence over the limit is refused, not truncated
