"""aiayn prepare: cleaning, options, bad input (clear errors, nothing written), interruption."""
from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pytest

import aiayn.data.prepare as prep
import aiayn.files
from aiayn.commands import prepare as prepare_command
from aiayn.config import ConfigError, replace
from aiayn.data import store
from aiayn.data.corpora import Corpus
from aiayn.data.dataset import DataDir
from aiayn.data.prepare import PrepareConfig, SplitFiles, clean_reason, prepare
from aiayn.data.vocab import lowercase_rules
from aiayn.errors import InputError, UserError
from tests.data.conftest import SMALL, write_lines


@pytest.fixture
def corpus(tmp_path, train_lines):
    """train (the 2000 real pairs) as plain en + gz de in tmp_path/in; returns a maker of SplitFiles."""
    d = tmp_path / "in"
    d.mkdir()

    def make(name, src, tgt, gz=False):
        return SplitFiles(write_lines(d / f"{name}.en", src, gz), write_lines(d / f"{name}.de", tgt, gz))
    make.train = make("train", *train_lines)
    return make


def test_clean_reason_rules():
    cfg = PrepareConfig(max_len=10, max_len_ratio=2.0)
    assert clean_reason(0, 3, cfg) == "empty"
    assert clean_reason(11, 10, cfg) == "too_long"
    assert clean_reason(20, 5, cfg) == "too_long"  # first rule broken wins
    assert clean_reason(2, 5, cfg) == "bad_ratio"
    assert clean_reason(4, 8, cfg) is None  # ratio exactly at the bound is kept
    off = PrepareConfig(drop_empty=False, max_len=0, max_len_ratio=0)
    assert clean_reason(0, 3, off) is None and clean_reason(900, 1, off) is None


def test_cleaning_counts_train_only(corpus, tmp_path, train_lines):
    en, de = list(train_lines[0]), list(train_lines[1])
    en[10], de[11], de[12] = "", "", "   "                                   # 3 empty
    en[20], de[20] = " ".join(["Two dogs run through the grass."] * 20), "Zwei Hunde."  # too long
    en[30], de[30] = "A dog.", "Ein brauner Hund rennt mit einem Stock im Maul durch das hohe Gras."  # ratio
    valid = corpus("valid", ["A dog.", "", "Two men."], ["Ein Hund.", "Zwei Männer.", ""])
    out = tmp_path / "data"
    cfg = PrepareConfig(vocab_size=500, num_workers=1, max_len=100, chunk_lines=300)
    m = prepare({"train": corpus("dirty", en, de), "valid": valid}, out, cfg)
    c = m["splits"]["train"]["cleaning"]
    assert (c["input"], c["empty"], c["too_long"], c["bad_ratio"]) == (2000, 3, 1, 1)
    assert c["kept"] == 1995 == m["splits"]["train"]["pairs"]
    d = DataDir(out)
    train = d.split("train")
    assert len(train) == 1995 and train.src_lens.min() > 0 and train.src_lens.max() <= 100
    assert d.src_tokenizer.decode(train.src(10)) == en[13]  # pairs 10-12 dropped, order kept
    v = d.split("valid")
    assert len(v) == 3 and v.src_lens[1] == 0 and v.tgt_lens[2] == 0  # valid is never cleaned
    assert "cleaning" not in m["splits"]["valid"]


def test_gzip_plain_bom_and_crlf_read_alike(corpus, tmp_path, train_lines):
    plain = prepare({"train": corpus("a", *train_lines)}, tmp_path / "a", SMALL)
    d = tmp_path / "in"
    (d / "b.en").write_bytes(("\ufeff" + "\r\n".join(train_lines[0]) + "\r\n").encode("utf-8"))
    with gzip.open(d / "b.de.txt", "wb") as f:  # gzip detected by content, not by name
        f.write("\n".join(train_lines[1]).encode("utf-8"))
    cfg = PrepareConfig(vocab_size=500, num_workers=2, chunk_lines=700)
    other = prepare({"train": SplitFiles(d / "b.en", d / "b.de.txt")}, tmp_path / "b", cfg)
    assert plain["vocab"]["src"]["sha256"] == other["vocab"]["src"]["sha256"]  # reproducible model
    for side in ("src", "tgt"):
        a = np.load(tmp_path / "a" / f"train.{side}.tokens.npy")
        b = np.load(tmp_path / "b" / f"train.{side}.tokens.npy")
        assert np.array_equal(a, b)


