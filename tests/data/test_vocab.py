"""Tokenizer: round trips on real Multi30k lines, fixed special ids, pieces, pickling."""
from __future__ import annotations

import hashlib
import pickle
import unicodedata

import pytest
import sentencepiece as spm

from aiayn.data.dataset import DataDir
from aiayn.data.vocab import Tokenizer
from aiayn.errors import UserError
from tests.data.conftest import read_gz


def normalized(line: str) -> str:
    """What SentencePiece's nmt_nfkc normalization keeps: NFKC, single spaces, no edge spaces."""
    return " ".join(unicodedata.normalize("NFKC", line).split())


@pytest.fixture(scope="module")
def tok(prepared) -> Tokenizer:
    return DataDir(prepared).src_tokenizer


def test_round_trip_on_training_lines(tok, train_lines):
    for line in train_lines[0][:300] + train_lines[1][:300]:
        ids = tok.encode(line)
        if 1 not in ids:  # a character outside the 500-piece vocabulary cannot come back
            assert tok.decode(ids) == normalized(line)
    unk_lines = sum(1 in tok.encode(line) for line in train_lines[0] + train_lines[1])
    assert unk_lines < 0.01 * 2 * len(train_lines[0])


@pytest.mark.parametrize("name", ["raw/val.en.gz", "raw/val.de.gz", "tok/val.lc.norm.tok.en.gz",
                                  "tok/val.lc.norm.tok.de.gz"])
def test_round_trip_on_unseen_lines(tok, multi30k, name):
    lines = read_gz(multi30k / name, 300)
    exact = [tok.decode(tok.encode(line)) == normalized(line) for line in lines]
    no_unk = [1 not in tok.encode(line) for line in lines]
    assert exact == no_unk  # every line without <unk> comes back exactly
    assert sum(exact) > 0.9 * len(lines)
    assert sum(normalized(line) == line for line in lines) > 0.95 * len(lines)


def test_special_ids_and_pieces(tok):
    assert [tok.piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    ids = tok.encode("Two dogs play in the snow.")
    assert 2 not in ids and 3 not in ids and 0 not in ids
    assert tok.decode([2] + ids + [3, 0, 0]) == tok.decode(ids) == "Two dogs play in the snow."
    assert tok.encode_pieces("Two dogs play.") == [tok.piece(i) for i in tok.encode("Two dogs play.")]
    assert tok.vocab_size == 500


def test_sha256_and_pickle(tok, prepared):
    assert tok.sha256 == hashlib.sha256((prepared / "spm.model").read_bytes()).hexdigest()
    back = pickle.loads(pickle.dumps(tok))
    assert back.sha256 == tok.sha256 and back.encode("A man.") == tok.encode("A man.")


def test_refuses_other_special_ids(tmp_path, train_lines):
    spm.SentencePieceTrainer.train(sentence_iterator=iter(train_lines[0][:500]), vocab_size=200,
                                   model_prefix=str(tmp_path / "m"), minloglevel=2)  # unk=0 bos=1 eos=2
    with pytest.raises(UserError, match="special ids"):
        Tokenizer.load(tmp_path / "m.model")


def test_refuses_missing_or_bad_file(tmp_path):
    with pytest.raises(UserError, match="cannot read"):
        Tokenizer.load(tmp_path / "none.model")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(UserError, match="not a SentencePiece model"):
        Tokenizer.load(tmp_path / "bad.model")


def test_bpe_dropout_segments_the_same_text_more_finely(tok, train_lines):
    lines = [line for line in train_lines[0][:200] + train_lines[1][:200] if 1 not in tok.encode(line)]
    assert tok.model_type == "bpe"
    changed = 0
    for line in lines:
        plain = tok.encode(line)
        assert tok.encode_dropout([line], 0.0) == [plain]
        chars, = tok.encode_dropout([line], 1.0)  # every merge dropped: one piece per character
        assert "".join(tok.piece(i) for i in chars) == "▁" + normalized(line).replace(" ", "▁")
        assert all(len(tok.piece(i)) == 1 for i in chars)
        sampled, = tok.encode_dropout([line], 0.1)
        assert tok.decode(sampled) == tok.decode(plain)
        assert len(sampled) <= len(chars)  # (it can be shorter than plain: a dropped merge opens another path)
        changed += sampled != plain
    assert changed > len(lines) // 2  # at p = 0.1 most sentences lose at least one merge


def test_bpe_dropout_needs_a_bpe_model(tmp_path, train_lines):
    from aiayn.data.vocab import SentencePieceSpec, train_sentencepiece
    path = train_sentencepiece(train_lines[0][:500], tmp_path / "uni.model",
                               SentencePieceSpec(vocab_size=300, model_type="unigram", character_coverage=1.0),
                               num_threads=1)
    uni = Tokenizer.load(path)
    assert uni.model_type == "unigram"
    with pytest.raises(UserError, match="uni.model: BPE-dropout needs a BPE model, this one is unigram"):
        uni.encode_dropout(["a man"], 0.1)


def test_a_long_lines_characters_are_learnt(tmp_path, train_lines):
    """SentencePiece skips lines over 4,192 bytes unless told: a rare character found only in one
    such line would be <unk> despite a character coverage of 1.0. Every sampled line is learnt from."""
    from aiayn.data.vocab import SPM_MAX_SENTENCE_BYTES, SentencePieceSpec, train_sentencepiece
    lines = train_lines[0][:300]
    long = " ".join(lines[:200]) + " Σ ǂ Ω"
    assert len(long.encode("utf-8")) > SPM_MAX_SENTENCE_BYTES
    spec = SentencePieceSpec(vocab_size=300, model_type="bpe", character_coverage=1.0)
    tok = Tokenizer.load(train_sentencepiece([*lines, long], tmp_path / "long.model", spec, num_threads=1))
    assert tok.decode(tok.encode("Σ ǂ Ω")) == "Σ ǂ Ω"  # no <unk>
    from sentencepiece import sentencepiece_model_pb2
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((tmp_path / "long.model").read_bytes())
    assert proto.trainer_spec.max_sentence_length == len(long.encode("utf-8"))
    proto.ParseFromString(train_sentencepiece(lines, tmp_path / "plain.model", spec, num_threads=1).read_bytes())
    assert proto.trainer_spec.max_sentence_length == SPM_MAX_SENTENCE_BYTES  # short lines: the model as before
