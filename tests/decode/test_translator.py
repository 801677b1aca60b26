"""Translator and `aiayn translate` on a tiny random-weight checkpoint with a real tokenizer."""
from __future__ import annotations

import hashlib
import io
import json
import random

import numpy as np
import pytest
import torch

import aiayn.model as M
from aiayn.cli import main
from aiayn.config import to_dict
from aiayn.data.vocab import SentencePieceSpec, Tokenizer, train_sentencepiece
from aiayn.decode.config import DecodeConfig
from aiayn.decode.loading import load_model_for_inference
from aiayn.decode.translator import Translator
from aiayn.errors import InputError, UserError
from aiayn.checkpoint import FORMAT, atomic_save, load_checkpoint
from tests.arith import softmax_sum_bound

LINES = ["the house is small", "", "a cat sat on the mat today", "small", "the cat is in the small house"]


@pytest.fixture(scope="session")
def spm_bytes(tmp_path_factory) -> bytes:
    rnd = random.Random(0)
    words = "the a house cat mat sat on is in small big today dog garden red".split()
    sents = [" ".join(rnd.choice(words) for _ in range(rnd.randint(3, 9))) for _ in range(300)]
    path = train_sentencepiece(sents, tmp_path_factory.mktemp("spm") / "spm",
                               SentencePieceSpec(vocab_size=64, model_type="bpe", character_coverage=1.0),
                               num_threads=1)
    return path.read_bytes()


def make_checkpoint(path, spm: bytes, **model_overrides) -> str:
    torch.manual_seed(0)
    cfg = M.get_preset("tiny", vocab_size=Tokenizer(spm).vocab_size, p_drop=0.0, **model_overrides)
    sha = hashlib.sha256(spm).hexdigest()
    ckpt = {"format": FORMAT, "model_config": to_dict(cfg), "model": M.Transformer(cfg).state_dict(),
            "tokenizers": {"src": spm, "tgt": spm, "src_sha256": sha, "tgt_sha256": sha, "shared": True}}
    atomic_save(ckpt, path)
    return str(path)


@pytest.fixture
def ckpt(tmp_path, spm_bytes) -> str:
    return make_checkpoint(tmp_path / "tiny.pt", spm_bytes)


def test_an_older_checkpoint_with_execution_settings_in_its_model_config_translates(tmp_path, spm_bytes, ckpt):
    """A checkpoint of an older version, whose model_config held ``fast_dropout`` and ``attn_fp32``
    (the run's settings now), loads and translates as today's."""
    old = torch.load(ckpt, weights_only=True)
    old.pop("sha256", None)
    old["model_config"] = {**old["model_config"], "fast_dropout": True, "attn_fp32": False}
    atomic_save(old, tmp_path / "old.pt")
    cfg = DecodeConfig(max_len_b=3)
    assert Translator.from_checkpoint(str(tmp_path / "old.pt"), cfg).translate(LINES) == \
        Translator.from_checkpoint(ckpt, cfg).translate(LINES)


def test_translate_keeps_input_order_and_matches_one_by_one(ckpt):
    cfg = DecodeConfig(max_len_b=3, batch_tokens=16)  # several batches
    tr = Translator.from_checkpoint(ckpt, cfg)
    assert len(tr.batches(tr.encode(LINES))) > 1
    out = tr.translate(LINES)
    assert len(out) == len(LINES) and out[1] == ""
    assert out == [tr.translate([line])[0] for line in LINES]
    nbest = Translator.from_checkpoint(ckpt, DecodeConfig(max_len_b=3, nbest=3)).translate_nbest(LINES)
    assert nbest[1] == [] and all(len(ts) == 3 for k, ts in enumerate(nbest) if k != 1)
    assert all(ts[0].score >= ts[1].score >= ts[2].score for ts in nbest if ts)
    # the pool of 3 only delays the stop; it cannot change the best hypothesis (exact bound)
    assert [ts[0].text if ts else "" for ts in nbest] == out


def test_one_string_for_the_list_of_lines_is_refused(ckpt):
    """A str is a sequence of characters: it was translated as one sentence per character."""
    tr = Translator.from_checkpoint(ckpt, DecodeConfig(max_len_b=3))
    with pytest.raises(UserError, match="a list of lines, not one string"):
        tr.translate("the cat sat")
    with pytest.raises(UserError, match="prefixes: a list of lines"):
        tr.translate(["the cat sat"], prefixes="the")
    assert len(tr.translate(["the cat sat"])) == 1


def test_a_line_that_is_not_text_is_refused_naming_it(ckpt):
    """Not an AttributeError from deep inside the tokenizer's preparation of the lines."""
    tr = Translator.from_checkpoint(ckpt, DecodeConfig(max_len_b=3))
    with pytest.raises(UserError, match=r"lines\[1\]: a line of text \(str\), got NoneType"):
        tr.translate(["the cat sat", None])
    with pytest.raises(UserError, match=r"prefixes\[0\]: a line of text \(str\), got int"):
        tr.translate(["the cat sat"], prefixes=[3])
    assert len(tr.translate(line for line in ["the cat sat", "small"])) == 2  # any iterable of lines


