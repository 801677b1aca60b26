"""Subword vocabulary: a SentencePiece model (§5.1: byte-pair encoding, a shared source-target
vocabulary of about 37,000 tokens for WMT14 En-De).

Special ids are fixed for every model this toolkit trains or loads, and match ``ModelConfig``:

    pad = 0   padding, never attended to and never predicted
    unk = 1   a piece outside the vocabulary (SentencePiece renders it as " ⁇ ")
    bos = 2   beginning of sentence, the decoder's first input
    eos = 3   end of sentence, appended to every source and target

``Tokenizer.encode`` adds neither bos nor eos (``aiayn.data.batching.collate`` does), and
``Tokenizer.decode`` drops pad/bos/eos. A model with other ids is refused on load. An <unk>
(a run of characters the model does not know) whose text is a piece the model holds but never
produces (UNUSED, or CONTROL beyond the four specials: an imported Marian model's pieces of its
vocabulary, ``aiayn.interop.marian_vocab``) is that piece, as transformers' MarianTokenizer looks it up;
a model that SentencePiece trained has no such pieces.
Text goes through SentencePiece's nmt_nfkc normalization, so ``decode(encode(line))`` is the
line NFKC-normalized with runs of whitespace collapsed (identical for ordinary text). A model
trained with ``lowercase=True`` instead carries a rule that maps every character to the
lowercase of its NFKC form (``lowercase_rules``): lowercasing is then part of the model, so a
checkpoint lowercases its input wherever it is used (translate, serve) with nothing else to
configure, and ``decode(encode(line))`` is ``line.lower()`` for ordinary text.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from aiayn.errors import UserError

log = logging.getLogger(__name__)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
WORD_BOUNDARY = "\u2581"  # "▁", SentencePiece's mark for the space before a word
SPECIAL_IDS = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}
_DROPPED_ON_DECODE = frozenset((PAD_ID, BOS_ID, EOS_ID))
LOWERCASE_NORMALIZER = "nfkc_lowercase"  # the normalizer name of a model trained with lowercase=True
MAX_MODEL_BYTES = 64 << 20  # a SentencePiece model of 1M pieces is about 20 MB; larger is refused unparsed


class Tokenizer:
    """A loaded SentencePiece model with the fixed special ids; picklable (DataLoader workers)."""

    def __init__(self, model_bytes: bytes, name: str = "<bytes>"):
        if len(model_bytes) > MAX_MODEL_BYTES:
            raise UserError(f"{name}: a tokenizer model of {len(model_bytes):,} bytes; the limit is "
                            f"{MAX_MODEL_BYTES:,} (MAX_MODEL_BYTES)")
        self._bytes = model_bytes
        self.name = name
        self.sha256 = hashlib.sha256(model_bytes).hexdigest()
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_bytes)
        except Exception as exc:  # sentencepiece raises bare RuntimeError/OSError
            raise UserError(f"{name}: not a SentencePiece model ({exc})") from exc
        found = {"pad": self._sp.pad_id(), "unk": self._sp.unk_id(),
                 "bos": self._sp.bos_id(), "eos": self._sp.eos_id()}
        if found != SPECIAL_IDS:
            raise UserError(f"{name}: special ids {found}, expected {SPECIAL_IDS}")
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(model_bytes)
        self._model_type = sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()
        self._lowercases = proto.normalizer_spec.name == LOWERCASE_NORMALIZER
        kind = sentencepiece_model_pb2.ModelProto.SentencePiece.Type
        self._user_symbols = frozenset(p.piece for p in proto.pieces if p.type == kind.USER_DEFINED)
        self._unproduced = {p.piece: i for i, p in enumerate(proto.pieces)
                            if p.type == kind.UNUSED or (p.type == kind.CONTROL and i not in SPECIAL_IDS.values())}

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_MODEL_BYTES + 1)  # past the limit: refused without reading the rest
        except OSError as exc:
            raise UserError(f"{path}: cannot read tokenizer model ({exc.strerror})") from exc
        return cls(data, name=str(path))

    def __getstate__(self) -> dict:
        return {"model_bytes": self._bytes, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_bytes"], state["name"])

    @property
    def model_bytes(self) -> bytes:
        """The serialized SentencePiece model (stored inside checkpoints)."""
        return self._bytes

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Subword ids of ``text``, without bos/eos."""
        return self._look_up_unknown(text, self._sp.encode(text, out_type=int))

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """``encode`` over many lines, using SentencePiece's own thread pool."""
        texts = list(texts)
        batch = self._sp.encode(texts, out_type=int, num_threads=num_threads)
        return [self._look_up_unknown(t, ids) for t, ids in zip(texts, batch)] if self._unproduced else batch

    def _look_up_unknown(self, text: str, ids: list[int]) -> list[int]:
        """``ids`` of ``text`` with each <unk> whose text is an unproduced piece of the model made
        that piece (module docstring); as they were when the model has none."""
        if not self._unproduced or UNK_ID not in ids:
            return ids
        pieces = self._sp.encode(text, out_type=str)  # the same segmentation: <unk>'s piece is its text
        return [self._unproduced.get(p, UNK_ID) if i == UNK_ID else i for i, p in zip(ids, pieces)]

    def encode_dropout(self, texts: Sequence[str], p: float, num_threads: int = 1) -> list[list[int]]:
        """Subword ids of each line segmented with BPE-dropout (Provilkov et al., 2020): each merge
        is skipped with probability ``p`` at every step of the BPE merge loop, so the result is
        a random segmentation of the same text, usually finer (``p`` = 0: ``encode``; 1:
        characters). SentencePiece's own thread pool. BPE models only (for a unigram model
        SentencePiece's ``alpha`` means something else). The draws come from SentencePiece's
        generator, which cannot be seeded reproducibly across processes (sentencepiece 0.2.3)."""
        if self._model_type != "bpe":
            raise UserError(f"{self.name}: BPE-dropout needs a BPE model, this one is {self._model_type}")
        if p <= 0.0:
            return self.encode_batch(texts, num_threads)
        return self._sp.encode(list(texts), out_type=int, enable_sampling=True, alpha=float(p), nbest_size=-1,
                               num_threads=num_threads)

    @property
    def model_type(self) -> str:
        """"bpe" or "unigram" (or another SentencePiece model type, lowercased)."""
        return self._model_type

    @property
    def lowercases(self) -> bool:
        """Whether the model lowercases its input (trained with ``lowercase=True``): its outputs
        are lowercase, so BLEU against cased references is scored case-insensitively."""
        return self._lowercases

    @property
    def user_symbols(self) -> frozenset[str]:
        """The pieces the model keeps whole (``PrepareConfig.user_symbols``), as spelled in it."""
        return self._user_symbols

    def encode_pieces(self, text: str) -> list[str]:
        return self._sp.encode(text, out_type=str)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (list, numpy array or 1-D tensor); pad, bos and eos are dropped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._sp.decode([int(i) for i in ids if int(i) not in _DROPPED_ON_DECODE])

    def piece(self, id: int) -> str:
        """The surface piece of one id (e.g. '▁Haus'), for attention-plot axes."""
        return self._sp.id_to_piece(int(id))


