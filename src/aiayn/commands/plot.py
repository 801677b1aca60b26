"""``aiayn plot attention|lr|smoothing``: PNG figures of attention, Eq. 3 (or a run's own rate) and label
smoothing."""
from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from aiayn.config import ConfigError, add_arguments
from aiayn.errors import UserError
from aiayn.files import check_output_file

LR_PAIRS = ("512:4000", "512:8000", "256:4000")  # the Annotated Transformer's
LR_STEPS = 20000
LR_MAX_STEPS = 2 ** 53  # steps and warmups held exactly by the float64 the curves are computed in
ATTENTION_DECODE = ("beam_size", "alpha", "max_len_a", "max_len_b")  # the DecodeConfig fields plot attention takes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plot", help="PNG figures: attention heat maps, the Eq. 3 learning rate, label smoothing",
                              description="Write PNG figures and print their paths.", allow_abbrev=False)
    sub = p.add_subparsers(dest="figure", metavar="FIGURE")
    sub.required = True

    from aiayn.decode.config import CHECKPOINT_FIELDS, DecodeConfig
    a = sub.add_parser("attention", help="heat maps of every attention layer and head for one sentence (Figures 3-5)",
                       description="Translate --src with the checkpoint, then write one PNG per attention kind "
                                   "(encoder, decoder_self, cross) and layer, a grid of the heads, tokens on the axes. "
                                   "An ensemble file translates with every member and draws its first member's "
                                   "attention.",
                       allow_abbrev=False)
    a.add_argument("--checkpoint", required=True, metavar="FILE",
                   help="checkpoint written by `aiayn train` or `aiayn average`, or an ensemble file from `aiayn "
                        "ensemble` (its first member's attention)")
    a.add_argument("--src", required=True, help="the source sentence")
    a.add_argument("--out", default="attention", metavar="DIR", help="output directory (default: attention)")
    a.add_argument("--overwrite", action="store_true", help="replace an earlier plot in --out")
    add_arguments(a, DecodeConfig, only=ATTENTION_DECODE)
    # None: not given, so the checkpoint's own settings apply (``decode_config``)
    a.set_defaults(func=run_attention, **{name: None for name in CHECKPOINT_FIELDS})

    lr = sub.add_parser("lr", help="learning-rate curves of Eq. 3 for (d_model, warmup) pairs, or a run's own rate",
                        description="Plot lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (§5.3) for "
                                    "--pairs; with --run, the rate a trained run used (its train_log.jsonl) beside "
                                    "the rate its config.json gives through the training's own schedule.",
                        allow_abbrev=False)
    lr.add_argument("--run", metavar="RUN_DIR",
                    help="a run directory of aiayn train: draw its logged and its configured rate "
                         "(instead of --pairs, --steps and --scale)")
    lr.add_argument("--pairs", nargs="+", default=None, metavar="D:W",
                    help=f"d_model:warmup_steps pairs (default: {' '.join(LR_PAIRS)})")
    lr.add_argument("--steps", type=int, default=None, help=f"last step plotted (default: {LR_STEPS})")
    lr.add_argument("--scale", type=float, default=None, help="factor on Eq. 3 (default: 1)")
    lr.add_argument("--out", default="lr.png", metavar="FILE", help="PNG path (default: lr.png)")
    lr.add_argument("--overwrite", action="store_true", help="replace an existing file at --out")
    lr.set_defaults(func=run_lr)

    s = sub.add_parser("smoothing", help="the label-smoothed target distribution (§5.4) for a few targets",
                       description="Heat map of smoothed_targets (the training loss's q) for --targets.",
                       allow_abbrev=False)
    s.add_argument("--targets", nargs="+", type=int, default=[2, 1, 0, 3, 3], help="target ids (default: 2 1 0 3 3)")
    s.add_argument("--vocab-size", type=int, default=5, help="V, at most 200 (default: 5)")
    s.add_argument("--eps-ls", type=float, default=0.4, help="eps_ls (default: 0.4; the paper trains with 0.1)")
    s.add_argument("--pad-id", type=int, default=0, help="padding id (default: 0)")
    s.add_argument("--out", default="smoothing.png", metavar="FILE", help="PNG path (default: smoothing.png)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing file at --out")
    s.set_defaults(func=run_smoothing)


def run_attention(args: argparse.Namespace) -> int:
    """Translate --src as `aiayn translate` does (the flags, else the settings the checkpoint carries,
    else §6.1's; a sentence over the limit refused), then draw its attention into a temporary folder
    beside --out that replaces --out once complete (``OutputDir``): a run that stops on the way leaves
    an earlier plot as it was."""
    from aiayn.commands.decode_settings import decode_config
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.translator import LongLineError, Translator
    from aiayn.files import OutputDir
    from aiayn.viz import attention
    try:
        cfg = decode_config(args, [args.checkpoint], base=DecodeConfig())
    except ConfigError as exc:
        raise UserError(str(exc)) from exc
    out = Path(args.out)
    _check_attention_folder(out, args.overwrite)
    translator = Translator.from_checkpoint(args.checkpoint, cfg)
    try:
        with OutputDir(out, overwrite=args.overwrite, ours=_holds_attention_plot, what="an attention plot") as tmp:
            paths = attention.plot_attention(translator, args.src, tmp)
    except LongLineError as exc:  # (translate's advice, --long-lines, is not an option here)
        raise UserError(f"--src: {exc.tokens} source tokens (EOS included) exceed the model's limit of "
                        f"{exc.limit}; plot a shorter sentence") from None
    for path in paths:
        print(out / path.name)
    return 0