def test_separate_unigram_vocabularies(corpus, tmp_path):
    cfg = PrepareConfig(vocab_size=400, model_type="unigram", shared_vocab=False, num_workers=1)
    prepare({"train": corpus.train}, tmp_path / "d", cfg)
    d = DataDir(tmp_path / "d")
    assert not d.shared_vocab and d.src_tokenizer is not d.tgt_tokenizer
    assert d.src_tokenizer.sha256 != d.tgt_tokenizer.sha256
    assert (tmp_path / "d/spm.src.model").is_file() and (tmp_path / "d/spm.tgt.model").is_file()
    assert d.vocab_size == d.tgt_vocab_size == 400
    assert d.manifest["vocab"]["model_type"] == "unigram"
    assert d.tgt_tokenizer.decode(d.split("train").tgt(0)) == "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche."


def test_sample_smaller_than_corpus(corpus, tmp_path):
    cfg = PrepareConfig(vocab_size=300, num_workers=1, spm_sample_pairs=500)
    m = prepare({"train": corpus.train}, tmp_path / "d", cfg)
    assert m["splits"]["train"]["pairs"] > 1900 and m["options"]["spm_sample_pairs"] == 500


def test_user_symbols_are_one_piece(corpus, tmp_path, prepared):
    symbols = ("(NP", ")NP", "XX")
    m = prepare({"train": corpus.train}, tmp_path / "d", replace(SMALL, user_symbols=symbols))
    assert m["options"]["user_symbols"] == ["(NP", ")NP", "XX"]
    tok = DataDir(tmp_path / "d").src_tokenizer
    assert [tok.piece(i) for i in range(4, 7)] == ["\u2581(NP", "\u2581)NP", "\u2581XX"]  # after the specials
    line = "(NP XX XX )NP runs (NP XX )NP"
    assert tok.encode(line)[:4] == [4, 6, 6, 5] and tok.encode(line)[-3:] == [4, 6, 5]
    assert tok.decode(tok.encode(line)) == line
    look_alike = "(VP XXL a)NP"          # not symbols: spelled out (their characters are kept), no <unk>
    assert 1 not in tok.encode(look_alike) and tok.decode(tok.encode(look_alike)) == look_alike
    assert len(DataDir(prepared).src_tokenizer.encode("(NP")) > 1  # without user symbols: split


def test_lowercase_is_built_into_the_model(corpus, tmp_path, train_lines):
    """PrepareConfig.lowercase: the corpus is encoded lowercased and the tokenizer lowercases any
    later input by itself (the rule lives in the model bytes, so checkpoints carry it); ß stays ß
    (case folding would write ss), NFKC still applies, and the model file is reproducible."""
    m = prepare({"train": corpus.train}, tmp_path / "d", replace(SMALL, lowercase=True))
    assert m["options"]["lowercase"] is True
    d = DataDir(tmp_path / "d")
    tok = d.src_tokenizer
    assert d.tgt_tokenizer.decode(d.split("train").tgt(0)) == "zwei junge weiße männer sind im freien in der nähe vieler büsche."
    assert tok.decode(tok.encode("Ein Mann fährt die Straße HINUNTER.")) == "ein mann fährt die straße hinunter."
    assert tok.encode("Two DOGS") == tok.encode("two dogs")
    assert tok.decode(tok.encode("Ｔｗｏ  dogs\u00a0run\tfast\x01")) == "two dogs run fast"  # NFKC, spaces, controls
    for line in train_lines[1][:200]:
        ids = tok.encode(line)
        if 1 not in ids:
            assert tok.decode(ids) == " ".join(line.split()).lower()
    again = prepare({"train": corpus.train}, tmp_path / "e", replace(SMALL, lowercase=True))
    assert again["vocab"]["src"]["sha256"] == m["vocab"]["src"]["sha256"]
    prepare({"train": corpus.train}, tmp_path / "f", SMALL)
    cased = DataDir(tmp_path / "f").src_tokenizer
    assert cased.decode(cased.encode("Two dogs")) == "Two dogs"