def joint_vocabulary(src: Tokenizer, tgt: Tokenizer) -> bool:
    """Whether two SentencePiece models number one vocabulary: the same piece at every id. One
    model for both sides is; so are an imported Marian model's two (``aiayn.interop.marian_vocab``),
    which segment each language its own way into one joint vocabulary."""
    if src.sha256 == tgt.sha256:
        return True
    return src.vocab_size == tgt.vocab_size and all(src.piece(i) == tgt.piece(i) for i in range(src.vocab_size))


def lowercase_rules() -> str:
    """SentencePiece normalization rules (TSV: source code point, tab, target code points, in
    hex) mapping each Basic Multilingual Plane character c to ``NFKC(c).lower()`` where that
    differs from c; as in nmt_nfkc, other whitespace (tab, no-break space, line separators)
    becomes a space and the remaining control characters are removed. Unlike SentencePiece's own
    ``nmt_nfkc_cf`` (Unicode case folding) this keeps German ß (folding writes "ss", which
    lowercased references do not). Each character's canonical decomposition (NFD: a letter and
    its combining marks, ``u`` + U+0308) maps to the same target, so the same text written in NFC
    or in NFD is one token sequence, as under nmt_nfkc; other combining sequences (marks in
    another order, or on a letter with no precomposed form) are not composed, as NFKC would."""
    rows: dict[str, str] = {}
    for cp in range(1, 0x10000):  # NUL cannot be a rule's key
        if 0xD800 <= cp <= 0xDFFF:  # surrogates are not characters
            continue
        c = chr(cp)
        if c.isspace():
            target = " "
        elif unicodedata.category(c) == "Cc":
            target = ""
        else:
            target = unicodedata.normalize("NFKC", c).lower()
        if target != c:
            rows[c] = target
        decomposed = unicodedata.normalize("NFD", c)
        if len(decomposed) > 1 and decomposed != target:  # the same text written decomposed (NFD)
            rows.setdefault(decomposed, target)
    return "".join(f"{_hex(key)}\t{_hex(target)}\n" for key, target in rows.items())


