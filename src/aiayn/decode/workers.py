"""Decoding in several CPU processes at once (``DecodeConfig.workers``).

A beam-search step of a small model is many small operations, and one process uses a second CPU
thread poorly: two one-thread processes decode faster than one two-thread process (BENCHMARKS.md §3,
"What each decoding choice is worth": 2 workers). So, as CTranslate2's ``inter_threads``,
``workers = N`` starts N processes, each with its own copy of the model(s) and ``threads // N`` of
the CPU threads, and hands them the
length-sorted batches of ``Translator.batches`` one at a time (each worker takes the next batch when
it is done, so long and short batches balance). When there are fewer batches than workers, the
largest batches are halved until each worker has one (a sentence's translation does not depend on
its batch: tests/decode/test_translator.py). The results come back in input order.

The workers are started (``spawn``) the first time they are needed and live as long as the
``Translator`` (``Translator.close()`` stops them). They receive the checkpoint's weights and
tokenizers once, in a temporary file, and set the process settings of the ``aiayn`` command (denormals, huge
pages, allocator) before they create a tensor. On Linux the file's name is removed as soon as it is
written: the workers open it through this process's descriptor (``/proc/PID/fd/N``), and the kernel
frees it when that descriptor closes, at close or however this process ends (a ``kill`` or an
out-of-memory kill leaves no copy of the weights in the temporary folder); elsewhere the named file
is removed at close or at exit. On Linux they end with the thread that started them
(``PR_SET_PDEATHSIG``), so a killed ``aiayn translate`` leaves no orphans; start them from a thread
that outlives the Translator (the main thread, as the CLI does). Sampling (``DecodeConfig.sampling``)
seeds each batch's generator with ``DecodeConfig.seed``, so sampled outputs also depend on how the
batches were shared.
CPU only: on a GPU, one process with large batches is the fast way.
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import tempfile
import weakref
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from typing import Callable, Iterator, Sequence

from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import Hypothesis
from aiayn.host.allocator import HeapGrowth

_WORKER = None  # the worker process's Translator
TRIM_EVERY_BATCHES = 10  # a worker's batches between two looks at its heap
_HEAP = HeapGrowth(TRIM_EVERY_BATCHES)  # the worker process's heap, looked at after each batch


def _init_worker(translator_class: type, payload: str, cfg: DecodeConfig, threads: int, parent_pid: int) -> None:
    """In each worker: the aiayn command's process settings first, then its thread count, then the model(s)
    of the file ``payload`` (``DecodePool``) in a ``translator_class`` (``Translator``, given by its
    caller: this module does not import it)."""
    global _WORKER
    from aiayn.host.process import configure_process, die_with_parent

    die_with_parent(parent_pid)

    configure_process()  # before the first tensor and PyTorch's thread pool
    import torch

    from aiayn.config import from_dict
    from aiayn.data.vocab import Tokenizer
    from aiayn.model import ModelConfig, Transformer

    torch.set_num_threads(threads)
    saved = torch.load(payload, map_location="cpu", weights_only=True)
    built = []
    for model_cfg, state in saved["models"]:
        model = Transformer(from_dict(ModelConfig, model_cfg))
        model.load_state_dict(state)
        built.append(model.eval())
    _WORKER = translator_class(built, *(Tokenizer(b, name) for b, name in saved["tokenizers"]), cfg=cfg)


def _translate(rows: list[list[int]], cfg: DecodeConfig) -> list[list[Hypothesis]]:
    _WORKER.cfg = cfg  # the caller's settings of this call (beam, α, ...); the precision is the pool's
    hyps = _WORKER.translate_ids(rows)
    _HEAP.look()  # the heap's holes back while it grows, as training does (aiayn/host/allocator.py)
    return hyps


def spread(batches: list[list[int]], lengths: Sequence[int], workers: int) -> list[list[int]]:
    """Halve the batch with the most padded source tokens until there are ``workers`` batches (or every
    batch is one sentence). Batches keep their longest-first order; the result is longest first too."""
    out = [list(b) for b in batches]
    while len(out) < workers:
        size = [len(b) * lengths[b[0]] for b in out]  # B * S of each batch (its first sentence is its longest)
        splittable = [i for i, b in enumerate(out) if len(b) > 1]
        if not splittable:
            break
        k = max(splittable, key=size.__getitem__)
        half = (len(out[k]) + 1) // 2
        out[k: k + 1] = [out[k][:half], out[k][half:]]
    return out


class DecodePool:
    """``workers`` processes, each with a Translator of the given (float) models on ``threads // workers``
    threads; ``map`` translates batches of source ids in them and returns their hypotheses in order."""

    def __init__(self, translator_class: type, models: Sequence, src_tok, tgt_tok, cfg: DecodeConfig, threads: int):
        """Each worker builds a ``translator_class`` (``Translator``) of the models. ``cfg.precision`` is
        fixed here (each worker makes its decoding copy once); the other settings come with each ``map`` call."""
        import torch

        from aiayn.decode.int8 import Int8Linear
        from aiayn.decode.packed import PackedLinear
        from aiayn.errors import UserError
        from aiayn.host.process import check_settings

        check_settings()  # each worker applies them: a bad value is refused here, not in each worker
        if any(isinstance(m, (Int8Linear, PackedLinear)) for model in models for m in model.modules()):
            raise UserError("decoding workers load the float model and make their own decoding copy (int8 or "
                            "packed): give the Translator the float model with its precision, not such a copy")
        # The weights and tokenizers go to the workers in a file, not through the pipe that starts each one:
        # a worker that dies starting (a script without the __main__ guard) would leave that pipe full and
        # its writer, this process, waiting forever; with a small start message the pool says it broke.
        fd, path = tempfile.mkstemp(prefix="aiayn-workers-", suffix=".pt")
        with os.fdopen(fd, "wb") as f:
            torch.save({"models": [(asdict(m.cfg), {k: v.detach().cpu() for k, v in m.state_dict().items()})
                                   for m in models],
                        "tokenizers": [(t.model_bytes, t.name) for t in (src_tok, tgt_tok)]}, f)
        path, release = _unnamed(path)
        self._payload = weakref.finalize(self, release)  # at close, or when the pool is collected
        self.workers = cfg.workers
        self.threads = max(1, threads // cfg.workers)
        self._pool = ProcessPoolExecutor(
            max_workers=cfg.workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
            initargs=(translator_class, path, replace(cfg, workers=1), self.threads, os.getpid()))

    def map(self, batches: list[list[list[int]]], cfg: DecodeConfig) -> Iterator[list[list[Hypothesis]]]:
        """Each batch (rows of source ids + EOS) -> its rows' hypotheses under ``cfg``, in the order
        given, each as soon as it and those before it are done (all are sent to the workers at once)."""
        one = replace(cfg, workers=1)
        results = self._pool.map(_translate, batches, [one] * len(batches))
        return _unbroken(results)

    def pids(self) -> list[int]:
        """The worker processes' ids (those started so far)."""
        return [p.pid for p in self._pool._processes.values()]  # concurrent.futures keeps them there

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._payload()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unnamed(path: str) -> tuple[str, Callable[[], None]]:
    """(the name the workers open the file ``path`` by, what releases it): where this process can open
    its own descriptors by /proc (Linux), ``path`` opened, its name removed, and the descriptor's
    /proc name, released by closing the descriptor; else ``path`` itself, released by removing it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return path, functools.partial(_remove, path)
    via = f"/proc/{os.getpid()}/fd/{fd}"
    try:
        held, seen = os.fstat(fd), os.stat(via)  # (a /proc of another process tree would name another file)
        usable = (held.st_dev, held.st_ino) == (seen.st_dev, seen.st_ino)
        os.close(os.open(via, os.O_RDONLY))
    except OSError:
        usable = False
    if not usable:
        os.close(fd)
        return path, functools.partial(_remove, path)
    os.unlink(path)
    return via, functools.partial(os.close, fd)


def _unbroken(results: Iterator) -> Iterator:
    """``results`` of the pool; a worker that died (at its start, or killed) is a UserError saying so."""
    from concurrent.futures.process import BrokenProcessPool

    from aiayn.errors import UserError
    try:
        yield from results
    except BrokenProcessPool:
        raise UserError("a decoding worker process ended before its work was done; a script that decodes "
                        "with workers must start them under `if __name__ == \"__main__\":` (they are "
                        "spawned and import the script: docs/decoding.md)") from None
