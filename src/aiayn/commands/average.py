"""``aiayn average``: the float32 mean of checkpoints (§6.1), of a run's last N or of given files, of one
run (or of models fine-tuned from one checkpoint) unless ``--across-runs``."""
from __future__ import annotations

from pathlib import Path

from aiayn.errors import UserError
from aiayn.files import check_output_file, refuse_input_as_output


def run(args) -> int:
    from aiayn.checkpoint import atomic_save, average_checkpoints, step_checkpoints
    inputs = [Path(p) for p in args.inputs]
    refuse_input_as_output(args.out, inputs)
    check_output_file(args.out, args.overwrite)
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
    refuse_input_as_output(args.out, paths)  # (a run directory's: known only now)
    avg = average_checkpoints(paths, args.across_runs)
    atomic_save(avg, args.out)
    names = [p.name for p in paths]  # a run's step checkpoints by name; files of several runs (last.pt ...) by path
    if len(set(names)) < len(names):
        names = [str(p) for p in paths]
    print(f"averaged {len(paths)} checkpoint(s) into {args.out}: " + ", ".join(names))
    return 0


def register(sub) -> None:
    a = sub.add_parser("average", help="average checkpoints in float32 (§6.1: last 5 for base, last 20 for big)",
                       allow_abbrev=False)
    a.add_argument("inputs", nargs="+", help="a run directory (with --last N) or checkpoint files")
    a.add_argument("--last", type=int, default=None,
                   help="with a run directory: average its last N step checkpoints (default 5)")
    a.add_argument("--out", required=True, help="output checkpoint file (new, unless --overwrite)")
    a.add_argument("--overwrite", action="store_true", help="replace an existing --out (in one step)")
    a.add_argument("--across-runs", action="store_true",
                   help="average checkpoints of different runs (other initial weights) with a warning, not an "
                        "error: their mean is no trained model")
    a.set_defaults(func=run)
