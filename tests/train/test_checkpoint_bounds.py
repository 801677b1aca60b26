"""Checkpoints as untrusted input, second pass: the converter never seals damage, a configuration
is checked against bounds and against the stored weights before any model is built from it, a
tokenizer's bytes are size-capped before SentencePiece parses them, and loading refuses a torch
whose ``weights_only`` could run code."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import aiayn
from aiayn import checkpoint as ck
from aiayn.cli import main
from aiayn.config import to_dict
from aiayn.data import vocab
from aiayn.errors import UserError
from tests.train.test_checkpoints import _flip_a_tensor_bit, _handmade

ROOT = Path(__file__).resolve().parents[2]


def test_upgrade_refuses_a_damaged_file_instead_of_sealing_it(tmp_path, capsys):
    path, out = tmp_path / "c.pt", tmp_path / "new.pt"
    ck.atomic_save(_handmade(), path)
    _flip_a_tensor_bit(path)
    assert main(["upgrade-checkpoint", str(path), "--out", str(out)]) == 2
    assert f"{path}: damaged" in capsys.readouterr().err and not out.exists()
    # an edited value (the file rewritten without a new seal) is refused as well, in place too
    ck.atomic_save(_handmade(), path)
    edited = {**torch.load(path, weights_only=True), "step": 99}
    torch.save(edited, path)
    before = path.read_bytes()
    assert main(["upgrade-checkpoint", str(path)]) == 2
    assert "damaged" in capsys.readouterr().err and path.read_bytes() == before



def _nan_weight(ckpt: dict) -> str:
    ckpt["model"]["src_embed.weight"][0, 0] = float("nan")
    return "holds NaN or infinite values"


def _positions_out_of_bounds(ckpt: dict) -> str:
    ckpt["model_config"]["max_positions"] = 10 ** 9
    return "model_config.max_positions = 1000000000"


@pytest.mark.parametrize("spoil", [_nan_weight, _positions_out_of_bounds])
def test_upgrade_refuses_before_it_writes(tmp_path, capsys, spoil):
    """An older file (no checksum) that loading would refuse once converted: the converter refuses it
    before it writes, so an input converted in place keeps its bytes and its modification time, and
    no --out is made."""
    path, out = tmp_path / "old.pt", tmp_path / "new.pt"
    old = _handmade()
    said = spoil(old)
    torch.save(old, path)
    before, stat = path.read_bytes(), path.stat()
    assert main(["upgrade-checkpoint", str(path)]) == 2
    assert f"{path}: " in (err := capsys.readouterr().err) and said in err, err
    assert path.read_bytes() == before and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert path.stat().st_ino == stat.st_ino  # not replaced by a file of the same bytes
    assert main(["upgrade-checkpoint", str(path), "--out", str(out)]) == 2
    assert said in capsys.readouterr().err and not out.exists()
    assert not list(tmp_path.glob(".*aiayn-tmp*"))


def _sealed_with(tmp_path: Path, **model_config) -> Path:
    state = _handmade()
    state["model_config"] = {**state["model_config"], **model_config}
    path = tmp_path / "c.pt"
    ck.atomic_save(state, path)
    return path


@pytest.mark.parametrize("field, value", [("max_positions", 10 ** 9), ("d_ff", 1 << 40), ("n_layers", 100_000),
                                          ("n_heads", 0), ("vocab_size", -1), ("d_model", "512"),
                                          ("eos_id", 10)])
def test_a_configuration_out_of_bounds_is_refused_before_any_model_is_built(tmp_path, monkeypatch, field, value):
    path = _sealed_with(tmp_path, **{field: value})

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built from the configuration")
    monkeypatch.setattr(aiayn.model.Transformer, "__init__", no_model)
    with pytest.raises(UserError, match=re.escape(f"{path}: model_config.{field} = {value!r}")):
        ck.load_checkpoint(path)


def test_a_positional_table_too_large_for_the_width_is_refused(tmp_path):
    path = _sealed_with(tmp_path, max_positions=1 << 20, d_model=1024, d_k=128, d_v=128)
    with pytest.raises(UserError, match="max_positions = 1,048,576: its table"):
        ck.load_checkpoint(path)


def test_a_configuration_must_describe_the_stored_weights(tmp_path, capsys):
    """d_ff 2^20 is within bounds, but the file stores the tiny model's 256: refused before a
    model of that size is allocated (translate, export, average: every reader)."""
    path = _sealed_with(tmp_path, d_ff=1 << 20)
    with pytest.raises(UserError, match=f"{path}: model_config does not describe the stored weights: "
                                        f"encoder_layers.0.ffn.w1.weight \\(256, 64\\) stored, \\(1048576, 64\\)"):
        ck.load_checkpoint(path)
    (tmp_path / "in.txt").write_text("a\n")
    assert main(["translate", "--checkpoint", str(path), "--input", str(tmp_path / "in.txt")]) == 2
    assert "does not describe the stored weights" in capsys.readouterr().err


def test_an_ensemble_member_is_checked_too(tmp_path):
    good = tmp_path / "good.pt"
    ck.atomic_save(_handmade(), good)
    ens = ck.ensemble_checkpoint([good])
    ens["members"][0]["model_config"]["n_layers"] = 10 ** 6
    ck.atomic_save(ens, tmp_path / "ens.pt")
    with pytest.raises(UserError, match=r"ens.pt \(member 0\): model_config.n_layers"):
        ck.load_checkpoint(tmp_path / "ens.pt", ensemble_ok=True)


@pytest.mark.parametrize("members", [[1, 2], "ab", {"a": {}}])
@pytest.mark.parametrize("seal", [True, False])
def test_an_ensemble_file_whose_members_are_not_checkpoints_is_one_line(members, seal, tmp_path, capsys):
    """A file that says it is an ensemble but whose members are not a list of checkpoint dicts: one line
    naming it from every reader (a sealed one, and one without a checksum that the converter reads)."""
    path = tmp_path / "ens.pt"
    body = {"format": ck.ENSEMBLE_FORMAT, "members": members}
    torch.save(ck.sealed(body) if seal else body, path)
    said = f"{path}: not an aiayn ensemble file: its members are not a list of checkpoints (what aiayn ensemble writes)"
    for argv in (["upgrade-checkpoint", str(path), "--out", str(tmp_path / "new.pt")],
                 ["ensemble", str(path), "--out", str(tmp_path / "e.pt")]):
        assert main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"aiayn {argv[0]}: error: {said}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ens.pt"]


@pytest.mark.parametrize("cut", [22, 9, 1, "half", 5000, 100])
def test_a_checkpoint_cut_short_says_so(cut, tmp_path, capsys):
    """A checkpoint file cut short anywhere (a copy or a download that stopped: here its last ``cut``
    bytes gone, or all but its first ``cut``) is named as cut short by every reader, not by torch's
    "Invalid argument" or "failed finding central directory"."""
    whole = tmp_path / "whole.pt"
    ck.atomic_save(_handmade(), whole)
    data = whole.read_bytes()
    kept = {"half": len(data) // 2, 5000: 5000, 100: 100}.get(cut, len(data) - cut if isinstance(cut, int) else 0)
    path = tmp_path / "cut.pt"
    path.write_bytes(data[:kept])
    said = (f"{path}: not a readable checkpoint (its zip archive has no end record in its last 64 KiB: cut short by "
            f"a copy, a download or a write that stopped early, or followed by other bytes); use another copy or an "
            f"earlier checkpoint")
    for read in (ck.load_checkpoint, lambda p: ck.upgrade_checkpoint(p, tmp_path / "new.pt")):
        with pytest.raises(UserError) as error:
            read(path)
        assert str(error.value) == said
    assert main(["ensemble", str(path), "--out", str(tmp_path / "e.pt")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"aiayn ensemble: error: {said}"]
    ck.load_checkpoint(whole)  # the whole file reads


def test_the_presets_are_within_bounds():
    from aiayn.model.config import PRESETS, check_limits
    for name in PRESETS:
        check_limits(to_dict(aiayn.get_preset(name)))


def test_tokenizer_bytes_are_capped_before_parsing(tmp_path, monkeypatch):
    monkeypatch.setattr(vocab, "MAX_MODEL_BYTES", 1000)

    def no_parse(*args):
        raise AssertionError("SentencePiece parsed it")
    monkeypatch.setattr(vocab.spm.SentencePieceProcessor, "LoadFromSerializedProto", no_parse)
    with pytest.raises(UserError, match="model.spm: a tokenizer model of 1,001 bytes; the limit is 1,000"):
        vocab.Tokenizer(b"\0" * 1001, name="model.spm")
    big = tmp_path / "big.model"
    big.write_bytes(b"\0" * 5000)
    with pytest.raises(UserError, match=f"{big}: a tokenizer model of 1,001 bytes"):  # read no further
        vocab.Tokenizer.load(big)


def test_torch_before_2_6_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    ck.atomic_save(_handmade(), path)
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    with pytest.raises(UserError, match="torch 2.5.1\\+cpu can run code hidden in a checkpoint.*torch>=2.6"):
        ck.load_checkpoint(path)
    ck.check_torch("2.6.0")
    ck.check_torch("2.13.0+cu128")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_the_torch_floor_is_the_safe_one_and_the_cpu_pin_meets_it():
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(re.fullmatch(r"torch>=([\d.]+)", d).group(1) for d in deps if d.startswith("torch"))
    assert _version(floor)[:2] >= ck.SAFE_TORCH
    pin = re.search(r"^torch==([\d.]+)$", (ROOT / "constraints" / "cpu.txt").read_text(), re.M).group(1)
    assert _version(pin) >= _version(floor)
