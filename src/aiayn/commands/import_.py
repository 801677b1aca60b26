"""``aiayn import``: a Hugging Face MarianMTModel directory as an aiayn checkpoint (``aiayn.interop.hf_import``)."""
from __future__ import annotations

from pathlib import Path

from aiayn.checkpoint import atomic_save
from aiayn.config import add_arguments, from_args
from aiayn.files import check_output_file, refuse_input_as_output
from aiayn.interop.hf_import import ImportConfig, import_hf


def run(args) -> int:
    model_dir = Path(args.dir)
    refuse_input_as_output(args.out, model_dir.iterdir() if model_dir.is_dir() else [])
    check_output_file(args.out, args.overwrite)  # before the work
    ckpt = import_hf(args.dir, from_args(ImportConfig, args))
    atomic_save(ckpt, args.out)
    print(f"aiayn checkpoint: {args.out}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("import", help="read a Hugging Face MarianMTModel directory (e.g. an OPUS-MT model) as an "
                                      "aiayn checkpoint (needs transformers)",
                       allow_abbrev=False)
    p.add_argument("dir", help="the model's directory: config.json, model.safetensors or pytorch_model.bin, "
                               "source.spm, target.spm, vocab.json")
    p.add_argument("--format", default="hf", choices=("hf",),
                   help="hf: a MarianMTModel as save_pretrained writes it (aiayn/interop/hf_import.py)")
    p.add_argument("--out", required=True, help="the checkpoint to write (.pt; written whole, in one step)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file at --out")
    add_arguments(p, ImportConfig)
    p.set_defaults(func=run)