def test_lowercase_reads_nfd_as_nfc(tmp_path, train_lines):
    """With lowercase, the same German text written composed (NFC) in one corpus and decomposed
    (NFD: u + U+0308) in another is one token sequence, as nmt_nfkc makes it without lowercase."""
    en, de = train_lines[0][:300], train_lines[1][:300]
    assert any(unicodedata.normalize("NFD", line) != line for line in de)
    nfc = Corpus("nfc", write_lines(tmp_path / "a.en", en), write_lines(tmp_path / "a.de", de))
    nfd = Corpus("nfd", write_lines(tmp_path / "b.en", en),
                 write_lines(tmp_path / "b.de", [unicodedata.normalize("NFD", line) for line in de]))
    prepare({}, tmp_path / "d", replace(SMALL, lowercase=True), corpora=[nfc, nfd])
    d = DataDir(tmp_path / "d")
    train, tok = d.split("train"), d.tgt_tokenizer
    assert len(train) == 600
    assert all(list(train.tgt(i)) == list(train.tgt(300 + i)) for i in range(300))
    text = "Zwei Männer über Füße, ÄRGER"
    assert tok.encode(unicodedata.normalize("NFD", text)) == tok.encode(text)
    assert tok.decode(tok.encode(unicodedata.normalize("NFD", text))) == text.lower()


def test_lowercase_rules_golden():
    rules = dict(line.split("\t") for line in lowercase_rules().splitlines())
    assert rules["41"] == "61"                 # A -> a
    assert rules["C4"] == "E4"                 # Ä -> ä
    assert rules["1E9E"] == "DF"               # capital sharp s -> ß
    assert "DF" not in rules                   # ß itself is kept
    assert rules["FF21"] == "61"               # full-width A -> NFKC A -> a
    assert rules["FB01"] == "66 69"            # the fi ligature -> f i
    assert rules["130"] == "69 307"            # İ -> i + combining dot above
    assert rules["41 308"] == rules["61 308"] == "E4"   # A or a + combining diaeresis (NFD) -> ä
    assert rules["9"] == rules["A0"] == rules["2028"] == "20"   # tab, no-break space, line separator
    assert rules["1"] == ""                                  # control characters are removed
    assert "61" not in rules and "E4" not in rules and "20" not in rules


@pytest.mark.parametrize("symbols,message", [(("(S", "(S"), "more than once"), (("a b",), "without spaces"),
                                             (("",), "without spaces"), (("\u2581XX",), "without spaces")])
def test_user_symbols_refused(symbols, message):
    with pytest.raises(ConfigError, match=message):
        PrepareConfig(user_symbols=symbols)
    with pytest.raises(ConfigError, match="4 special ids \\+ 3 user symbols"):
        PrepareConfig(vocab_size=7, user_symbols=("a", "b", "c"))


def test_user_symbols_the_tokenizer_cannot_match_refused(tmp_path):
    """A user symbol, tag or target-language token the tokenizer's normalization changes (NFKC,
    and lowercasing with lowercase) could never be one piece: refused before any text is read."""
    with pytest.raises(ConfigError, match=re.escape("write them as ['<x>']")):
        PrepareConfig(user_symbols=("<X>",), lowercase=True)
    with pytest.raises(ConfigError, match=re.escape("write them as ['<x>']")):
        PrepareConfig(user_symbols=("\uff1cx\uff1e",))  # full-width brackets: NFKC writes <x>
    assert PrepareConfig(user_symbols=("<X>",)).user_symbols == ("<X>",)
    assert PrepareConfig(user_symbols=("<x>",), lowercase=True).user_symbols == ("<x>",)
    bad_utf8 = tmp_path / "a.en"
    bad_utf8.write_bytes(b"caf\xe9\n")
    tagged = Corpus("a", bad_utf8, write_lines(tmp_path / "a.de", ["Cafe"]), tag="<BT>", lang="DE")
    with pytest.raises(UserError, match=re.escape("--corpus a TAG <BT> (write <bt>), --corpus a LANG DE (write de): "
                                                  "the tokenizer normalizes")):  # not the file's invalid UTF-8
        prepare({}, tmp_path / "d", replace(SMALL, lowercase=True), corpora=[tagged])