def test_batches_are_token_bounded_and_longest_first(ckpt):
    tr = Translator.from_checkpoint(ckpt, DecodeConfig(batch_tokens=12))
    ids = [[5] * 3, [], [5] * 6, [5] * 2, [5] * 4, [5] * 13]
    batches = tr.batches(ids)
    assert sorted(i for b in batches for i in b) == [0, 2, 3, 4, 5]
    assert batches[0] == [5]  # alone: longer than the bound
    for b in batches[1:]:
        assert len(b) * max(len(ids[i]) for i in b) <= 12
    assert batches[1] == [2, 4]  # 2 x 6 tokens


def test_too_long_line_is_an_error_naming_the_line(ckpt, tmp_path, spm_bytes):
    tr = Translator.from_checkpoint(ckpt, DecodeConfig(max_input_tokens=6))
    with pytest.raises(InputError, match=r"in.txt:12: .*exceed the limit of 6"):
        tr.translate(["small", "the cat is in the small house today"], source="in.txt", first_line=11)
    learned = make_checkpoint(tmp_path / "learned.pt", spm_bytes, learned_positions=True, max_positions=8)
    tr = Translator.from_checkpoint(learned, DecodeConfig())
    assert tr.input_limit == 8 and tr.output_cap == 8
    with pytest.raises(InputError, match=r"<input>:1: .*limit of 8"):
        tr.translate(["the cat is in the small house today the cat"])
    assert all(len(ts[0].tokens) <= 8 for ts in tr.translate_nbest(["small house"]))


def test_a_prefix_with_no_room_for_eos_in_learned_positions_is_an_error(tmp_path, spm_bytes):
    """With max_positions 8 the output holds 8 tokens: a prefix of 7 and EOS. The search cut a longer
    one, so the translation did not begin with it as docs/translate.md says it does."""
    learned = make_checkpoint(tmp_path / "learned.pt", spm_bytes, learned_positions=True, max_positions=8)
    tr = Translator.from_checkpoint(learned, DecodeConfig(beam_size=1))
    fits, over = tr.tgt_tok.decode([5] * 7), tr.tgt_tok.decode([5] * 9)
    assert len(tr.tgt_tok.encode(fits)) == 7 and len(tr.tgt_tok.encode(over)) >= 8
    out = tr.translate_nbest(["small house"], prefixes=[fits])[0][0].tokens
    assert list(out[:7]) == tr.encode_prefixes([fits])[0]
    with pytest.raises(InputError, match=r"in.txt:5: the prefix has \d+ target tokens; the model's learned positions "
                                         r"\(max_positions 8\) leave room for 7 and EOS"):
        tr.translate_nbest(["small", "small house"], source="in.txt", first_line=4, prefixes=["", over])


def test_the_service_answers_such_a_prefix_422(tmp_path, spm_bytes):
    from fastapi.testclient import TestClient

    from aiayn.serve.app import create_app
    from aiayn.serve.config import ServeConfig
    learned = make_checkpoint(tmp_path / "learned.pt", spm_bytes, learned_positions=True, max_positions=8)
    tr = Translator.from_checkpoint(learned, DecodeConfig(beam_size=1))
    over = tr.tgt_tok.decode([5] * 9)
    with TestClient(create_app(tr, ServeConfig(threads=1, client_requests_per_s=0.0)),
                    base_url="http://localhost") as client:
        r = client.post("/translate", json={"sentences": ["small", "house"], "prefix": ["", over]})
        assert r.status_code == 422 and r.json()["error"].startswith("prefix[1]: the prefix has ")
        assert client.post("/translate", json={"sentences": ["small"], "prefix": [tr.tgt_tok.decode([5] * 7)]}) \
            .status_code == 200


def test_checkpoint_errors(tmp_path, spm_bytes, ckpt):
    with pytest.raises(UserError, match="not found"):
        load_model_for_inference(tmp_path / "missing.pt")
    bad = load_checkpoint(ckpt)
    bad["tokenizers"]["tgt_sha256"] = "0" * 64
    atomic_save(bad, tmp_path / "bad_hash.pt")
    with pytest.raises(UserError, match="does not match its sha256"):
        load_model_for_inference(tmp_path / "bad_hash.pt")
    bad = load_checkpoint(ckpt)
    bad["model_config"]["vocab_size"] += 1
    atomic_save(bad, tmp_path / "bad_vocab.pt")
    with pytest.raises(UserError, match="does not describe the stored weights"):
        load_model_for_inference(tmp_path / "bad_vocab.pt")
    bad = load_checkpoint(ckpt)
    del bad["tokenizers"]
    atomic_save(bad, tmp_path / "no_tok.pt")
    with pytest.raises(UserError, match="no 'tokenizers' entry"):
        load_model_for_inference(tmp_path / "no_tok.pt")


