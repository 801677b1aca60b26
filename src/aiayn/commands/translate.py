"""``aiayn translate``: source sentences in, translations out, in input order (§6.1)."""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from aiayn.config import add_arguments
from aiayn.data.textio import CHUNK_LINES, input_chunks
from aiayn.commands.decode_settings import decode_config
from aiayn.decode.config import CHECKPOINT_FIELDS, TRANSLATE_DECODE, DecodeConfig, add_device_argument
from aiayn.errors import UserError
from aiayn.files import check_output_folder, refuse_input_as_output, write_output
from aiayn.host.allocator import trim_unless_never
from aiayn.progress import progress_bar, progress_shown

if TYPE_CHECKING:
    from aiayn.decode.translator import Translator

log = logging.getLogger(__name__)


def _stdin_as_none(value: str) -> str | None:
    """``--input -``: stdin, as no --input is (Unix's convention)."""
    return None if value == "-" else value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "translate", help="translate sentences with a checkpoint (beam search, §6.1)",
        description="Translate one sentence per line from --input (or stdin) to stdout, in input order. "
                    "Defaults are the paper's: beam 4, alpha 0.6, max length = input length + 50. "
                    "An empty line gives an empty line; a line longer than --max-input-tokens is truncated "
                    "with a warning naming its line number (--long-lines: truncate, skip or error). With --nbest N > 1 each output line is "
                    "'INDEX ||| TRANSLATION ||| SCORE' (0-based input index, best first; an empty input line "
                    "has no entries). A checkpoint imported from a Marian model carries the model's generation "
                    "settings (beams, length penalty, maximum length; docs/import.md): they replace these defaults, "
                    "and each flag given replaces them.",
        allow_abbrev=False)
    p.add_argument("--checkpoint", required=True, nargs="+", metavar="FILE",
                   help="checkpoint written by `aiayn train` or `aiayn average`; several (or an ensemble file from "
                        "`aiayn ensemble`) translate with their ensemble, the mean of their next-token probabilities")
    p.add_argument("--input", metavar="FILE", type=_stdin_as_none,
                   help="source sentences, one per line, plain or gzip (default, or -: stdin)")
    p.add_argument("--attention-out", metavar="FILE",
                   help="write attention weights of each best translation to FILE.json or FILE.npz")
    add_device_argument(p)
    p.add_argument("--interactive", action="store_true",
                   help="translate each line as soon as it is read and flush its output, as fairseq-interactive does "
                        "(the default when stdin is a terminal and no --input is given)")
    p.add_argument("--buffer", type=int, default=None, metavar="N",
                   help=f"lines read before they are translated and written (default {CHUNK_LINES:,}; 1 with "
                        f"--interactive); a small N gives a pipe its translations as lines arrive")
    p.add_argument("--prefix", metavar="FILE",
                   help="target prefixes, one per input line (an empty line: none): each translation begins with its "
                        "line's prefix, which the search continues (forced decoding, for interactive and post-editing tools)")
    p.add_argument("--alignments", action="store_true",
                   help="append ' ||| ' and the Pharaoh word alignment ('i-j', subword pieces from 0) from the "
                        "cross-attention of --alignment-layer to each output line (docs/translate.md)")
    p.add_argument("--alignment-layer", type=int, default=-1, metavar="N",
                   help="decoder layer whose attention (averaged over heads) gives --alignments: 0 is the first, "
                        "-1 (default) the last")
    add_arguments(p, DecodeConfig, defaults=TRANSLATE_DECODE)
    p.set_defaults(func=run, **{name: None for name in CHECKPOINT_FIELDS})  # None: not given (``decode_config``)


def _total_lines(path: str | None) -> int | None:
    """The input's line count for the progress bar's percentage: None for stdin, or when no bar is drawn."""
    from aiayn.data.textio import count_lines
    return count_lines(Path(path)) if path is not None and progress_shown() and Path(path).is_file() else None


def _write_attention(path: Path, records: list[dict]) -> None:
    """The attention weights of ``records`` to ``path`` (.json or .npz), written whole (``write_output``)."""
    if path.suffix == ".json":
        data = [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()} for r in records]
        write_output(path, lambda f: f.write(json.dumps(data).encode("utf-8")))
        return
    arrays = {}
    for r in records:
        i = r["line"]
        arrays[f"{i}_src_tokens"] = np.array(r["src_tokens"])
        arrays[f"{i}_tgt_tokens"] = np.array(r["tgt_tokens"])
        arrays[f"{i}_tgt_in_tokens"] = np.array(r["tgt_in_tokens"])
        for name in ("encoder", "decoder_self", "cross"):
            arrays[f"{i}_{name}"] = r[name]
    write_output(path, lambda f: np.savez_compressed(f, **arrays))


def _buffer_lines(args: argparse.Namespace) -> int:
    """Lines per chunk: --buffer, else 1 when interactive (--interactive, or stdin a terminal), else CHUNK_LINES.
    Translations do not depend on it (a sentence's output does not depend on its batch)."""
    if args.buffer is not None:
        if args.buffer < 1:
            raise UserError(f"--buffer must be at least 1, got {args.buffer}")
        return args.buffer
    if args.interactive or (args.input is None and sys.stdin.isatty()):
        return 1
    return CHUNK_LINES


def _alignment(translator: Translator, src_ids: list[int], hyp, layer: int) -> str:
    """The Pharaoh alignment of one hypothesis (aiayn/decode/align.py), from its teacher-forced attention."""
    from aiayn.decode.align import hard_alignment, pharaoh
    cross = translator.attention(src_ids, hyp.tokens, hyp.eos)["cross"]  # (L, H, T, S)
    return pharaoh(hard_alignment(cross, layer, len(src_ids) - 1, len(hyp.tokens)))


