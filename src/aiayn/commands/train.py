"""``aiayn train``: train a Transformer on a prepared data directory (``aiayn.train.loop``)."""
from __future__ import annotations

import argparse
import errno
import os
import sys

from aiayn.config import apply_sets, option_sets, sets_help
from aiayn.errors import UserError, WriteError
from aiayn.model.config import PRESETS, ModelConfig
from aiayn.train.config import RunConfig, TrainConfig, load_recipe, run_config_from_dict, run_config_from_preset


def resolve_run_config(args, defaults: tuple[str, ...] = ()):
    """Preset (or recipe file, or the --init-from checkpoint's configuration), then a command's own
    ``defaults`` (``aiayn parse train``'s), then the ``--set`` overrides in their order, then the named
    options (``--max-steps``) -> RunConfig. A named option and a ``--set`` of its field that disagree are
    refused (``option_sets``)."""
    if args.recipe:
        cfg = load_recipe(args.recipe)
    elif args.preset is None and getattr(args, "init_from", None):
        cfg = run_config_of(args.init_from)  # fine-tuning: the checkpoint's own recipe
    else:
        cfg = run_config_from_preset(args.preset or "base")
    sets = list(args.set or [])
    named = option_sets(sets, [("--max-steps", "train.max_steps", args.max_steps)])
    return apply_sets(cfg, [*defaults, *sets, *named])


def run_config_of(path: str) -> RunConfig:
    """The run configuration a checkpoint was trained with (the default of a fine-tuning run)."""
    from aiayn.checkpoint import load_checkpoint
    ckpt = load_checkpoint(path)
    if "run_config" not in ckpt:
        raise UserError(f"{path}: the checkpoint has no run_config; give --preset or --recipe")
    return run_config_from_dict(ckpt["run_config"])


def run(args) -> int:
    from aiayn.train.loop import train
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank torchrun started: it ends with its launcher, even a
        from aiayn.host.process import die_with_parent  # killed one, rather than train on as an orphan
        die_with_parent(os.getppid())
    cfg = resolve_run_config(args)
    if args.resume_optimizer and not args.init_from:
        raise UserError("--resume-optimizer needs --init-from")
    try:
        train(args.data, args.out, cfg, progress=not args.no_progress, init_from=args.init_from,
              resume_optimizer=args.resume_optimizer)
    except WriteError as exc:  # a checkpoint: it names its file
        raise UserError(f"{exc}; the same command resumes from the last checkpoint once it can write") from exc
    except OSError as exc:  # the logs, a segmentation... (checkpoints name their file themselves)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise UserError(f"{exc.filename or args.out}: cannot write ({exc.strerror}); free some space and run the "
                        f"same command again: it resumes from the last checkpoint, which is intact") from exc
    except RuntimeError as exc:
        from aiayn.train.runtime import peer_lost, timed_out
        if not (timed_out(exc) or peer_lost(exc)):
            raise
        from aiayn.train import runtime
        what = (f"waited train.dist_timeout_s = {cfg.train.dist_timeout_s:g} s for the other processes: one of them "
                f"failed or hangs" if timed_out(exc) else "lost its connection to another process, which ended")
        dist = runtime.launch_env(os.environ)  # (the process group's, joined or waited for at the start)
        message = f"{args.out}: rank {dist.rank} of {dist.world_size} {what}"
        message += (" (its own error says why); the last checkpoint is intact and the same command resumes"
                    if runtime.AGREED else " before the ranks began the run (its own error says why)")
        if getattr(args, "debug", False):
            raise UserError(message) from exc
        # said here and left at once: the broken process group's threads make the interpreter's exit
        # abort (std::terminate, status -6) after the message
        print(f"aiayn train: error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a Transformer on a prepared data directory (resumes if --out has a run)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="--set keys (section.field=value):\n" + sets_help(ModelConfig, "model") + "\n"
               + sets_help(TrainConfig, "train"),
        allow_abbrev=False)
    p.add_argument("--data", required=True, help="data directory written by `aiayn prepare`")
    p.add_argument("--out", required=True, help="run directory (checkpoints, logs); resumed if it holds last.pt")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", default=None, choices=list(PRESETS),
                   help="named configuration (default base; with --init-from, the checkpoint's configuration)")
    g.add_argument("--recipe", help="JSON recipe file {preset, model: {...}, train: {...}} instead of --preset")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                   help="override a field of the preset or recipe (repeatable; in order, a field given twice keeps "
                        "the last); the keys are listed below")
    p.add_argument("--max-steps", type=int, default=None,
                   help="shortcut for --set train.max_steps=N (a --set of it with another value is an error)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (none either where stderr is not a terminal): a log line at every "
                        "train.log_every_steps instead")
    p.add_argument("--init-from", metavar="MODEL.pt", default=None,
                   help="fine-tune: a new run from this checkpoint's weights, fresh optimizer and schedule; same "
                        "tokenizers and shapes; without --preset/--recipe, its configuration (docs/finetuning.md)")
    p.add_argument("--resume-optimizer", action="store_true",
                   help="with --init-from: also load the checkpoint's Adam moments (the schedule still starts at step 1)")
    p.set_defaults(func=run)