def test_a_target_language_token_normalization_changes_names_its_option(corpus, tmp_path):
    """``--target-lang-token DE`` with ``--lowercase``: the error names that option and the code to
    write, not a field the command line never spelled (``user_symbols``)."""
    with pytest.raises(UserError, match=r"^--target-lang-token DE \(write de\): the tokenizer normalizes its input "
                                        r"\(NFKC, lowercased\)"):
        prepare({"train": corpus.train}, tmp_path / "d", replace(SMALL, lowercase=True, target_lang_token="DE"))
    assert not (tmp_path / "d").exists()


def _listing(path):
    return sorted(p.name for p in path.iterdir())


def _assert_nothing_written(tmp_path, before):
    assert not (tmp_path / "out").exists()
    assert _listing(tmp_path) == before  # no temp dirs either


def test_mismatched_line_counts(corpus, tmp_path, train_lines):
    bad = corpus("bad", train_lines[0][:1500], train_lines[1][:1499])
    before = _listing(tmp_path)
    with pytest.raises(InputError) as err:
        prepare({"train": corpus.train, "valid": bad}, tmp_path / "out", SMALL)
    msg = str(err.value)
    assert "1500 lines" in msg and "1499 lines" in msg and str(bad.src) in msg and str(bad.tgt) in msg
    assert msg.startswith(f"{bad.tgt}:1500:")
    _assert_nothing_written(tmp_path, before)


def test_invalid_utf8_names_file_and_line(corpus, tmp_path, train_lines):
    path = tmp_path / "in" / "latin1.de.gz"
    with gzip.open(path, "wb") as f:
        f.write("Ein Hund.\nZwei Männer.\n".encode("utf-8") + "Drei Füße.\n".encode("latin-1"))
    src = write_lines(tmp_path / "in" / "ok.en", ["A dog.", "Two men.", "Three feet."])
    before = _listing(tmp_path)
    with pytest.raises(InputError, match=f"^{path}:3: invalid UTF-8"):
        prepare({"train": corpus.train, "test": SplitFiles(src, path)}, tmp_path / "out", SMALL)
    _assert_nothing_written(tmp_path, before)


def test_missing_file(corpus, tmp_path):
    before = _listing(tmp_path)
    with pytest.raises(UserError, match="nope.de: no such file"):
        prepare({"train": SplitFiles(corpus.train.src, tmp_path / "nope.de")}, tmp_path / "out", SMALL)
    _assert_nothing_written(tmp_path, before)


@pytest.mark.parametrize("src,tgt,message", [([], [], "empty train corpus: no lines"),
                                             (["", " "], ["x", ""], "empty corpus")])
def test_empty_corpus(corpus, tmp_path, src, tgt, message):
    empty = corpus("empty", src, tgt)
    before = _listing(tmp_path)
    with pytest.raises(InputError if not src else UserError, match=f"{empty.src}.*{message}"):
        prepare({"train": empty}, tmp_path / "out", SMALL)
    _assert_nothing_written(tmp_path, before)


def test_an_empty_valid_split_is_named(corpus, tmp_path):
    empty = corpus("empty", [], [])
    with pytest.raises(InputError, match=f"{empty.src}: empty valid corpus: no lines"):
        prepare({"train": corpus.train, "valid": empty}, tmp_path / "out", SMALL)


def test_empty_after_cleaning(corpus, tmp_path):
    before = _listing(tmp_path)
    with pytest.raises(UserError, match="empty corpus after cleaning"):
        prepare({"train": corpus.train}, tmp_path / "out", PrepareConfig(vocab_size=500, num_workers=1, max_len=3))
    _assert_nothing_written(tmp_path, before)


def _fail_on_call(n):
    calls = {"n": 0}
    real = store.NpyAppender.append

    def append(self, values):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt("simulated interrupt")
        real(self, values)
    return append


