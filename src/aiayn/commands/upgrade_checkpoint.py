"""``aiayn upgrade-checkpoint``: a checkpoint of an older aiayn rewritten in today's format."""
from __future__ import annotations

from pathlib import Path

from aiayn.files import check_output_file


def run(args) -> int:
    from aiayn.checkpoint import upgrade_checkpoint
    out = args.out or args.checkpoint
    if args.out is not None and Path(args.out).resolve() != Path(args.checkpoint).resolve():
        check_output_file(args.out, args.overwrite)
    upgrade_checkpoint(args.checkpoint, out)
    print(f"{args.checkpoint}: written in today's format to {out}")
    return 0


def register(sub) -> None:
    u = sub.add_parser("upgrade-checkpoint", help="rewrite a checkpoint of an older aiayn in today's format",
                       description="Checkpoints hold only tensors and plain values, with a checksum "
                                   "(docs/checkpoints.md). This rewrites one written before that (RNG states "
                                   "as numpy objects, no checksum); it reads tensors, plain values and numpy "
                                   "arrays only, never code. A file that carries a checksum is verified first: "
                                   "a damaged or edited one is refused, never sealed again.",
                       allow_abbrev=False)
    u.add_argument("checkpoint", help="checkpoint or ensemble file")
    u.add_argument("--out", help="output file, new unless --overwrite (default: replace the input, atomically)")
    u.add_argument("--overwrite", action="store_true", help="replace an existing --out (in one step)")
    u.set_defaults(func=run)
