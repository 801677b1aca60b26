"""``aiayn export``: a checkpoint as a CTranslate2 model directory (``aiayn.interop.ct2_export``) or a
Hugging Face MarianMTModel directory (``aiayn.interop.hf_export``)."""
from __future__ import annotations

import json

from aiayn.errors import UserError
from aiayn.interop.export_dir import RECORD, ExportDir
from aiayn.interop.ct2_export import export_ct2, pieces

# the weight types ctranslate2's converters take (ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES)
CT2_QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16",
                     "float32")


def run(args) -> int:
    from aiayn.decode.loading import load_model_for_inference
    from aiayn.interop.hf_export import export_hf

    if args.format == "hf" and args.quantization:  # before the checkpoint is read
        raise UserError("--quantization applies to --format ct2")
    ExportDir(args.out, args.overwrite).check()  # before the work: a folder it may not replace
    model, src_tok, tgt_tok = load_model_for_inference(args.checkpoint)  # a bad file is named first
    if args.format == "hf":
        from aiayn.commands.decode_settings import stored_settings
        # the checkpoint's own decoding, which generation_config.json cannot say: `aiayn import` restores it
        record = {"checkpoint": str(args.checkpoint), "format": "hf", "decode": stored_settings([args.checkpoint])}
        out = export_hf(model, src_tok, tgt_tok, args.out, overwrite=args.overwrite,
                        files={RECORD: (json.dumps(record, indent=1) + "\n").encode()})
        print(f"hugging face marian model: {out}")
        return 0
    record = {"checkpoint": str(args.checkpoint), "quantization": args.quantization, "source_eos": "</s>",
              "decoder_start": "<s>"}
    # the tokenizers travel with the model, so the directory is all a user needs
    out = export_ct2(model, pieces(src_tok), pieces(tgt_tok), args.out, args.quantization or None,
                     overwrite=args.overwrite, files={"source.spm": src_tok.model_bytes,
                                                      "target.spm": tgt_tok.model_bytes,
                                                      RECORD: json.dumps(record, indent=1).encode()})
    print(f"ctranslate2 model: {out}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a CTranslate2 model directory (needs ctranslate2) "
                                      "or, with --format hf, a Hugging Face MarianMTModel directory (needs transformers)",
                       allow_abbrev=False)
    p.add_argument("--checkpoint", required=True, help="aiayn checkpoint (.pt), e.g. the demo's model.pt")
    p.add_argument("--out", required=True,
                   help="output directory: new or empty, or with --overwrite an earlier export (written whole, then "
                        "put in place in one step; a folder aiayn did not export is never replaced)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")
    p.add_argument("--format", default="ct2", choices=("ct2", "hf"),
                   help="ct2: a CTranslate2 model (default); hf: a Hugging Face MarianMTModel with its MarianTokenizer "
                        "(aiayn/interop/hf_export.py; post-norm models with d_k = d_v = d_model / h and sinusoidal positions)")
    p.add_argument("--quantization", default="", choices=("",) + CT2_QUANTIZATIONS, metavar="TYPE",
                   help=f"CTranslate2 weight type: {', '.join(CT2_QUANTIZATIONS)} (default: the checkpoint's float32)")
    p.set_defaults(func=run)