def _hex(text: str) -> str:
    """Code points as a SentencePiece rule writes them: hex, space-separated."""
    return " ".join(f"{ord(c):X}" for c in text)


@dataclass(frozen=True)
class SentencePieceSpec:
    """What a SentencePiece model is trained to be (§5.1: a shared byte-pair vocabulary): the
    options the model file records and that decide its pieces. The thread count is not one of
    them (``train_sentencepiece`` resets it), so it stays outside."""
    vocab_size: int
    model_type: str
    character_coverage: float
    user_symbols: Sequence[str] = ()
    lowercase: bool = False


SPM_MAX_SENTENCE_BYTES = 4192  # SentencePiece's max_sentence_length: longer lines it skips without a word


def _training_refused(message: str, spec: SentencePieceSpec, path: Path) -> str:
    """SentencePiece's refusal in aiayn's words: which model (``path``: spm.model shared, spm.src.model,
    spm.tgt.model) and the option to change, for the two a small corpus meets; else its own message."""
    side = {"spm.src.model": "the source", "spm.tgt.model": "the target"}.get(path.name, "the shared")
    too_many = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", message)
    if too_many:
        return (f"--vocab-size {spec.vocab_size}: more pieces than the training text gives {side} vocabulary "
                f"(at most {too_many[1]}); lower --vocab-size")
    too_few = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
    if too_few:
        return (f"--vocab-size {spec.vocab_size}: fewer pieces than {side} vocabulary's characters and special ids "
                f"({too_few[1]}); raise --vocab-size or lower --character-coverage")
    return f"SentencePiece training failed ({side} vocabulary): {message}"


def train_sentencepiece(sentences: Iterable[str], path: Path, spec: SentencePieceSpec, *, num_threads: int) -> Path:
    """Train a SentencePiece model as ``spec`` says on ``sentences`` (already sampled) and write it
    to ``path``.

    Every sentence is learnt from, however long (SentencePiece skips lines over 4,192 bytes unless
    told otherwise, so the characters of a long line would become ``<unk>`` despite a character
    coverage of 1.0): for such a sample its ``max_sentence_length`` is the longest line's.

    The file depends only on the sentences and ``spec``: the thread count, which
    SentencePiece records in the model, is reset to 1, so the sha256 is reproducible.

    ``spec.user_symbols`` are space-separated words to keep as one piece each (e.g. ``(NP``). They
    become SentencePiece ``user_defined_symbols`` with the word-boundary mark in front (``▁(NP``:
    a bare ``(NP`` would still cost two pieces, ``▁`` + ``(NP``), in the order given, right after
    the special ids. Their characters become ``required_chars``: SentencePiece never sees the
    text a user symbol covers, so without them a word that only resembles one (``(WHADJP`` when
    ``(WHADJP`` is not a symbol) would lose ``(`` to <unk> instead of being spelled out.

    ``spec.lowercase`` builds ``lowercase_rules`` into the model in place of nmt_nfkc.
    """
    symbols: dict[str, object] = {}
    rules = None
    if spec.lowercase:
        rules = tempfile.NamedTemporaryFile("w", suffix=".tsv", encoding="utf-8", delete=False)
        rules.write(lowercase_rules())
        rules.close()
        symbols["normalization_rule_tsv"] = rules.name
    if spec.user_symbols:
        symbols |= {"user_defined_symbols": [WORD_BOUNDARY + s for s in spec.user_symbols],
                    "required_chars": "".join(sorted(set("".join(spec.user_symbols))))}
    sentences = list(sentences)
    longest = max((len(s.encode("utf-8")) for s in sentences if 4 * len(s) > SPM_MAX_SENTENCE_BYTES), default=0)
    if longest > SPM_MAX_SENTENCE_BYTES:  # SentencePiece would leave such lines out, and their characters with them
        symbols["max_sentence_length"] = longest
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=buf,
            vocab_size=spec.vocab_size, model_type=spec.model_type,
            character_coverage=spec.character_coverage, num_threads=max(1, num_threads),
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>",
            input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2, **symbols,
        )
    except RuntimeError as exc:
        raise UserError(_training_refused(str(exc), spec, path)) from exc
    finally:
        if rules is not None:
            os.unlink(rules.name)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(buf.getvalue())
    proto.trainer_spec.num_threads = 1
    if spec.lowercase:  # the rules are compiled into precompiled_charsmap; the temporary file's name is noise
        proto.normalizer_spec.ClearField("normalization_rule_tsv")
        proto.normalizer_spec.name = LOWERCASE_NORMALIZER
    path.write_bytes(proto.SerializeToString())
    return path