def test_interrupted_prepare_leaves_nothing(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(store.NpyAppender, "append", _fail_on_call(6))
    before = _listing(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        prepare({"train": corpus.train}, tmp_path / "out", PrepareConfig(vocab_size=500, chunk_lines=500))
    _assert_nothing_written(tmp_path, before)
    with pytest.raises(UserError):
        DataDir(tmp_path / "out")


def test_killed_prepare_leaves_no_acceptable_directory(corpus, tmp_path, monkeypatch):
    """A kill gives no chance to clean up: the temp dir stays, but it has no manifest."""
    monkeypatch.setattr(store.NpyAppender, "append", _fail_on_call(6))
    monkeypatch.setattr(aiayn.files.shutil, "rmtree", lambda *a, **k: None)
    with pytest.raises(KeyboardInterrupt):
        prepare({"train": corpus.train}, tmp_path / "out", PrepareConfig(vocab_size=500, chunk_lines=500))
    assert not (tmp_path / "out").exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".out.aiayn-tmp-")]
    assert len(leftovers) == 1 and (leftovers[0] / "spm.model").is_file()
    with pytest.raises(UserError, match="no manifest.json"):
        DataDir(leftovers[0])


def test_failure_while_writing_manifest(corpus, tmp_path, monkeypatch):
    def boom(path, data):
        (path.parent / "manifest.json.partial").write_text('{"format": "aiayn-data", "vers')
        raise OSError("disk full")
    monkeypatch.setattr(prep, "write_json_atomic", boom)
    before = _listing(tmp_path)
    with pytest.raises(OSError, match="disk full"):
        prepare({"train": corpus.train}, tmp_path / "out", SMALL)
    _assert_nothing_written(tmp_path, before)


def test_existing_output(corpus, tmp_path):
    out = tmp_path / "out"
    prepare({"train": corpus.train}, out, SMALL)
    old_sha = DataDir(out).src_tokenizer.sha256
    with pytest.raises(UserError, match="already exists.*--overwrite"):
        prepare({"train": corpus.train}, out, SMALL)
    prepare({"train": corpus.train}, out, PrepareConfig(vocab_size=300, num_workers=1), force=True)
    assert DataDir(out).vocab_size == 300 and DataDir(out).src_tokenizer.sha256 != old_sha
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a data directory"):
        prepare({"train": corpus.train}, other, SMALL, force=True)
    assert (other / "notes.txt").read_text() == "keep me"


def test_overwrite_never_deletes_an_input_or_a_file_of_the_users(corpus, tmp_path):
    """--overwrite replaces a data directory holding only what prepare writes: one that holds the
    corpus it is asked to read, or a file put there by hand, is refused and left as it was."""
    out = tmp_path / "out"
    prepare({"train": corpus.train}, out, SMALL)
    inside = SplitFiles(out / "train.en", out / "train.de")
    for given, copy in ((corpus.train.src, inside.src), (corpus.train.tgt, inside.tgt)):
        copy.write_bytes(Path(given).read_bytes())
    with pytest.raises(UserError, match=rf"--out {re.escape(str(out))}: holds the input {re.escape(str(inside.src))}"):
        prepare({"train": inside}, out, SMALL, force=True)
    with pytest.raises(UserError, match="not empty and not a data directory"):  # the files are the user's
        prepare({"train": corpus.train}, out, SMALL, force=True)
    assert inside.src.read_bytes() == Path(corpus.train.src).read_bytes() and (out / "manifest.json").is_file()
    inside.src.unlink()
    inside.tgt.unlink()
    prepare({"train": corpus.train}, out, SMALL, force=True)  # only prepare's own files: replaced


def test_an_out_below_a_file_is_refused_before_the_work(corpus, tmp_path):
    with pytest.raises(UserError, match=rf"{re.escape(str(corpus.train.src))} is not a folder"):
        prepare({"train": corpus.train}, Path(corpus.train.src) / "sub", SMALL)


def _parser():
    parser = argparse.ArgumentParser()
    prepare_command.register(parser.add_subparsers(dest="command"))
    return parser