def _read_prefixes(path: str | None) -> Iterator[str] | None:
    """The --prefix file's lines, read as the input's chunks need them (never the whole file at once);
    read once, so a pipe will do."""
    if path is None:
        return None
    from aiayn.data.textio import check_readable, read_lines
    check_readable(Path(path), "--prefix", stream=True)
    return read_lines(Path(path))


def _check_prefix_count(prefix_path: str | None, input_path: str | None) -> None:
    """--prefix and an --input file of different line counts: an error before the model is loaded
    (``check_line_counts``, as ``evaluate`` checks its references). Where either is stdin or a pipe
    (read once: not counted first) the count is known only as the lines arrive: a short prefix file
    stops at the first line it lacks (``_chunk_prefixes``), a long one after the last translation
    (``_check_prefixes_used``)."""
    if prefix_path is None or input_path is None:
        return
    if not (Path(input_path).is_file() and Path(prefix_path).is_file()):
        return
    from aiayn.data.textio import check_line_counts, count_lines
    n_input, n_prefixes = count_lines(Path(input_path)), count_lines(Path(prefix_path))
    if n_input != n_prefixes:
        check_line_counts(prefix_path, n_prefixes, input_path, n_input)


def _chunk_prefixes(prefixes: Iterator[str] | None, path: str | None, first: int, n: int) -> list[str] | None:
    """The prefixes of input lines first..first+n-1, the next n lines of ``prefixes``; an error when
    the file has fewer lines."""
    if prefixes is None:
        return None
    chunk = list(itertools.islice(prefixes, n))
    if len(chunk) < n:
        raise UserError(f"--prefix {path}: {first - 1 + len(chunk)} lines, fewer than the input's "
                        "(one prefix per input line)")
    return chunk


def _check_prefixes_used(prefixes: Iterator[str] | None, path: str | None, n_lines: int) -> None:
    """After ``n_lines`` input lines: an error when the --prefix file has more lines than the input."""
    if prefixes is None:
        return
    extra = sum(1 for _ in prefixes)
    if extra:
        raise UserError(f"--prefix {path}: {n_lines + extra} lines for {n_lines} input lines (one prefix per input line)")


def _write_chunk(translator: Translator, ids: list[list[int]], hyps: list, first: int, args: argparse.Namespace,
                 records: list[dict]) -> None:
    """One chunk's output lines, in input order; with --attention-out, each best translation's
    attention weights appended to ``records``."""
    for k, hs in enumerate(hyps):
        texts = [translator.tgt_tok.decode(h.tokens) for h in hs]
        # --alignments: " ||| i-j ..." after each entry (after its score in an n-best list)
        aligns = [f" ||| {_alignment(translator, ids[k], h, args.alignment_layer)}" if args.alignments else ""
                  for h in hs]
        if translator.cfg.nbest == 1:
            sys.stdout.write((texts[0] + aligns[0] if texts else (" ||| " if args.alignments else "")) + "\n")
        else:
            for text, h, align in zip(texts, hs, aligns):
                sys.stdout.write(f"{first - 1 + k} ||| {text} ||| {h.score:.4f}{align}\n")
        if args.attention_out and hs:
            records.append({"line": first - 1 + k, **translator.attention(ids[k], hs[0].tokens, hs[0].eos)})


def run(args: argparse.Namespace) -> int:
    from aiayn.decode.translator import Translator
    cfg = decode_config(args, args.checkpoint)
    att_path = Path(args.attention_out) if args.attention_out else None
    if att_path is not None and att_path.suffix not in (".json", ".npz"):
        raise UserError(f"--attention-out {att_path}: the name must end in .json or .npz")
    refuse_input_as_output(att_path, [*args.checkpoint, args.input, args.prefix], "--attention-out")
    if att_path is not None:
        check_output_folder(att_path)  # written after the translations: said before them
    buffer = _buffer_lines(args)
    prefixes = _read_prefixes(args.prefix)  # (checked readable now, read as the chunks need it)
    _check_prefix_count(args.prefix, args.input)
    with Translator.from_checkpoint(args.checkpoint, cfg, device=args.device) as translator:
        if args.alignments:
            from aiayn.decode.align import check_layer
            check_layer(args.alignment_layer, translator.model.cfg.decoder_layers)
        source = args.input or "<stdin>"
        records, n_lines, t0 = [], 0, time.perf_counter()
        with progress_bar(_total_lines(args.input), unit=" lines", desc="translate",
                          quiet=buffer == 1) as bar:  # line by line: the translations show the progress
            for first, lines in input_chunks(args.input, buffer):
                ids = translator.encode(lines, source, first)
                forced = translator.encode_prefixes(_chunk_prefixes(prefixes, args.prefix, first, len(lines)),
                                                    args.prefix, first)
                hyps = translator.translate_ids(ids, forced, progress=bar.update)
                bar.clear()  # a terminal's stdout gets the translations without the bar in their midst
                _write_chunk(translator, ids, hyps, first, args, records)
                sys.stdout.flush()
                bar.refresh()
                if (n_lines + len(lines)) // CHUNK_LINES > n_lines // CHUNK_LINES:
                    trim_unless_never()  # each CHUNK_LINES lines: the heap's holes back (aiayn/host/allocator.py)
                n_lines += len(lines)
    _check_prefixes_used(prefixes, args.prefix, n_lines)
    if att_path is not None:
        _write_attention(att_path, records)
    log.info("translated %d lines in %.1fs", n_lines, time.perf_counter() - t0)
    return 0
