"""aiayn prepare over several corpora (aiayn.data.corpora): weights per epoch, tags, target-language
tokens, one vocabulary over all; a single corpus prepared and batched as before."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from aiayn.cli import main
from aiayn.config import ConfigError, replace
from aiayn.data.batching import TokenBatchSampler, TokenBounds
from aiayn.data.corpora import Corpus, CorpusMix, check_corpora, corpus_mix, parse_corpus
from aiayn.data.dataset import DataDir
from aiayn.data.prepare import SplitFiles, _Reservoir, prepare
from aiayn.errors import UserError
from tests.data.conftest import SMALL, write_lines

N_A, N_B = 600, 400  # pairs of the real corpus (weight 2) and of the tagged one (weight 0.5)


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory, train_lines):
    """Corpus a: 600 Multi30k pairs, each source ending in the word "alphamarker"; corpus bt: the
    next 400, each source ending in "betamarker", tagged <bt>, target language de."""
    d = tmp_path_factory.mktemp("corpora")
    en, de = train_lines
    a = Corpus("a", write_lines(d / "a.en", [s + " alphamarker" for s in en[:N_A]]),
               write_lines(d / "a.de", de[:N_A]), weight=2)
    bt = Corpus("bt", write_lines(d / "bt.en", [s + " betamarker" for s in en[N_A:N_A + N_B]]),
                write_lines(d / "bt.de", de[N_A:N_A + N_B], gz=True), weight=0.5, tag="<bt>", lang="de")
    valid = SplitFiles(write_lines(d / "v.en", en[1900:1950]), write_lines(d / "v.de", de[1900:1950]))
    out = d / "data"
    prepare({"valid": valid}, out, SMALL, corpora=[a, bt])
    return out


def test_manifest_lists_the_corpora_and_their_ranges(two_corpora):
    entry = DataDir(two_corpora).manifest["splits"]["train"]
    a, bt = entry["corpora"]
    assert (a["name"], a["weight"], a["tag"], a["start"]) == ("a", 2, "", 0)
    assert (bt["name"], bt["weight"], bt["tag"], bt["lang"]) == ("bt", 0.5, "<bt>", "de")
    assert a["end"] == bt["start"] and bt["end"] == entry["pairs"]
    assert a["inputs"]["lines"] == N_A and bt["inputs"]["lines"] == N_B
    assert a["cleaning"]["kept"] == a["end"] and bt["cleaning"]["kept"] == bt["end"] - bt["start"]
    assert entry["cleaning"]["input"] == N_A + N_B and "inputs" not in entry
    options = DataDir(two_corpora).manifest["options"]
    assert options["user_symbols"] == ["<bt>", "<2de>"]  # added to the user's own (none here)


def test_weights_give_the_counts_of_each_epoch(two_corpora):
    d = DataDir(two_corpora)
    train = d.split("train")
    (_, n_a, _), (s_b, e_b, _) = [(c["start"], c["end"], c["weight"]) for c in d.manifest["splits"]["train"]["corpora"]]
    n_b = e_b - s_b
    mix = corpus_mix(d, train, seed=1)
    half = int(n_b / 2 + 0.5)
    assert len(mix) == 2 * n_a + half and mix.counts() == {"a": 2 * n_a, "bt": half}
    draws = {}
    for epoch in (0, 1, 2):
        mix.set_epoch(epoch)
        seen = Counter(mix.index.tolist())
        assert all(seen[i] == 2 for i in range(n_a))                    # weight 2: every pair twice
        b = sorted(i for i in seen if i >= s_b)
        assert len(b) == half and all(seen[i] == 1 for i in b) and b[-1] < e_b  # 0.5: a half, no repeats
        draws[epoch] = b
        assert np.array_equal(mix.src_lens, train.src_lens[mix.index])
        assert np.array_equal(mix[5][0], train.src(int(mix.index[5])))
    assert draws[0] != draws[1] != draws[2]                              # a new half each epoch
    again = CorpusMix(train, d.manifest["splits"]["train"]["corpora"], seed=1)
    assert again.set_epoch(1) and not again.set_epoch(1)
    assert sorted(set(again.index.tolist()) - set(range(n_a))) == draws[1]  # the same draw on resume
    other = CorpusMix(train, d.manifest["splits"]["train"]["corpora"], seed=2)
    other.set_epoch(1)
    assert sorted(set(other.index.tolist()) - set(range(n_a))) != draws[1]


def test_tag_is_one_id_at_the_start_of_the_tagged_corpus_only(two_corpora):
    d = DataDir(two_corpora)
    tok, train = d.src_tokenizer, d.split("train")
    bt_id, de_id = tok.encode("<bt>"), tok.encode("<2de>")
    assert len(bt_id) == 1 and len(de_id) == 1 and tok.piece(bt_id[0]) == "\u2581<bt>"
    _, bt = d.manifest["splits"]["train"]["corpora"]
    for i in range(len(train)):
        src, tgt = train[i]
        tagged = bt["start"] <= i < bt["end"]
        assert (list(src[:2]) == bt_id + de_id) == tagged
        assert np.count_nonzero(src == bt_id[0]) == tagged and bt_id[0] not in tgt
    valid = d.split("valid")
    assert all(bt_id[0] not in valid.src(i) and de_id[0] not in valid.src(i) for i in range(len(valid)))


def test_vocabulary_holds_pieces_of_both_corpora(two_corpora):
    tok = DataDir(two_corpora).src_tokenizer
    assert tok.encode_pieces("alphamarker") == ["\u2581alphamarker"]
    assert tok.encode_pieces("betamarker") == ["\u2581betamarker"]


def test_reservoir_samples_corpora_in_proportion_to_their_sizes():
    r = _Reservoir(400, seed=1)
    for i in range(3000):
        r.add(("a", str(i)))
    for i in range(1000):
        r.add(("b", str(i)))
    n_b = sum(1 for k, _ in r.items if k == "b")
    assert len(r.items) == 400 and 70 <= n_b <= 130  # 100 expected


def test_target_lang_token_on_every_source_and_at_translation_time(tmp_path, train_lines):
    """--target-lang-token de: <2de> starts every train and valid source as one id; a source text
    that starts with "<2de> " (what a user types at translation time) encodes to the same ids."""
    en, de = train_lines
    files = {name: SplitFiles(write_lines(tmp_path / f"{name}.en", en[a:b]), write_lines(tmp_path / f"{name}.de", de[a:b]))
             for name, a, b in (("train", 0, 800), ("valid", 1900, 1920))}
    prepare(files, tmp_path / "d", replace(SMALL, target_lang_token="de", user_symbols=("<2de>", "XX")))
    d = DataDir(tmp_path / "d")
    assert d.manifest["options"]["user_symbols"] == ["<2de>", "XX"]        # given once, kept once
    tok = d.src_tokenizer
    de_id = tok.encode("<2de>")
    assert all(list(d.split("train").src(i)[:1]) == de_id for i in range(len(d.split("train"))))
    valid = d.split("valid")
    for i in range(len(valid)):
        assert list(valid.src(i)) == tok.encode(f"<2de> {en[1900 + i].strip()}")
    assert tok.encode_pieces("<2de> A dog runs.")[0] == "\u2581<2de>"
    assert "corpora" not in d.manifest["splits"]["train"]
    with pytest.raises(ConfigError, match="target_lang_token"):
        replace(SMALL, target_lang_token="<2de>")


def test_single_corpus_prepare_and_batches_unchanged(tmp_path, small_train, prepared):
    """--train-src alone writes no corpora and trains as before; a --corpus of weight 1 encodes the
    same ids; neither changes the batch order (no per-epoch view)."""
    d = DataDir(prepared)
    entry = d.manifest["splits"]["train"]
    assert "corpora" not in entry and entry["inputs"]["lines"] == 2000
    assert d.manifest["options"]["user_symbols"] == [] and d.manifest["options"]["target_lang_token"] == ""
    train = d.split("train")
    assert corpus_mix(d, train, seed=1) is None
    prepare({}, tmp_path / "one", SMALL, corpora=[Corpus("train", small_train.src, small_train.tgt)])
    one = DataDir(tmp_path / "one")
    assert one.manifest["vocab"]["src"]["sha256"] == d.manifest["vocab"]["src"]["sha256"]
    for side in ("src", "tgt"):
        assert one.manifest["splits"]["train"][side]["bytes"] == entry[side]["bytes"]
    assert one.manifest["splits"]["train"]["corpora"][0]["end"] == len(train)
    one_train = one.split("train")
    assert corpus_mix(one, one_train, seed=1) is None
    assert np.array_equal(one_train.src_lens, train.src_lens) and np.array_equal(one_train.tgt_lens, train.tgt_lens)
    make = lambda data: TokenBatchSampler(data.src_lens + 1, data.tgt_lens + 1, TokenBounds(600, 600), seed=1)  # noqa: E731
    for epoch in (0, 1):
        ref, got = make(train), make(one_train)
        ref.set_epoch(epoch)
        got.set_epoch(epoch)
        assert [b.tolist() for b in ref.epoch_batches()] == [b.tolist() for b in got.epoch_batches()]


@pytest.mark.parametrize("spec, message", [
    ("a.en,a.de", "expected NAME=SRC,TGT"),
    ("bt=a.en", "expected NAME=SRC,TGT"),
    ("bt=,a.de", "expected NAME=SRC,TGT"),
    ("bt=a.en,a.de,half", "the weight 'half' is not a number"),
    ("bt=a.en,a.de,-1", "the weight must be a number >= 0"),
    ("bt=a.en,a.de,nan", "the weight must be a number >= 0"),
    ("bt=a.en,a.de,1,<b\u2581t>", "the tag must be one word"),
    ("bt=a.en,a.de,1,<bt>,d e", "a language code"),
    ("bt=a.en,a.de,1,<bt>,de,x", "at most 5"),
    ("b t=a.en,a.de", "corpus name 'b t'"),
])
def test_malformed_corpus_spec_names_the_argument(spec, message):
    with pytest.raises(UserError, match="--corpus") as exc:
        parse_corpus(spec)
    assert message in str(exc.value) and repr(spec) in str(exc.value)


def test_corpus_spec_fields():
    c = parse_corpus("bt=mono.en,mono.de,0.5,<bt>")
    assert (c.name, str(c.src), str(c.tgt), c.weight, c.tag, c.lang) == ("bt", "mono.en", "mono.de", 0.5, "<bt>", "")
    assert parse_corpus("fr=x.en,x.fr,,,fr").source_tokens() == ["<2fr>"]
    assert parse_corpus("x=a,b").source_tokens("de") == ["<2de>"] and parse_corpus("x=a,b,3").weight == 3
    with pytest.raises(UserError, match="given more than once"):
        check_corpora([parse_corpus("x=a,b"), parse_corpus("x=c,d")])
    with pytest.raises(UserError, match="every weight is 0"):
        check_corpora([parse_corpus("x=a,b,0")])


def test_cli_corpus_errors_and_prepare(tmp_path, small_train, train_lines, capsys):
    rc = main(["prepare", "--corpus", "bt=mono.en", "--out", str(tmp_path / "o")])
    assert rc == 2 and "--corpus 'bt=mono.en': expected NAME=SRC,TGT" in capsys.readouterr().err
    rc = main(["prepare", "--out", str(tmp_path / "o")])
    assert rc == 2 and "--train-src and --train-tgt, or --corpus" in capsys.readouterr().err
    rc = main(["prepare", "--train-src", str(small_train.src), "--train-tgt", str(small_train.tgt),
               "--corpus", f"bt={tmp_path / 'missing.en'},{small_train.tgt}", "--out", str(tmp_path / "o")])
    assert rc == 2 and "missing.en: no such file (--corpus bt source)" in capsys.readouterr().err
    short = write_lines(tmp_path / "short.de", train_lines[1][:1500])
    rc = main(["prepare", "--train-src", str(small_train.src), "--train-tgt", str(small_train.tgt),
               "--corpus", f"bt={small_train.src},{short},0.5,<bt>", "--vocab-size", "500", "--num-workers", "1",
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{short}:1501: source and target line counts differ" in err
    assert not (tmp_path / "o").exists()
    rc = main(["prepare", "--train-src", str(small_train.src), "--train-tgt", str(small_train.tgt),
               "--corpus", f"bt={small_train.src},{small_train.tgt},0.5,<bt>", "--vocab-size", "500",
               "--num-workers", "1", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert rc == 0 and "  train: " in out and "weight 0.5, tag <bt>" in out
    corpora = json.loads((tmp_path / "o" / "manifest.json").read_text())["splits"]["train"]["corpora"]
    assert [(c["name"], c["weight"], c["tag"]) for c in corpora] == [("train", 1, ""), ("bt", 0.5, "<bt>")]


@pytest.mark.slow
def test_training_draws_each_epoch_and_resumes_it(tmp_path, train_lines):
    """A run on weighted corpora trains each epoch's draw once (target tokens of the view, EOS
    included); stopped at an epoch boundary and resumed, it trains the next epoch's draw whole."""
    en, de = train_lines
    a = Corpus("a", write_lines(tmp_path / "a.en", en[:120]), write_lines(tmp_path / "a.de", de[:120]), weight=2)
    bt = Corpus("bt", write_lines(tmp_path / "b.en", en[120:220]), write_lines(tmp_path / "b.de", de[120:220]),
                weight=0.5, tag="<bt>")
    prepare({}, tmp_path / "data", replace(SMALL, vocab_size=300), corpora=[a, bt])
    d = DataDir(tmp_path / "data")
    mix = corpus_mix(d, d.split("train"), seed=1)

    def run(epochs):
        argv = ["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--preset", "tiny",
                "--no-progress", "--max-steps", "10000"]
        for kv in ("train.save_every_min=0", "train.validate_every_steps=0", "train.precision=fp32",
                   "train.threads=1", "train.max_src_tokens=1000", "train.max_tgt_tokens=1000",
                   "train.c_kernels=false", "train.seed=1", f"train.max_epochs={epochs}"):
            argv += ["--set", kv]
        assert main(argv) == 0
        return json.loads((tmp_path / "run" / "summary.json").read_text())

    tokens = []
    for epoch in (0, 1):
        mix.set_epoch(epoch)
        tokens.append(int(mix.tgt_lens.sum()) + len(mix))
    first = run(1)
    assert first["stop_reason"] == "max_epochs" and first["target_tokens"] == tokens[0]
    resumed = run(2)                                  # its checkpoint stands at epoch 1's start
    assert resumed["target_tokens"] == tokens[0] + tokens[1] and resumed["epochs"] == 2