def test_cli_prepare(corpus, tmp_path, capsys):
    args = _parser().parse_args(
        ["prepare", "--train-src", str(corpus.train.src), "--train-tgt", str(corpus.train.tgt),
         "--valid-src", str(corpus.train.src), "--valid-tgt", str(corpus.train.tgt),
         "--vocab-size", "400", "--max-len-ratio", "2.5", "--shared-vocab", "false",
         "--num-workers", "1", "--user-symbols", "(S,)S XX", "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    assert "valid: 2000 pairs" in capsys.readouterr().out
    d = DataDir(tmp_path / "out")
    m = d.manifest
    assert m["options"]["max_len_ratio"] == 2.5 and m["vocab"]["shared"] is False
    assert m["options"]["user_symbols"] == ["(S", ")S", "XX"]
    for tok in (d.src_tokenizer, d.tgt_tokenizer):      # separate models: both keep the symbols
        assert tok.encode("(S XX )S") == [4, 6, 5]
    assert _parser().parse_args(["prepare", "--train-src", "a", "--train-tgt", "b", "--out", "o"]).num_workers >= 1


def test_cli_errors_exit_2(corpus, tmp_path, capsys):
    from aiayn.cli import main
    rc = main(["prepare", "--train-src", str(corpus.train.src), "--train-tgt", str(tmp_path / "missing.de"),
               "--out", str(tmp_path / "out"), "--vocab-size", "500"])
    assert rc == 2 and "missing.de: no such file" in capsys.readouterr().err
    rc = main(["prepare", "--train-src", "a", "--train-tgt", "b", "--valid-src", "c", "--out", "o"])
    assert rc == 2 and "--valid-src and --valid-tgt" in capsys.readouterr().err
    rc = main(["prepare", "--train-src", "a", "--train-tgt", "b", "--out", "o", "--vocab-size", "3"])
    assert rc == 2 and "--vocab-size must exceed" in capsys.readouterr().err


def test_directory_and_corrupt_gzip_inputs(corpus, tmp_path, train_lines):
    with pytest.raises(UserError, match="not a regular file"):
        prepare({"train": SplitFiles(corpus.train.src, tmp_path)}, tmp_path / "out", SMALL)
    whole = gzip.compress("\n".join(train_lines[1]).encode("utf-8"))
    cut = tmp_path / "in" / "cut.de.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    before = _listing(tmp_path)
    with pytest.raises(InputError, match=f"^{cut}:\\d+: cannot read"):
        prepare({"train": SplitFiles(corpus.train.src, cut)}, tmp_path / "out", SMALL)
    _assert_nothing_written(tmp_path, before)


def test_an_empty_existing_output_is_filled(corpus, tmp_path):
    (tmp_path / "out").mkdir()
    prepare({"train": corpus.train}, tmp_path / "out", SMALL)
    assert DataDir(tmp_path / "out").split("train")


def test_atomic_dir_needs_a_manifest(tmp_path):
    with pytest.raises(RuntimeError, match="without a manifest"):
        with store.AtomicDir(tmp_path / "out") as tmp:
            (tmp / "train.src.tokens.npy").write_bytes(b"")
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("over, message", [
    ({"vocab_size": 5000}, r"--vocab-size 5000: more pieces than the training text gives the shared vocabulary "
                           r"\(at most \d+\); lower --vocab-size"),
    ({"vocab_size": 5000, "shared_vocab": False}, r"--vocab-size 5000: more pieces than the training text gives "
                                                  r"the source vocabulary"),
    ({"vocab_size": 10}, r"--vocab-size 10: fewer pieces than the shared vocabulary's characters and special ids "
                         r"\(\d+\); raise --vocab-size or lower --character-coverage")])
def test_a_vocabulary_the_text_cannot_fill_names_the_option(corpus, tmp_path, over, message):
    """SentencePiece's refusals of a small corpus, in aiayn's terms: the option, and which model."""
    few = corpus("few", ["a man rides a horse", "two dogs run"] * 5, ["ein mann reitet", "zwei hunde laufen"] * 5)
    with pytest.raises(UserError, match=message):
        prepare({"train": few}, tmp_path / "out", replace(SMALL, **over))


@pytest.mark.parametrize("over, message", [
    ({"character_coverage": 0.95}, r"character_coverage must be in \[0.98, 1\] \(SentencePiece's bounds\), got 0.95"),
    ({"max_len": -5}, "max_len must be >= 0, got -5"), ({"chunk_lines": 0}, "chunk_lines must be >= 1, got 0"),
    ({"num_workers": -1}, "num_workers must be >= 0, got -1")])
def test_a_bad_option_is_named_with_its_value(over, message):
    with pytest.raises(ConfigError, match=message):
        replace(SMALL, **over)


@pytest.mark.parametrize("ratio", [0.5, 0.999, float("nan"), float("inf")])
def test_a_length_ratio_no_pair_can_have_is_refused(ratio):
    """longer/shorter is at least 1, so a bound below 1 drops every pair of unequal lengths; NaN
    (every comparison false) and infinity would be no limit, which is 0, and neither is JSON the
    manifest could record."""
    with pytest.raises(ConfigError, match=rf"max_len_ratio must be 0 \(no limit\) or a number >= 1, got {ratio}"):
        replace(SMALL, max_len_ratio=ratio)
    assert replace(SMALL, max_len_ratio=1.0).max_len_ratio == 1.0


def test_tokenizer_from_records_the_stored_models_options(corpus, tmp_path):
    """prepare with a checkpoint's models (--tokenizer-from): the manifest's options say what the
    data was encoded with (the stored models' size, sharing, coverage, symbols, lowercasing) and
    name the checkpoint, not the defaults of options that never applied."""
    from aiayn.checkpoint.run import tokenizer_payload
    base = replace(SMALL, vocab_size=400, shared_vocab=False, lowercase=True, character_coverage=1.0,
                   user_symbols=("xx",))
    prepare({"train": corpus.train}, tmp_path / "base", base)
    ckpt = {"tokenizers": tokenizer_payload(DataDir(tmp_path / "base"))}
    tuning = PrepareConfig(num_workers=1)
    toks = prep.tokenizers_from_checkpoint(ckpt, tmp_path / "model.pt", {})
    m = prepare({"train": corpus.train}, tmp_path / "d", tuning, tokenizers=toks)
    options = m["options"]
    assert (options["vocab_size"], options["shared_vocab"], options["lowercase"]) == (400, False, True)
    assert options["character_coverage"] == 1.0 and options["user_symbols"] == ["xx"]
    assert options["model_type"] == "bpe" and options["spm_sample_pairs"] is None and options["seed"] is None
    assert options["tokenizer_from"] == str((tmp_path / "model.pt").resolve())
    assert m["vocab"]["src"]["sha256"] == ckpt["tokenizers"]["src_sha256"]
    with pytest.raises(UserError, match="which have --seed none; --seed 2 would train a new one"):
        prep.tokenizers_from_checkpoint(ckpt, tmp_path / "model.pt", {"seed": 2})


def test_tokenizer_from_judges_the_options_given_not_their_defaults(corpus, tmp_path, monkeypatch, capsys):
    """``prepare --tokenizer-from``: an option of SentencePiece training given on the command line
    is refused when the stored models differ from it, at its default too (``--vocab-size 37000``,
    ``--shared-vocab``), each named with the stored value; given as the stored models have it, it
    is accepted."""
    import aiayn.checkpoint
    from aiayn.checkpoint.run import tokenizer_payload
    prepare({"train": corpus.train}, tmp_path / "base", replace(SMALL, vocab_size=400, shared_vocab=False))
    ckpt = {"tokenizers": tokenizer_payload(DataDir(tmp_path / "base"))}
    monkeypatch.setattr(aiayn.checkpoint, "load_checkpoint", lambda path, **kw: ckpt)
    argv = ["prepare", "--train-src", str(corpus.train.src), "--train-tgt", str(corpus.train.tgt),
            "--tokenizer-from", str(tmp_path / "model.pt"), "--num-workers", "1"]
    args = _parser().parse_args([*argv, "--out", str(tmp_path / "d"), "--vocab-size", "37000", "--shared-vocab",
                                 "--seed", "1", "--model-type", "bpe"])
    with pytest.raises(UserError) as refused:
        args.func(args)
    assert str(refused.value).endswith(
        "which have --vocab-size 400, --shared-vocab false, --seed none; --vocab-size 37000, --shared-vocab true, "
        "--seed 1 would train a new one (leave the option out, or give the stored value)")
    assert not (tmp_path / "d").exists()
    args = _parser().parse_args([*argv, "--out", str(tmp_path / "d"), "--vocab-size", "400", "--shared-vocab", "false",
                                 "--model-type", "bpe", "--lowercase", "false", "--character-coverage", "0.9999"])
    assert args.func(args) == 0
    assert DataDir(tmp_path / "d").manifest["vocab"]["src"]["sha256"] == ckpt["tokenizers"]["src_sha256"]


def test_valid_bleu_of_a_lowercasing_tokenizer_is_case_insensitive(corpus, tmp_path, train_lines, monkeypatch):
    """A data directory prepared with --lowercase (or from such a checkpoint) trains a model whose
    translations are lowercase: train.valid_bleu scores them case-insensitively against the raw
    references (sacreBLEU -lc), so a perfect lowercase translation scores 100, not the cased score
    of its capitals alone."""
    import torch
    from aiayn.decode.search import Hypothesis
    from aiayn.decode.translator import Translator
    from aiayn.model import ModelConfig, Transformer
    from aiayn.train.validation import Bleu, valid_bleu
    valid = corpus("valid", train_lines[0][:40], train_lines[1][:40])
    prepare({"train": corpus.train, "valid": valid}, tmp_path / "d",
            replace(SMALL, lowercase=True, character_coverage=1.0))
    d = DataDir(tmp_path / "d")
    split, refs = d.split("valid"), d.references("valid")
    assert refs == train_lines[1][:40]

    def perfect(self, ids, *args, **kwargs):  # the stored (lowercased) references, as a model's output
        return [[Hypothesis(tuple(int(t) for t in split.tgt(i)), 0.0, 0.0, 0, True)] for i in range(len(ids))]
    monkeypatch.setattr(Translator, "translate_ids", perfect)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=d.vocab_size, n_layers=1, d_model=16, d_ff=32, n_heads=2,
                                    d_k=8, d_v=8)).eval()
    score = valid_bleu(model, split, Bleu((d.src_tokenizer, d.tgt_tokenizer), refs), beam=1)
    assert score > 99.0, score