ATTENTION_PNG = re.compile(r"(encoder|decoder_self|cross)_layer\d+\.png")  # what plot_attention writes


def _holds_attention_plot(out: Path) -> bool:
    """``out`` holds only figures that plot_attention writes (``OutputDir``'s ``ours``)."""
    return all(ATTENTION_PNG.fullmatch(p.name) for p in out.iterdir())


def _check_attention_folder(out: Path, overwrite: bool) -> None:
    """``out`` absent, empty, or (with ``overwrite``) an earlier plot, which ``OutputDir`` replaces whole
    (a model with fewer layers leaves none of its figures); a folder holding anything else is refused."""
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder; choose another --out")
    entries = sorted(p.name for p in out.iterdir())
    foreign = [name for name in entries if not ATTENTION_PNG.fullmatch(name)]
    if foreign:
        raise UserError(f"{out}: holds files that aiayn plot attention did not write ({', '.join(foreign[:5])}); "
                        f"choose another --out")
    if entries and not overwrite:
        raise UserError(f"{out}: holds an earlier plot (pass --overwrite to replace it)")


def _png_out(path: str, overwrite: bool) -> str:
    """``--out``: a .png name, new or (with ``overwrite``) replaced (``check_output_file``)."""
    if not path.lower().endswith(".png"):
        raise UserError(f"--out {path}: the figure is a PNG; give a name ending in .png")
    check_output_file(path, overwrite)
    return path


def _pairs(texts: list[str]) -> list[tuple[int, int]]:
    """``--pairs``: (d_model, warmup_steps) each, d_model within the model's ``LIMITS`` and warmup
    at most ``LR_MAX_STEPS``."""
    from aiayn.model.config import LIMITS
    lo, hi = LIMITS["d_model"]
    out = []
    for t in texts:
        found = re.fullmatch(r"([0-9]+):([0-9]+)", t)  # ASCII digits: str.isdigit takes "²", which int() refuses
        if found is None or int(found[1]) < 1 or int(found[2]) < 1:
            raise UserError(f"--pairs {t!r}: expected D_MODEL:WARMUP with positive integers, e.g. 512:4000")
        d, w = int(found[1]), int(found[2])
        if not (lo <= d <= hi and w <= LR_MAX_STEPS):
            raise UserError(f"--pairs {t!r}: d_model must be in [{lo:,}, {hi:,}] and warmup at most 2^53")
        out.append((d, w))
    return out


def run_lr(args: argparse.Namespace) -> int:
    from aiayn.viz.curves import plot_lr
    if args.run is not None:
        given = [f"--{name}" for name in ("pairs", "steps", "scale") if getattr(args, name) is not None]
        if given:
            raise UserError(f"{', '.join(given)}: Eq. 3's curves; with --run the run's config.json sets the "
                            f"schedule (drop {' and '.join(given)})")
        from aiayn.viz.run_lr import plot_run_lr
        out = _png_out(args.out, args.overwrite)
        print(plot_run_lr(args.run, out))
        return 0
    steps = LR_STEPS if args.steps is None else args.steps
    scale = 1.0 if args.scale is None else args.scale
    if not 1 <= steps <= LR_MAX_STEPS:
        raise UserError(f"--steps must be in [1, 2^53], got {steps}")
    if not (math.isfinite(scale) and scale > 0):  # (else an empty or a NaN plot, written silently)
        raise UserError(f"--scale must be a positive finite number, got {scale}")
    print(plot_lr(_png_out(args.out, args.overwrite), _pairs(args.pairs or list(LR_PAIRS)), steps, scale))
    return 0


def run_smoothing(args: argparse.Namespace) -> int:
    from aiayn.viz.curves import SMOOTHING_MAX, plot_smoothing
    V = args.vocab_size
    if V < 3 or not 0 <= args.pad_id < V or any(not 0 <= t < V for t in args.targets):
        raise UserError(f"--vocab-size must be >= 3 and --pad-id and --targets in [0, {V})")
    if V > SMOOTHING_MAX or len(args.targets) > SMOOTHING_MAX:
        raise UserError(f"--vocab-size and the number of --targets: at most {SMOOTHING_MAX} (each is a column or a row "
                        f"of the picture; a larger vocabulary's q is the same: 1 - eps_ls on the target, "
                        f"eps_ls / (V - 2) on each other token, 0 on padding)")
    if not 0.0 <= args.eps_ls < 1.0:
        raise UserError(f"--eps-ls must be in [0, 1), got {args.eps_ls}")
    print(plot_smoothing(_png_out(args.out, args.overwrite), tuple(args.targets), V, args.eps_ls, args.pad_id))
    return 0
