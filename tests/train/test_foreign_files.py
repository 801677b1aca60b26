"""Another toolkit's file given where an aiayn checkpoint is expected (docs/migrating.md): a fairseq
or OpenNMT-py checkpoint, a bare state dict, Marian's model.npz, a safetensors file, a Hugging Face
model folder. Each is one line naming the file and what it is, from ``load_checkpoint`` and from
the commands (aiayn/checkpoint/foreign.py)."""
from __future__ import annotations

import argparse
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train.test_checkpoints import refused_by_every_reader

WEIGHTS = OrderedDict({"encoder.embed_tokens.weight": torch.zeros(4, 2)})


def fairseq_hydra(p: Path) -> None:
    """fairseq's checkpoint_utils layout, its cfg a plain dict (what weights_only reads)."""
    torch.save({"args": None, "cfg": {"model": {"_name": "transformer"}}, "model": WEIGHTS, "criterion": {},
                "optimizer_history": [], "task_state": {}, "extra_state": {"epoch": 3}}, p)


def fairseq_args(p: Path) -> None:
    """fairseq before its Hydra configs: the options as argparse.Namespace."""
    torch.save({"args": argparse.Namespace(arch="transformer"), "model": WEIGHTS, "optimizer_history": [],
                "extra_state": {}}, p)


def opennmt(p: Path) -> None:
    torch.save({"model": WEIGHTS, "generator": {}, "vocab": {}, "opt": argparse.Namespace(enc_layers=6),
                "optim": None}, p)


def marian_npz(p: Path) -> None:
    with open(p, "wb") as f:
        np.savez(f, Wemb=np.zeros((4, 2), dtype=np.float32), encoder_l1_self_Wq=np.zeros((2, 2), dtype=np.float32))


def safetensors(p: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    p.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))


def hf_folder(p: Path) -> None:
    p.mkdir()
    (p / "config.json").write_text('{"model_type": "marian"}')
    safetensors(p / "model.safetensors")


@pytest.mark.parametrize("make, said", [
    (fairseq_hydra, "a fairseq checkpoint, not an aiayn checkpoint; aiayn reads the checkpoints it writes"),
    (fairseq_args, "not an aiayn checkpoint: it keeps options as argparse.Namespace, as fairseq's and OpenNMT-py's"),
    (opennmt, "not an aiayn checkpoint: it keeps options as argparse.Namespace, as fairseq's and OpenNMT-py's"),
    (lambda p: torch.save({"opt": {}, "vocab": {}, "model": WEIGHTS, "generator": {}}, p),
     "an OpenNMT-py checkpoint, not an aiayn checkpoint"),
    (lambda p: torch.save(WEIGHTS, p), "a bare state dict of 1 tensors: weights without a configuration"),
    (marian_npz, "a numpy .npz archive of 2 arrays (Marian's model.npz?), not a checkpoint"),
    (safetensors, "a safetensors file (a Hugging Face model's weights?), not a checkpoint"),
    (hf_folder, "a Hugging Face model folder, not a checkpoint file: `aiayn import "),
])
def test_another_toolkits_file_says_what_it_is(make, said, tmp_path, capsys):
    path = tmp_path / "model.pt"
    make(path)
    err = refused_by_every_reader(path, said, tmp_path, capsys)
    assert err.startswith(f"aiayn translate: error: {path}: {said}") and err.count("\n") == 1, err
