"""``Translator``: a checkpoint turned into translations of text lines (§6.1).

    Translator.from_checkpoint("best.pt").translate(["Ein Haus.", ""])  # -> ["A house.", ""]

The checkpoint, the decoding copy of its model for a precision and the C kernels come from
``aiayn.decode.loading``.

Source lines become ``ids + [EOS]``, exactly as in training (``aiayn.data.batching.collate``).
Lines are sorted by length into batches of at most ``batch_tokens`` padded source tokens,
decoded, and returned in input order. Documented choices:
- an empty line (or one with no subword tokens) is translated to an empty line;
- a line longer than ``max_input_tokens`` (EOS included), or than ``max_positions`` for a model
  with learned positions, is an ``InputError`` naming its line number, or with ``long_lines``
  truncate / skip its first tokens or an empty line, with a warning naming it: nothing is
  truncated silently. Outputs are also capped at ``max_positions`` with learned positions.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from aiayn.config import replace
from aiayn.data.vocab import Tokenizer
from aiayn.decode.adapter import CachedDecoder, EnsembleDecoder
from aiayn.decode.graphs import GraphDecoder, replays_graphs
from aiayn.decode.config import DecodeConfig
from aiayn.decode.loading import (decoding_kernels, load_models_for_inference, model_for_precision,
                                  require_precision, stored_settings)
from aiayn.decode.search import Constraints, Hypothesis, SpecialIds, Stop, Stopped, search
from aiayn.decode.workers import DecodePool, spread
from aiayn.errors import InputError, UserError
from aiayn.kernels.loader import Kernels
from aiayn.model import Transformer

log = logging.getLogger(__name__)


class LongLineError(InputError):
    """A source line longer than the translator takes: ``tokens`` (EOS included) over ``limit``."""

    def __init__(self, path, line: int, message: str, tokens: int, limit: int):
        super().__init__(path, line, message)
        self.tokens, self.limit = tokens, limit


def _check_lines(lines, what: str) -> list[str]:
    """``lines`` as a list, each a str, or bytes of UTF-8 (as SentencePiece reads them; other bytes
    would become <unk> pieces, where ``aiayn translate`` names the line). A str is a sequence of
    characters: given for a list of lines, each character would be translated as a sentence of its own."""
    if isinstance(lines, (str, bytes)):
        raise UserError(f"{what}: a list of lines, not one string (translate([text]) for one sentence)")
    try:
        lines = list(lines)
    except TypeError:
        raise UserError(f"{what}: a list of lines (str), got {type(lines).__name__}") from None
    for n, line in enumerate(lines):
        if not isinstance(line, (str, bytes)):
            raise UserError(f"{what}[{n}]: a line of text (str), got {type(line).__name__}")
        if isinstance(line, bytes):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(f"{what}[{n}]: not UTF-8 (byte {exc.start}: {line[exc.start:exc.start + 1]!r}); "
                                "give str, or bytes of UTF-8") from None
    return lines


@dataclass(frozen=True)
class Translation:
    text: str  # detokenized
    tokens: tuple[int, ...]  # target ids, EOS excluded
    score: float  # sum log p / lp(|Y|)
    log_prob: float
    eos: bool  # False when the maximum output length stopped it


class Translator:
    """Model(s) + tokenizers + DecodeConfig: text lines in, translations out, in input order.

    Given several models (an ensemble: ``aiayn translate --checkpoint a.pt b.pt``, or an ensemble
    file), each step's next-token distribution is the mean of theirs (``EnsembleDecoder``). They
    must share the tokenizers and the special ids. ``model`` is the first of them; attention
    plots show its attention. ``decoder``: a step decoder of these models to decode with, kept by the
    caller across Translators (a serving thread's, whose CUDA graphs are captured once); None: made
    when first needed (``Translator.decoder``).

    The caller's models decode in eval mode (no dropout, §5.4) and are given back in the mode each
    of their modules had: a model in training stays in training. A Translator decodes the weights
    as they are when it first decodes: the packed (fp32 on the CPU), bfloat16 and int8 copies are
    made then, and do not follow later changes (a training step); make a new Translator after them.
    """

    def __init__(self, model: Transformer | Sequence[Transformer], src_tok: Tokenizer, tgt_tok: Tokenizer,
                 cfg: DecodeConfig = DecodeConfig(), decoder=None):
        if not isinstance(cfg, DecodeConfig):
            raise UserError(f"cfg: a DecodeConfig (aiayn.decode.config), got {type(cfg).__name__}; "
                            "e.g. DecodeConfig(beam_size=5, alpha=0.6)")
        given = [model] if isinstance(model, Transformer) else list(model)
        if not given:
            raise UserError("a Translator needs at least one model")
        self._given = given  # the caller's models: the decoding copies below and the workers are made from them
        self.src_tok, self.tgt_tok, self.cfg = src_tok, tgt_tok, cfg
        m = given[0].cfg
        self.ids = SpecialIds(pad=m.pad_id, bos=m.bos_id, eos=m.eos_id)
        for other in given[1:]:
            o = other.cfg
            if (o.pad_id, o.bos_id, o.eos_id, o.target_vocab_size) != (m.pad_id, m.bos_id, m.eos_id, m.target_vocab_size):
                raise UserError("the models of an ensemble must share the target vocabulary and its special ids "
                                f"(pad/bos/eos/size {m.pad_id}/{m.bos_id}/{m.eos_id}/{m.target_vocab_size} against "
                                f"{o.pad_id}/{o.bos_id}/{o.eos_id}/{o.target_vocab_size})")
        limits = [min(cfg.max_input_tokens, g.cfg.max_positions) if g.cfg.learned_positions else cfg.max_input_tokens
                  for g in given]
        self.input_limit = min(limits)
        caps = [g.cfg.max_positions for g in given if g.cfg.learned_positions]
        self.output_cap = min(caps) if caps else None
        require_precision(cfg, given[0])  # at once, not at the first batch (nor in each worker)
        self._pool: DecodePool | None = None
        if decoder is not None:  # one kept by the caller (a serving thread's: its CUDA graphs captured once)
            self.decoder = decoder
        if cfg.workers > 1:
            self._check_workers_device()

    @classmethod
    def from_checkpoint(cls, path: str | Path | Sequence[str | Path], cfg: DecodeConfig | None = None,
                        device: str | torch.device = "cpu") -> "Translator":
        """A checkpoint, an ensemble file, or a list of them (an ensemble of all their models). ``cfg``
        None: ``DecodeConfig()`` with the settings one checkpoint carries (its ``decode`` entry: the α
        the demo chose, an imported model's generation settings), as ``aiayn translate`` decodes it."""
        if cfg is None:
            paths = [path] if isinstance(path, (str, Path)) else list(path)
            cfg = replace(DecodeConfig(), **stored_settings([str(p) for p in paths]))
        return cls(*load_models_for_inference(path, device), cfg=cfg)

    @functools.cached_property
    def models(self) -> list[Transformer]:
        """The decoding copies (``model_for_precision``), made when first needed: with workers they
        are only needed for attention plots, so a Translator that only translates does not hold them.
        A given model decoded as it is (fp32 without packed weights) is not a copy: it is in eval mode
        only while it decodes (``_evaluating``)."""
        out = []
        for m in self._given:
            x = model_for_precision(m, self.cfg.precision, self.kernels, self.cfg.packed_weights,
                                    self.cfg.packed_library, self.cfg.cpu_row_bits)
            out.append(x if x is m else x.eval())
        return out

    @contextlib.contextmanager
    def _evaluating(self):
        """The caller's models in eval mode (no dropout: §5.4 is training's) while they decode, each
        module given back the mode it had (a fine-tuning loop's model stays in training)."""
        modes = [(m, m.training) for g in self._given for m in g.modules()]
        for g in self._given:
            g.eval()
        try:
            yield
        finally:
            for m, mode in modes:
                m.training = mode

    @property
    def model(self) -> Transformer:
        return self.models[0]

    @functools.cached_property
    def kernels(self) -> Kernels | None:
        """The C kernels the decoding copies and the decoder use (``decoding_kernels``), looked up once."""
        return decoding_kernels(self.cfg, self._given[0])

    @functools.cached_property
    def decoder(self) -> CachedDecoder | GraphDecoder | EnsembleDecoder:
        """The models' step decoders: with ``cuda_graphs`` on a GPU, steps over fixed buffers replayed as
        CUDA graphs (``aiayn.decode.graphs``), else the cache's (with the C kernels on the CPU)."""
        if self.cfg.cuda_graphs and replays_graphs(self.device):
            decoders = [GraphDecoder(x) for x in self.models]
        else:
            decoders = [CachedDecoder(x, kernels=self.kernels) for x in self.models]
        return decoders[0] if len(decoders) == 1 else EnsembleDecoder(decoders)

    @property
    def device(self) -> torch.device:
        return next(self._given[0].parameters()).device

    def encode(self, lines: Sequence[str], source: str = "<input>", first_line: int = 1) -> list[list[int]]:
        """Source ids + [EOS] per line ([] for an empty line); a too long line as ``cfg.long_lines``
        says (``_long_line``)."""
        lines = _check_lines(lines, "lines")
        out = []
        for n, ids in enumerate(self.src_tok.encode_batch([line.strip() for line in lines]), first_line):
            if ids and len(ids) + 1 > self.input_limit:
                ids = self._long_line(ids, source, n)
            out.append(ids + [self.ids.eos] if ids else [])
        return out

    def _long_line(self, ids: list[int], source: str, n: int) -> list[int]:
        """Line ``n``'s ids when they exceed ``input_limit``: an InputError (long_lines error), the
        first input_limit - 1 of them (truncate) or none, an empty line (skip), with a warning."""
        what = (f"{len(ids) + 1} source tokens (EOS included) exceed the limit of {self.input_limit} "
                f"(max_input_tokens, or the model's max_positions with learned positions)")
        if self.cfg.long_lines == "error":
            raise LongLineError(source, n, f"{what}; split the line, or give --long-lines truncate or skip",
                                len(ids) + 1, self.input_limit)
        keep = self.input_limit - 1 if self.cfg.long_lines == "truncate" else 0
        log.warning("%s:%d: %s; %s", source, n, what,
                    f"translated its first {keep} tokens" if keep else "skipped (an empty line out)")
        return ids[:keep]

    def batches(self, ids: list[list[int]]) -> list[list[int]]:
        """Indices of non-empty lines, longest first, cut so that B * S <= batch_tokens."""
        order = sorted((i for i, x in enumerate(ids) if x), key=lambda i: -len(ids[i]))
        out: list[list[int]] = []
        for i in order:
            if out and len(out[-1]) + 1 <= self.cfg.batch_tokens // len(ids[out[-1][0]]):
                out[-1].append(i)
            else:
                out.append([i])
        return out

    def _pad(self, rows: list[list[int]]) -> torch.Tensor:
        src = torch.full((len(rows), max(map(len, rows))), self.ids.pad, dtype=torch.long)
        for b, r in enumerate(rows):
            src[b, : len(r)] = torch.tensor(r)
        return src.to(self.device)

    def _prefix(self, prefixes: Sequence[Sequence[int]] | None, batch: list[int]) -> torch.Tensor | None:
        """The forced target prefixes of a batch's lines (B, P), -1 after each; None when it has none."""
        rows = [list(prefixes[i]) for i in batch] if prefixes is not None else []
        if not any(rows):
            return None
        out = torch.full((len(rows), max(map(len, rows))), -1, dtype=torch.long)
        for b, r in enumerate(rows):
            out[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        return out

    def translate_ids(self, ids: list[list[int]], prefixes: Sequence[Sequence[int]] | None = None,
                      progress: Callable[[int], object] | None = None,
                      stop: Stop | None = None) -> list[list[Hypothesis]]:
        """Hypotheses (n-best, best first) per line of source ids; [] for an empty line. With
        ``cfg.mbr`` the search keeps beam_size hypotheses and "best" is the MBR order (decode/mbr.py).
        ``prefixes``: target ids each line's translations must begin with ([] for none; the search's
        ``prefix``); lines with prefixes are decoded in this process, not by the workers.
        ``progress(n)``: told of every n lines done (a progress bar's ``update``). ``stop()``: asked
        before every decoding step (with worker processes, once before they start); True raises
        ``Stopped`` (decode/search.py)."""
        out: list[list[Hypothesis]] = [[] for _ in ids]
        t0, n_out = time.perf_counter(), 0
        mbr = self.cfg.mbr  # the search (here or in the workers) keeps the beam; the choice is made here
        cfg = dataclasses.replace(self.cfg, nbest=self.cfg.beam_size, mbr=False) if mbr else self.cfg
        batches = self.batches(ids)
        if prefixes is not None and len(prefixes) != len(ids):
            raise UserError(f"{len(prefixes)} prefixes for {len(ids)} lines")
        with self._evaluating():  # the searches run as the results are read, below
            if cfg.workers > 1 and batches and not (prefixes is not None and any(prefixes)):
                batches = spread(batches, [len(x) for x in ids], cfg.workers)
                if stop is not None and stop():
                    raise Stopped("translation stopped by its caller before its first batch")
                results = self._workers().map([[ids[i] for i in batch] for batch in batches], cfg)
            else:
                gen = torch.Generator(device=self.device).manual_seed(cfg.seed) if cfg.sampling else None
                results = (search(self.decoder, self._pad([ids[i] for i in batch]), cfg, self.ids,
                                  Constraints(self.output_cap, self._prefix(prefixes, batch)), gen, stop)
                           for batch in batches)
            if progress is not None:
                progress(sum(1 for x in ids if not x))  # empty lines: done already
            for batch, hyps in zip(batches, results):
                for i, hs in zip(batch, hyps):
                    out[i] = self._mbr(hs) if mbr and hs else hs
                    n_out += len(out[i][0].tokens) if hs else 0
                if progress is not None:
                    progress(len(batch))
        dt = time.perf_counter() - t0
        log.debug("%d lines, %d output tokens in %.2fs (%.0f tokens/s)", len(ids), n_out, dt, n_out / max(dt, 1e-9))
        return out

    def _mbr(self, hyps: list[Hypothesis]) -> list[Hypothesis]:
        """The beam's hypotheses in minimum-Bayes-risk order, the first cfg.nbest of them."""
        from aiayn.decode.mbr import mbr_order  # sacreBLEU's tokenizer: imported only when asked for

        if self.tgt_tok is None:
            raise UserError("mbr compares detokenized hypotheses: the Translator needs its target tokenizer")
        order = mbr_order([self.tgt_tok.decode(h.tokens) for h in hyps], [h.log_prob for h in hyps])
        return [hyps[j] for j in order[: self.cfg.nbest]]

    def _check_workers_device(self) -> None:
        if self.device.type != "cpu":
            raise UserError(f"workers = {self.cfg.workers} decodes in several CPU processes; on {self.device} "
                            "use workers = 1")

    def _workers(self) -> DecodePool:
        if self._pool is None:
            self._check_workers_device()
            self._pool = DecodePool(Translator, self._given, self.src_tok, self.tgt_tok, self.cfg,
                                    torch.get_num_threads())
        return self._pool

    def close(self) -> None:
        """Stop the decoding workers, if any (they are started again when needed)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "Translator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode_prefixes(self, prefixes: Sequence[str] | None, source: str = "<prefixes>",
                        first_line: int = 1) -> list[list[int]] | None:
        """Target ids of forced prefixes (target text, "" for none), for ``translate_ids``. A prefix
        that leaves no room for EOS within a learned-positions model's ``max_positions`` (``output_cap``)
        is an ``InputError`` naming ``source`` and its line (counted from ``first_line``): the search
        would cut it."""
        if prefixes is None:
            return None
        ids = self.tgt_tok.encode_batch([p.strip() for p in _check_lines(prefixes, "prefixes")])
        for k, p in enumerate(ids):
            if self.output_cap is not None and len(p) >= self.output_cap:
                raise InputError(source, first_line + k, f"the prefix has {len(p)} target tokens; the model's learned "
                                                         f"positions (max_positions {self.output_cap}) leave room "
                                                         f"for {self.output_cap - 1} and EOS")
        return ids

    def translate_nbest(self, lines: Sequence[str], source: str = "<input>", first_line: int = 1,
                        prefixes: Sequence[str] | None = None,
                        progress: Callable[[int], object] | None = None) -> list[list[Translation]]:
        """``prefixes``: one target text per line that its translations must begin with ("" for none);
        ``progress``: as ``translate_ids``'s."""
        hyps = self.translate_ids(self.encode(lines, source, first_line),
                                  self.encode_prefixes(prefixes, source, first_line), progress)
        return [[Translation(self.tgt_tok.decode(h.tokens), h.tokens, h.score, h.log_prob, h.eos) for h in hs]
                for hs in hyps]

    def translate(self, lines: Sequence[str], source: str = "<input>", first_line: int = 1,
                  prefixes: Sequence[str] | None = None, progress: Callable[[int], object] | None = None) -> list[str]:
        """Best translation of each line, detokenized, in input order ("" for an empty line)."""
        return [ts[0].text if ts else "" for ts in self.translate_nbest(lines, source, first_line, prefixes, progress)]

    @torch.inference_mode()
    def attention(self, src_ids: list[int], tokens: Sequence[int], eos: bool) -> dict[str, object]:
        """Attention weights of one output (tokens without EOS; ``eos``: it ended with EOS),
        recomputed teacher-forced (the same math as the search).

        Returns source/target pieces and float32 arrays: ``encoder`` (L, H, S, S), ``decoder_self``
        (L, H, T, T) and ``cross`` (L, H, T, S); target rows are the predicted tokens
        (``tgt_tokens``, EOS last when generated), source columns include the EOS. The columns of
        ``decoder_self`` are the decoder's inputs (``tgt_in_tokens``: BOS, then the output shifted
        right by one, §3.1): position t attends to the tokens before the one it predicts, so
        labelling those columns with ``tgt_tokens`` would show each prediction attending to itself.
        """
        out_ids = list(tokens) + ([self.ids.eos] if eos else [])
        src = torch.tensor([list(src_ids)], dtype=torch.long, device=self.device)
        tgt_in = torch.tensor([[self.ids.bos] + out_ids[:-1]], dtype=torch.long, device=self.device)
        with self._evaluating():
            enc = self.model.encode(src, need_weights=True)
            dec = self.model.decode(tgt_in, enc, need_weights=True)
        stack = lambda ws: np.stack([w[0].float().cpu().numpy() for w in ws])  # noqa: E731
        return {"src_tokens": [self.src_tok.piece(i) for i in src_ids],
                "tgt_tokens": [self.tgt_tok.piece(i) for i in out_ids],
                "tgt_in_tokens": [self.tgt_tok.piece(i) for i in tgt_in[0].tolist()],
                "encoder": stack(enc.weights), "decoder_self": stack(dec.self_weights),
                "cross": stack(dec.cross_weights)}
