"""aiayn import trusts no file of the directory (aiayn/interop/marian_dir.py): sizes beyond the limits every
checkpoint load applies are refused before the weights are read, and bad input of any file ends
in one line naming it, never a traceback. Each case edits a copy of the OPUS-MT-style directory
of tests/interop/test_hf_import.py."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.errors import UserError
from aiayn.model.config import LIMITS

pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from aiayn.interop.hf_import import import_hf  # noqa: E402
from tests.interop.test_hf_import import marian_dir  # noqa: E402, F401 (the fixture)


def copy_of(marian_dir: Path, tmp_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(marian_dir, d)
    return d


def set_config(**changes):
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **changes}))
    return edit


def write(name: str, data: str | bytes):
    def edit(d: Path) -> None:
        (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return edit


def torch_weights(obj):
    """pytorch_model.bin holding ``obj`` in place of model.safetensors."""
    def edit(d: Path) -> None:
        (d / "model.safetensors").unlink()
        torch.save(obj, d / "pytorch_model.bin")
    return edit


def string_id(d: Path) -> None:
    vocab = json.loads((d / "vocab.json").read_text(encoding="utf-8"))
    (d / "vocab.json").write_text(json.dumps({**vocab, "</s>": "0"}), encoding="utf-8")


def separate_vocabs(d: Path) -> None:
    """tokenizer_config.json saying the target side has its own vocabulary, which is not there."""
    config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "separate_vocabs": True}), encoding="utf-8")
    (d / "target_vocab.json").unlink(missing_ok=True)


# case -> (the edit, the file its one line names)
BAD_INPUTS = {
    "weights a pickle naming code": (torch_weights({"w": argparse.Namespace()}), "pytorch_model.bin"),
    "weights random bytes": (write("model.safetensors", bytes(range(256)) * 8), "model.safetensors"),
    "weights a list": (torch_weights([torch.zeros(2)]), "pytorch_model.bin"),
    "weights of integers": (torch_weights({"model.shared.weight": torch.zeros(2, 2, dtype=torch.long)}),
                            "pytorch_model.bin"),
    "config.json a list": (write("config.json", "[1, 2]"), "config.json"),
    "config.json not JSON": (write("config.json", "{model_type: marian"), "config.json"),
    "0 heads": (set_config(encoder_attention_heads=0, decoder_attention_heads=0), "config.json"),
    "decoder_layers null": (set_config(decoder_layers=None), "config.json"),
    "d_ff not the weights'": (set_config(encoder_ffn_dim=48, decoder_ffn_dim=48), "model.safetensors"),
    "d_model not the weights'": (set_config(d_model=64), "model.safetensors"),
    "dropout a string": (set_config(dropout="0.1"), "config.json"),
    "vocab_size not the weights'": (set_config(vocab_size=7, decoder_vocab_size=7), "model.safetensors"),
    "source.spm empty": (write("source.spm", b""), "source.spm"),
    "target.spm empty": (write("target.spm", b""), "target.spm"),
    "pad id outside the vocabulary": (set_config(pad_token_id=10 ** 6), "vocab.json"),
    "vocab.json a list": (write("vocab.json", '["</s>", "<unk>"]'), "vocab.json"),
    "vocab.json a string id": (string_id, "vocab.json"),
    "generation_config.json a list": (write("generation_config.json", "[]"), "generation_config.json"),
    "num_beams a string": (write("generation_config.json", '{"num_beams": "4"}'), "generation_config.json"),
    "tokenizer_config.json a list": (write("tokenizer_config.json", "[]"), "tokenizer_config.json"),
    "separate_vocabs without target_vocab.json": (separate_vocabs, "target_vocab.json"),
    "no config.json": (lambda d: (d / "config.json").unlink(), "config.json"),
    "no vocab.json": (lambda d: (d / "vocab.json").unlink(), "vocab.json"),
    "no source.spm": (lambda d: (d / "source.spm").unlink(), "source.spm"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "model.safetensors"),
    "config.json without model_type": (write("config.json", '{"model": {"d_model": 512}}'), "config.json"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_ends_in_one_line_naming_the_file(marian_dir, tmp_path, capsys, case):  # noqa: F811
    edit, name = BAD_INPUTS[case]
    d = copy_of(marian_dir, tmp_path)
    edit(d)
    capsys.readouterr()
    out = tmp_path / "model.pt"
    assert main(["import", "--format", "hf", str(d), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"aiayn import: error: {d}") and name in err, err
    assert not out.exists()


def _limit(field: str) -> str:
    lo, hi = LIMITS[field]
    return f"outside [{lo:,}, {hi:,}]"


@pytest.mark.parametrize("changes, says", [
    ({"encoder_layers": 10 ** 9}, f"encoder_layers: n_layers = 1000000000: {_limit('n_layers')}"),
    ({"decoder_layers": 1e9}, f"decoder_layers: n_dec_layers = 1000000000.0: {_limit('n_dec_layers')}"),
    ({"max_position_embeddings": 2 ** 21}, f"max_positions = 2097152: {_limit('max_positions')}"),
    ({"max_position_embeddings": 2 ** 20, "d_model": 512}, "max_positions x d_model = 536,870,912 values exceeds"),
    ({"encoder_ffn_dim": 2 ** 21}, f"encoder_ffn_dim: d_ff = 2097152: {_limit('d_ff')}"),
    ({"vocab_size": 2 ** 22}, f"vocab_size: vocab_size = 4194304: {_limit('vocab_size')}"),
])
def test_sizes_beyond_the_checkpoint_limits_are_refused_before_the_weights_are_read(
        marian_dir, tmp_path, monkeypatch, changes, says):  # noqa: F811
    """The limits of ``aiayn.model.config.LIMITS`` (what every checkpoint load checks), named by
    config.json's field, before any weight is read or any table built: a loop over 10^9 layers or
    a 2^20 x 512 position table never starts, and 2^21 positions never make a checkpoint that
    translate would refuse."""
    d = copy_of(marian_dir, tmp_path)
    set_config(**changes)(d)

    def unread(*args):
        raise AssertionError("the weights were read before config.json's sizes were checked")
    monkeypatch.setattr("aiayn.interop.marian_dir.read_weights", unread)
    with pytest.raises(UserError) as err:
        import_hf(d)
    assert str(err.value).startswith(f"{d / 'config.json'}: ") and says in str(err.value), str(err.value)
