"""A Marian vocabulary as aiayn's: ids in aiayn's order, SentencePiece models that produce them.

Marian (and transformers' ``MarianTokenizer``) segments text with a SentencePiece model per side
(``source.spm``, ``target.spm``) and numbers the pieces by a vocabulary of its own (``vocab.json``,
usually one joint vocabulary for both sides; ``target_vocab.json`` when they are separate): in
OPUS-MT's models </s> 0, <unk> 1, ..., <pad> last, and the decoder starts from <pad>. A piece the
vocabulary lacks becomes <unk>; a source line may begin with a target-language token (``>>fra<<``),
which is looked up whole.

aiayn's ``Tokenizer`` takes one SentencePiece model whose own ids are the model's, with pad 0,
unk 1, bos 2, eos 3 (``aiayn.data.vocab``). The mapping (``id_order``):

    aiayn id   0     1     2                 3     4, 5, ...
    Marian id  pad   unk   decoder start     eos   the other ids, in increasing order

The embedding rows (and the output projection's rows and bias) are gathered in that order
(``aiayn.interop.hf_import``); where the decoder starts from <pad> its row serves twice (ids 0 and 2,
neither of which a search generates, as transformers' ``bad_words_ids`` bans <pad>), so aiayn's
vocabulary is one larger. Each side's SentencePiece model is rewritten (``segmenter``) so that
its piece i is the vocabulary's piece of aiayn id i, each keeping its type and score:
- a piece of the vocabulary that this side's model lacks (the other side's pieces, in a joint
  vocabulary) becomes UNUSED in a unigram model (never produced by encoding, which leaves the
  segmentation unchanged, and decoded as its text, as transformers does) and CONTROL in a BPE
  model (where UNUSED pieces would still take part in the merges: decoded as nothing);
- characters this side's model does not know: SentencePiece segments a run of them as one <unk>
  whose surface is the run, which ``MarianTokenizer`` then looks up in the vocabulary (<unk>
  unless the vocabulary has the run as a piece). With ``unknown_runs`` "marian" (the source side
  by default) the model is left so, and aiayn's ``Tokenizer`` looks the run up among the pieces
  the model does not produce (``Tokenizer.encode``): the same ids. With "chars" (the target side,
  whose decoding then writes such characters) each single character the vocabulary has becomes
  a normal piece, so a run is one piece per character;
- a piece of the model the vocabulary lacks is left out: where transformers writes <unk> for it,
  aiayn's model segments the text with the pieces it has (a unigram model's best path without it;
  a BPE model without that merge); ``Segmenter.dropped`` counts them;
- a target-language token becomes the user-defined piece "▁>>fra<<" (aiayn's spelling of a tag,
  ``PrepareConfig.user_symbols``): SentencePiece then reads ">>fra<< text" as the token and the
  text's pieces, as ``MarianTokenizer`` does when the token opens the line followed by a space.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from sentencepiece import sentencepiece_model_pb2

from aiayn.data.vocab import WORD_BOUNDARY, Tokenizer
from aiayn.errors import UserError

Piece = sentencepiece_model_pb2.ModelProto.SentencePiece
LANGUAGE_TOKEN = re.compile(r">>.+<<")  # MarianTokenizer's target-language tokens, e.g. >>fra<<
_PRODUCED = (Piece.NORMAL, Piece.USER_DEFINED, Piece.BYTE)  # the types encoding can output
_KEPT = (*_PRODUCED, Piece.UNUSED)
UNKNOWN_RUNS = ("marian", "chars")  # segmenter's unknown_runs (module docstring)


@dataclass(frozen=True)
class Specials:
    """A Marian vocabulary's special ids: pad, unk, the decoder's first input, eos."""
    pad: int
    unk: int
    start: int
    eos: int


def id_order(vocab: dict[str, int], specials: Specials, size: int, name: str) -> list[int]:
    """The Marian id of each aiayn id (module docstring): pad, unk, start, eos, then the rest in
    increasing order. ``vocab`` (piece -> id) must number 0..size-1 once each (``size``: the
    embedding's rows)."""
    ids = sorted(vocab.values())
    if ids != list(range(size)):
        raise UserError(f"{name}: its {len(vocab)} entries do not number the embedding's {size} rows 0..{size - 1} "
                        f"once each")
    s = specials
    if not all(type(i) is int and 0 <= i < size for i in (s.pad, s.unk, s.start, s.eos)):
        raise UserError(f"{name}: pad {s.pad}, unk {s.unk}, decoder start {s.start} and eos {s.eos} must be ids of "
                        f"its {size} rows")
    if s.start in (s.unk, s.eos) or len({s.pad, s.unk, s.eos}) < 3:
        raise UserError(f"{name}: pad {s.pad}, unk {s.unk}, decoder start {s.start} and eos {s.eos} must be "
                        f"distinct (the start may be pad)")
    head = [s.pad, s.unk, s.start, s.eos]
    return head + [i for i in range(size) if i not in head]


def aiayn_pieces(vocab: dict[str, int], order: list[int]) -> list[str]:
    """The piece of each aiayn id: the vocabulary's (a target-language token spelled "▁>>xx<<"),
    with "<s>" for the decoder's first input where Marian starts from <pad>."""
    by_id = {i: p for p, i in vocab.items()}
    pieces = [WORD_BOUNDARY + p if LANGUAGE_TOKEN.fullmatch(p) else p for p in (by_id[i] for i in order)]
    if order[2] == order[0]:
        taken = set(pieces)
        pieces[2] = next(p for p in ("<s>", "<bos>", "<start>", "<s_>") if p not in taken)
    return pieces


@dataclass(frozen=True)
class Segmenter:
    """A side's SentencePiece model rewritten to aiayn's ids (``segmenter``)."""
    model: bytes
    dropped: tuple[str, ...]  # pieces the model can produce that the vocabulary lacks (Marian's <unk>)
    foreign: int  # pieces of the vocabulary the model lacks (the other side's)


def segmenter(model_bytes: bytes, pieces: list[str], *, source: bool, name: str, unknown_runs: str | None = None,
              unk_surface: str | None = None) -> Segmenter:
    """``model_bytes`` (one side's SentencePiece model) with piece i = ``pieces[i]`` (module
    docstring): <pad>, <unk>, <s>, </s> at 0-3 as aiayn's ``Tokenizer`` wants them, each other piece
    with its own type and score, foreign ones UNUSED (unigram) or CONTROL (BPE), target-language
    tokens user-defined on the ``source`` side, unknown characters as ``unknown_runs`` says (None:
    "marian" on the source side, "chars" on the target side).
    ``unk_surface``: the text decoding writes for <unk> (None: the model's own, SentencePiece's
    " \u2047 " unless it says otherwise)."""
    unknown_runs = unknown_runs or ("marian" if source else "chars")
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(model_bytes)
    except Exception as exc:  # protobuf's DecodeError, or anything a foreign file raises
        raise UserError(f"{name}: not a SentencePiece model ({exc})") from exc
    if not proto.pieces:  # an empty file parses as an empty model, which SentencePiece itself refuses
        raise UserError(f"{name}: not a SentencePiece model (no pieces: {len(model_bytes)} bytes)")
    own = {p.piece: p for p in proto.pieces}
    known = {c for p in proto.pieces if p.type in _PRODUCED for c in p.piece}  # characters it segments
    floor = min((p.score for p in proto.pieces if p.type in _PRODUCED), default=0.0)
    unigram = proto.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.UNIGRAM
    foreign_type = Piece.UNUSED if unigram else Piece.CONTROL
    out = sentencepiece_model_pb2.ModelProto()
    out.CopyFrom(proto)
    del out.pieces[:]
    foreign = 0
    for i, piece in enumerate(pieces):
        mine = own.get(piece)
        special = Piece.UNKNOWN if i == 1 else Piece.CONTROL
        if mine is not None and (mine.type == special if i < 4 else mine.type in _KEPT):
            out.pieces.add().CopyFrom(mine)  # as it was (an aiayn model's export comes back byte for byte)
        elif i < 4:
            out.pieces.add(piece=piece, score=0.0, type=special)
        elif mine is not None:  # a control piece of the model (<s>, </s>) the vocabulary numbers
            out.pieces.add(piece=piece, score=0.0, type=Piece.CONTROL)
        elif LANGUAGE_TOKEN.fullmatch(piece.removeprefix(WORD_BOUNDARY)) and source:
            out.pieces.add(piece=piece, score=0.0, type=Piece.USER_DEFINED)
        elif unknown_runs == "chars" and len(piece) == 1 and piece not in known:  # one character MarianTokenizer finds
            out.pieces.add(piece=piece, score=floor, type=Piece.NORMAL)
        else:
            foreign += 1
            out.pieces.add(piece=piece, score=0.0, type=foreign_type)
    spec = out.trainer_spec
    spec.vocab_size = len(pieces)
    spec.pad_id, spec.unk_id, spec.bos_id, spec.eos_id = 0, 1, 2, 3
    spec.pad_piece, spec.unk_piece, spec.bos_piece, spec.eos_piece = pieces[:4]
    if unk_surface is not None:
        spec.unk_surface = unk_surface
    wanted = set(pieces)
    dropped = tuple(p.piece for p in proto.pieces if p.type in _PRODUCED and p.piece not in wanted)
    data = out.SerializeToString()
    try:
        Tokenizer(data, name=name)
    except UserError as exc:
        raise UserError(f"{name}: its pieces in the vocabulary's order make no SentencePiece model: {exc}") from exc
    return Segmenter(data, dropped, foreign)