def test_attention_weights_shapes(ckpt):
    tr = Translator.from_checkpoint(ckpt, DecodeConfig(max_len_b=4))
    ids = tr.encode(["the house"])[0]
    [t] = tr.translate_nbest(["the house"])[0]
    att = tr.attention(ids, t.tokens, t.eos)
    T, S = len(t.tokens) + int(t.eos), len(ids)
    assert att["cross"].shape == (2, 4, T, S) and att["encoder"].shape == (2, 4, S, S)
    assert att["decoder_self"].shape == (2, 4, T, T)
    assert (np.abs(att["cross"].sum(-1) - 1.0) <= float(softmax_sum_bound(S))).all()  # each row a softmax over S keys
    assert len(att["src_tokens"]) == S and att["src_tokens"][-1] == "</s>"
    # decoder self-attention's keys are the decoder's inputs: BOS, then the outputs shifted by one
    assert att["tgt_in_tokens"] == [tr.tgt_tok.piece(tr.ids.bos)] + att["tgt_tokens"][:-1]
    # an empty source (no ids, not even EOS) is a (1, 0) batch of ids, not a float tensor the embedding refuses
    empty = tr.attention([], [], False)
    assert empty["encoder"].shape == (2, 4, 0, 0) and empty["cross"].shape == (2, 4, 1, 0)


def test_cli_translate(ckpt, tmp_path, capsys, monkeypatch):
    (tmp_path / "in.txt").write_text("\n".join(LINES) + "\n")
    expected = Translator.from_checkpoint(ckpt, DecodeConfig(max_len_b=3)).translate(LINES)
    args = ["translate", "--checkpoint", ckpt, "--input", str(tmp_path / "in.txt"), "--max-len-b", "3"]
    assert main(args + ["--attention-out", str(tmp_path / "att.json")]) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == expected
    att = json.loads((tmp_path / "att.json").read_text())
    assert [a["line"] for a in att] == [0, 2, 3, 4]
    assert main(args + ["--attention-out", str(tmp_path / "att.npz"), "--nbest", "2", "--beam-size", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 8 and out[0].startswith("0 ||| ") and out[2].startswith("2 ||| ")
    assert np.load(tmp_path / "att.npz")["4_cross"].ndim == 4
    assert np.load(tmp_path / "att.npz")["4_tgt_in_tokens"].shape == np.load(tmp_path / "att.npz")["4_tgt_tokens"].shape
    monkeypatch.setattr("sys.stdin", io.StringIO("small\n\n"))
    assert main(["translate", "--checkpoint", ckpt, "--max-len-b", "3"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == [expected[3], ""]
    assert main(args + ["--max-input-tokens", "5", "--long-lines", "error"]) == 2
    assert "in.txt:3:" in capsys.readouterr().err
    assert main(["translate", "--checkpoint", ckpt, "--input", str(tmp_path / "nope.txt")]) == 2
    assert "nope.txt: no such file" in capsys.readouterr().err
    assert main(args + ["--nbest", "9"]) == 2


def test_inference_device_auto_and_clear_errors(monkeypatch):
    """``--device auto`` (translate, evaluate, serve, parse, the demo) is CUDA when present, else the
    CPU; asking for CUDA where there is none, or for no device at all, is a clear error."""
    import torch

    from aiayn.decode.loading import inference_device
    from aiayn.errors import UserError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert inference_device("auto") == torch.device("cpu")
    assert inference_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="CUDA is not available"):
        inference_device("cuda:0")
    with pytest.raises(UserError, match="not a device"):
        inference_device("gpu-please")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert inference_device("auto") == torch.device("cuda")


def test_invalid_utf8_on_stdin_is_an_error_naming_the_line(ckpt, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"small\n\xff\xfe big\n"), encoding="utf-8"))
    assert main(["translate", "--checkpoint", ckpt, "--max-len-b", "3"]) == 2
    assert "<stdin>:2: invalid UTF-8 (byte 1 of the line" in capsys.readouterr().err


def test_input_dash_reads_stdin(ckpt, monkeypatch, capsys):
    """``--input -`` is stdin, as no --input is (the Unix convention fairseq-interactive users bring)."""
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"small\nbig\n"), encoding="utf-8"))
    assert main(["translate", "--checkpoint", ckpt, "--max-len-b", "3", "--input", "-"]) == 0
    dashed = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"small\nbig\n"), encoding="utf-8"))
    assert main(["translate", "--checkpoint", ckpt, "--max-len-b", "3"]) == 0
    assert dashed == capsys.readouterr().out and len(dashed.splitlines()) == 2
