"""``aiayn ensemble``: several checkpoints in one file that translates with their ensemble."""
from __future__ import annotations

from pathlib import Path

from aiayn.files import check_output_file, refuse_input_as_output


def run(args) -> int:
    from aiayn.checkpoint import atomic_save, ensemble_checkpoint
    refuse_input_as_output(args.out, args.inputs)
    check_output_file(args.out, args.overwrite)
    ens = ensemble_checkpoint([Path(p) for p in args.inputs])
    atomic_save(ens, args.out)
    print(f"an ensemble of {len(ens['members'])} model(s) in {args.out}")
    return 0


def register(sub) -> None:
    e = sub.add_parser("ensemble", help="put several checkpoints into one file that translates with their ensemble",
                       description="One file holding the models of several checkpoints (averaged or not; they must "
                                   "share the tokenizers). `aiayn translate --checkpoint FILE` then decodes with the "
                                   "mean of their next-token probabilities, as with several --checkpoint files.",
                       allow_abbrev=False)
    e.add_argument("inputs", nargs="+", help="checkpoint files (or ensemble files)")
    e.add_argument("--out", required=True, help="output ensemble file (new, unless --overwrite)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --out (in one step)")
    e.set_defaults(func=run)
