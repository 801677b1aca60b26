"""``aiayn train``, ``aiayn average``, ``aiayn ensemble`` and ``aiayn upgrade-checkpoint``."""
from __future__ import annotations

import argparse
import errno
from pathlib import Path

from aiayn.config import apply_sets, sets_help
from aiayn.errors import UserError
from aiayn.files import check_output_file
from aiayn.model.config import PRESETS, ModelConfig
from aiayn.train.config import TrainConfig, load_recipe, run_config_from_preset


def resolve_run_config(args):
    """Preset (or recipe file) + ``--set`` overrides + the shortcut flags -> RunConfig."""
    if args.recipe:
        cfg = load_recipe(args.recipe)
    elif args.preset is None and getattr(args, "init_from", None):
        from aiayn.train.finetune import run_config_of
        cfg = run_config_of(args.init_from)  # fine-tuning: the checkpoint's own recipe
    else:
        cfg = run_config_from_preset(args.preset or "base")
    sets = list(args.set or [])
    if args.max_steps is not None:
        sets.append(f"train.max_steps={args.max_steps}")
    return apply_sets(cfg, sets)


def run_train(args) -> int:
    from aiayn.train.loop import train
    cfg = resolve_run_config(args)
    if args.resume_optimizer and not args.init_from:
        raise UserError("--resume-optimizer needs --init-from")
    try:
        train(args.data, args.out, cfg, progress=not args.no_progress, init_from=args.init_from,
              resume_optimizer=args.resume_optimizer)
    except OSError as exc:  # the logs, a segmentation... (checkpoints name their file themselves)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise UserError(f"{exc.filename or args.out}: cannot write ({exc.strerror}); free some space and run the "
                        f"same command again: it resumes from the last checkpoint, which is intact") from exc
    except RuntimeError as exc:
        from aiayn.train.runtime import timed_out
        if not timed_out(exc):
            raise
        import torch.distributed as tdist
        raise UserError(f"{args.out}: rank {tdist.get_rank()} of {tdist.get_world_size()} waited "
                        f"train.dist_timeout_s = {cfg.train.dist_timeout_s:g} s for the other processes: one of them "
                        f"failed or hangs (its own error says why); the last checkpoint is intact and the same "
                        f"command resumes") from exc
    return 0


def run_average(args) -> int:
    from aiayn.checkpoint import atomic_save, average_checkpoints, step_checkpoints
    check_output_file(args.out, args.overwrite)
    inputs = [Path(p) for p in args.inputs]
    if args.last is not None and args.last < 1:
        raise UserError(f"--last must be at least 1, got {args.last}")
    if len(inputs) == 1 and inputs[0].is_dir():
        found = step_checkpoints(inputs[0])
        if not found:
            raise UserError(f"{inputs[0]}: no step checkpoints (ckpt_step*.pt) to average")
        last = args.last or 5
        paths = found[-last:]
        if len(paths) < last:
            print(f"note: only {len(paths)} checkpoint(s) in {inputs[0]}, averaging all of them")
    else:
        if args.last is not None and len(inputs) > 1:
            raise UserError("--last applies to a run directory, not to a list of files")
        paths = inputs
    avg = average_checkpoints(paths)
    atomic_save(avg, args.out)
    print(f"averaged {len(paths)} checkpoint(s) into {args.out}: " + ", ".join(p.name for p in paths))
    return 0


def run_ensemble(args) -> int:
    from aiayn.checkpoint import atomic_save, ensemble_checkpoint
    check_output_file(args.out, args.overwrite)
    ens = ensemble_checkpoint([Path(p) for p in args.inputs])
    atomic_save(ens, args.out)
    print(f"an ensemble of {len(ens['members'])} model(s) in {args.out}")
    return 0


def run_upgrade(args) -> int:
    from aiayn.checkpoint import upgrade_checkpoint
    out = args.out or args.checkpoint
    if args.out is not None and Path(args.out).resolve() != Path(args.checkpoint).resolve():
        check_output_file(args.out, args.overwrite)
    upgrade_checkpoint(args.checkpoint, out)
    print(f"{args.checkpoint}: written in today's format to {out}")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a Transformer on a prepared data directory (resumes if --out has a run)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="--set keys (section.field=value):\n" + sets_help(ModelConfig, "model") + "\n"
               + sets_help(TrainConfig, "train"))
    p.add_argument("--data", required=True, help="data directory written by `aiayn prepare`")
    p.add_argument("--out", required=True, help="run directory (checkpoints, logs); resumed if it holds last.pt")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", default=None, choices=list(PRESETS),
                   help="named configuration (default base; with --init-from, the checkpoint's configuration)")
    g.add_argument("--recipe", help="JSON recipe file {preset, model: {...}, train: {...}} instead of --preset")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="override a field (repeatable)")
    p.add_argument("--max-steps", type=int, default=None, help="shortcut for --set train.max_steps=N")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--init-from", metavar="MODEL.pt", default=None,
                   help="fine-tune: start a new run from this checkpoint's weights, with a fresh optimizer and "
                        "schedule; its tokenizer(s) and parameter shapes must match (prepare the data with "
                        "`aiayn prepare --tokenizer-from MODEL.pt`); without --preset/--recipe the run takes "
                        "the checkpoint's configuration, --set overriding it")
    p.add_argument("--resume-optimizer", action="store_true",
                   help="with --init-from: also load the checkpoint's Adam moments (the schedule still starts at step 1)")
    p.set_defaults(func=run_train)

    a = sub.add_parser("average", help="average checkpoints in float32 (§6.1: last 5 for base, last 20 for big)")
    a.add_argument("inputs", nargs="+", help="a run directory (with --last N) or checkpoint files")
    a.add_argument("--last", type=int, default=None,
                   help="with a run directory: average its last N step checkpoints (default 5)")
    a.add_argument("--out", required=True, help="output checkpoint file (new, unless --overwrite)")
    a.add_argument("--overwrite", action="store_true", help="replace an existing --out (in one step)")
    a.set_defaults(func=run_average)

    e = sub.add_parser("ensemble", help="put several checkpoints into one file that translates with their ensemble",
                       description="One file holding the models of several checkpoints (averaged or not; they must "
                                   "share the tokenizers). `aiayn translate --checkpoint FILE` then decodes with the "
                                   "mean of their next-token probabilities, as with several --checkpoint files.")
    e.add_argument("inputs", nargs="+", help="checkpoint files (or ensemble files)")
    e.add_argument("--out", required=True, help="output ensemble file (new, unless --overwrite)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --out (in one step)")
    e.set_defaults(func=run_ensemble)

    u = sub.add_parser("upgrade-checkpoint", help="rewrite a checkpoint of an older aiayn in today's format",
                       description="Checkpoints hold only tensors and plain values, with a checksum "
                                   "(docs/checkpoints.md). This rewrites one written before that (RNG states "
                                   "as numpy objects, no checksum); it reads tensors, plain values and numpy "
                                   "arrays only, never code. A file that carries a checksum is verified first: "
                                   "a damaged or edited one is refused, never sealed again.")
    u.add_argument("checkpoint", help="checkpoint or ensemble file")
    u.add_argument("--out", help="output file, new unless --overwrite (default: replace the input, atomically)")
    u.add_argument("--overwrite", action="store_true", help="replace an existing --out (in one step)")
    u.set_defaults(func=run_upgrade)
