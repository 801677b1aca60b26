"""Out of memory, on a GPU or in the CPU's RAM: the one line ``aiayn`` prints instead of a
traceback, naming the setting of the command that ran out to lower and by how much.

PyTorch says it with ``torch.cuda.OutOfMemoryError`` (a ``RuntimeError``) on CUDA and a
``RuntimeError`` "... can't allocate memory" from its CPU allocator; Python with ``MemoryError``.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from aiayn.data.stream import Batching


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "can't allocate memory" in text)


def _where(exc: BaseException) -> str:
    return "on the GPU" if "CUDA" in str(exc) or type(exc).__name__ == "OutOfMemoryError" else "in RAM"


LENGTH_FACTOR = 4  # output lengths past this many times §6.1's |x| + 50 for the longest line are named as the cause


def _output_length(args: argparse.Namespace) -> str | None:
    """The advice when the maximum output length floor(a |x| + b) is what is huge: the search holds
    room for all of its positions from the first step (``_Results``, the decoder's cache), for a
    batch of one sentence too, so a smaller --batch-tokens does not help. Huge: beyond
    ``LENGTH_FACTOR`` times §6.1's |x| + 50 for a line of --max-input-tokens tokens (settings in use,
    Marian's length factor 3 or parsing's + 300 (§6.3), stay under it). None otherwise."""
    from aiayn.decode.config import DecodeConfig
    a = DecodeConfig.max_len_a if args.max_len_a is None else args.max_len_a  # None: not given (the checkpoint's)
    b = DecodeConfig.max_len_b if args.max_len_b is None else args.max_len_b
    longest = int(a * args.max_input_tokens + b)
    if longest <= LENGTH_FACTOR * (args.max_input_tokens + 50):
        return None
    return (f"the maximum output length floor({a:g} x |x| + {b}) (--max-len-a, --max-len-b) allows {longest:,} tokens "
            f"for a line of {args.max_input_tokens} tokens (--max-input-tokens), and the search holds room for all of them "
            f"from its first step, whatever --batch-tokens is: lower --max-len-a or --max-len-b (the paper's: 1 and 50)")


def _batch_tokens(args: argparse.Namespace) -> str:
    length = _output_length(args)
    if length is not None:
        return length
    n = args.batch_tokens
    return f"lower --batch-tokens (now {n}): halve it, --batch-tokens {max(1, n // 2)}, and again if it still runs out"


def _train_sets(b: Batching) -> str:
    """Smaller batches, as many tokens a step: the run's batching ``b`` with half the tokens a batch
    and twice the batches a step."""
    return (f"halve train.max_src_tokens and train.max_tgt_tokens (now {b.max_src_tokens} and {b.max_tgt_tokens}) "
            f"and double train.accum_steps (now {b.accum_steps}) to keep the batch: "
            f"--set train.max_src_tokens={max(1, b.max_src_tokens // 2)} "
            f"--set train.max_tgt_tokens={max(1, b.max_tgt_tokens // 2)} --set train.accum_steps={2 * b.accum_steps}")


def _train(args: argparse.Namespace) -> str:
    from aiayn.commands.train import resolve_run_config
    from aiayn.train.config import batching
    return _train_sets(batching(resolve_run_config(args).train)) + "; the same command resumes from the last checkpoint"


def _demo(args: argparse.Namespace) -> str:
    from aiayn.config import apply_sets
    from aiayn.demo.stages import default_recipe
    from aiayn.train.config import batching, load_recipe
    recipe = args.recipe or default_recipe(args.quick)
    t = apply_sets(load_recipe(recipe), list(args.set or [])).train
    return _train_sets(batching(t)) + "; the same command resumes"


def _prepare(args: argparse.Namespace) -> str:
    return (f"halve --spm-sample-pairs (now {args.spm_sample_pairs}; SentencePiece trains on that many pairs "
            f"held in memory), e.g. --spm-sample-pairs {max(1, args.spm_sample_pairs // 2)}, and --chunk-lines "
            f"(now {args.chunk_lines}), e.g. --chunk-lines {max(1, args.chunk_lines // 2)}")


ADVICE: dict[str, Callable[[argparse.Namespace], str]] = {
    "translate": _batch_tokens, "evaluate": _batch_tokens, "train": _train, "demo": _demo, "prepare": _prepare,
}


def out_of_memory_message(exc: BaseException, args: argparse.Namespace) -> str:
    """"out of memory WHERE: what to lower and by how much"; for a command without a setting that
    bounds its memory, to free memory or use a larger machine."""
    advice = ADVICE.get(args.command)
    try:
        hint = advice(args) if advice is not None else None
    except Exception:  # the advice is never worth a second error
        hint = None
    hint = hint or "free memory (other processes, a smaller model) or use a machine with more"
    return f"out of memory {_where(exc)}: {hint}; --debug shows the traceback"