def test_separate_vocabularies_untie_the_embeddings_and_say_so(corpus, tmp_path, caplog):
    """A data directory of separate vocabularies cannot share source and target embeddings (§3.4):
    training turns model.tie_src_tgt_embeddings off, and says so rather than dropping a true (the
    presets', or a --set's) unseen."""
    import logging
    from aiayn.train.config import RunConfig
    from aiayn.train.loop import fit_to_data
    prepare({"train": corpus.train}, tmp_path / "d", replace(SMALL, vocab_size=400, shared_vocab=False))
    with caplog.at_level(logging.INFO, logger="aiayn.train.loop"):
        fitted = fit_to_data(RunConfig(), DataDir(tmp_path / "d"))
    assert fitted.model.tie_src_tgt_embeddings is False and fitted.model.tgt_vocab_size == 400
    assert "model.tie_src_tgt_embeddings: false" in caplog.text


def test_the_same_text_gives_the_same_directory_on_any_thread_count_and_from_any_folder(corpus, tmp_path):
    """Reproducible data: the SentencePiece model and every array byte for byte, whatever the thread
    count, the chunk size or the folder the text is read from; the manifest differs only in when it
    was written, how long it took, the paths read and those two options (docs/training.md,
    "Reproducibility")."""
    valid = corpus("valid", ["A dog runs.", "Two men talk."], ["Ein Hund rennt.", "Zwei Männer reden."])
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    copies = [SplitFiles(*(Path(shutil.copy(f, moved)) for f in (s.src, s.tgt))) for s in (corpus.train, valid)]
    outs = []
    for i, (train, val, workers, chunk) in enumerate([(corpus.train, valid, 1, 100_000), (*copies, 2, 300)]):
        outs.append(tmp_path / f"out{i}")
        prepare({"train": train, "valid": val}, outs[-1], replace(SMALL, num_workers=workers, chunk_lines=chunk))
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == sorted(p.name for p in outs[1].iterdir()) and "spm.model" in names
    for name in names:
        if name != store.MANIFEST:
            assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name

    def kept(out: Path) -> dict:
        m = json.loads((out / store.MANIFEST).read_text())
        for key in ("created", "seconds"):
            m.pop(key)
        for key in ("num_workers", "chunk_lines"):
            m["options"].pop(key)
        for entry in m["splits"].values():
            entry["inputs"].pop("src"), entry["inputs"].pop("tgt")
        return m
    assert kept(outs[0]) == kept(outs[1])
