"""Shared fixtures: a seed for every test, the location of ../shared/data, prepared data and trained
checkpoints, and int8 decoding on any CPU.

The data location comes from $AIAYN_SHARED_DATA, else ../shared/data beside the checkout.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    env = os.environ.get("AIAYN_SHARED_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def _caches_and_temporaries(tmp_path_factory):
    """Compiled kernels (aiayn/kernels/loader.py) go to a directory of this run, not ~/.cache/aiayn;
    so do torch.compile's (inductor's), whose cache in /tmp does not key its graphs on
    ``ATEN_CPU_CAPABILITY``: a run held to AVX2 after a native one (or the other way round) loaded the
    graphs compiled for the other and computed on corrupted memory (non-finite losses, or a crash in
    malloc). The processes the tests start make their temporaries in a folder of this run too
    (TMPDIR): torchrun leaves a folder in the system's temporary folder at every run."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmp")))
    mp.setenv("AIAYN_CACHE_DIR", str(tmp_path_factory.mktemp("aiayn-cache")))
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor-cache")))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


def int8_refusal() -> str | None:
    """Why decoding refuses precision int8 in this process (``require_int8_product``: no VNNI for
    oneDNN, and no C kernels with their AVX2 product, e.g. an Arm CPU or one without AVX2), else None."""
    from aiayn.decode.int8 import require_int8_product
    from aiayn.errors import UserError
    from aiayn.kernels.loader import load
    try:
        require_int8_product("int8", load())
    except UserError as e:
        return str(e)
    return None


@pytest.fixture
def int8_anywhere(monkeypatch):
    """Decoding in int8 on any CPU, in this process: the refusal where its products would be slower
    than fp32's (``require_int8_product``, a speed rule tested on its own:
    tests/kernels/test_beam_attention.py) lifted. The results are the
    same on every path: VNNI's ``torch._int_mm``, ``int8_gemm.c`` and ``int_mm_float`` all sum the
    int8 products exactly."""
    from aiayn.decode import loading
    monkeypatch.setattr(loading, "require_int8_product", lambda precision, kernels: None)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not path.is_dir():
        pytest.fail(f"shared data not found at {path}; set AIAYN_SHARED_DATA")
    return path


def _head_gz(src: Path, dst: Path, n: int) -> Path:
    import gzip
    with gzip.open(src, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(n)]
    dst.write_text("".join(lines), encoding="utf-8")
    return dst


@pytest.fixture(scope="session")
def small_data_dir(tmp_path_factory, shared_data) -> Path:
    """A prepared data directory for training tests: the first 2,000 Multi30k En-De train pairs,
    the first 100 val pairs as valid and test, shared BPE of 500 pieces."""
    from aiayn.cli import main
    raw = shared_data / "multi30k" / "raw"
    d = tmp_path_factory.mktemp("small_corpus")
    files = {}
    for split, name, n in (("train", "train", 2000), ("valid", "val", 100), ("test", "val", 100)):
        for side, lang in (("src", "en"), ("tgt", "de")):
            files[f"--{split}-{side}"] = str(_head_gz(raw / f"{name}.{lang}.gz", d / f"{split}.{lang}", n))
    out = d / "data"
    argv = ["prepare", "--vocab-size", "500", "--out", str(out), "--num-workers", "1"]
    for k, v in files.items():
        argv += [k, v]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, small_data_dir) -> Path:
    """A real checkpoint: the tiny preset trained for 3 steps on ``small_data_dir`` (fp32, 1 thread)."""
    from aiayn.cli import main
    out = tmp_path_factory.mktemp("tiny_run")
    argv = ["train", "--data", str(small_data_dir), "--out", str(out), "--preset", "tiny", "--max-steps", "3",
            "--no-progress", "--set", "train.save_every_min=0", "--set", "train.validate_every_steps=0",
            "--set", "train.precision=fp32", "--set", "train.threads=1", "--set", "train.max_src_tokens=600",
            "--set", "train.max_tgt_tokens=600"]
    assert main(argv) == 0
    path = out / "last.pt"
    assert path.is_file()
    return path


COPY_WORDS = "a b c d e f g h i j k l".split()  # one SentencePiece piece each ("▁a"): alignment i-i is known


CONFIDENT_MARGIN = 1.0  # nats; see confident_model


def copy_lines(n: int, seed: int) -> list[str]:
    """n random sentences of 3-8 one-letter words (the copy task's source and target)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(COPY_WORDS) for _ in range(rng.randint(3, 8))) for _ in range(n)]


@pytest.fixture(scope="session")
def copy_data_dir(tmp_path_factory) -> Path:
    """A prepared copy task (target = source): 3,000 train and 100 valid pairs, shared BPE of 29
    pieces (the 4 special ids, 13 characters, and the 12 words with their word boundary)."""
    from aiayn.cli import main
    d = tmp_path_factory.mktemp("copy_corpus")
    argv = ["prepare", "--vocab-size", "29", "--out", str(d / "data"), "--num-workers", "1"]
    for split, n, seed in (("train", 3000, 1), ("valid", 100, 2)):
        text = "\n".join(copy_lines(n, seed)) + "\n"
        for side in ("src", "tgt"):
            (d / f"{split}.{side}").write_text(text, encoding="utf-8")
            argv += [f"--{split}-{side}", str(d / f"{split}.{side}")]
    assert main(argv) == 0
    return d / "data"


COPY_TRAIN = ["--preset", "tiny", "--no-progress", "--set", "train.save_every_min=0",
              "--set", "train.validate_every_steps=0", "--set", "train.precision=fp32", "--set", "train.threads=1",
              "--set", "train.max_src_tokens=400", "--set", "train.max_tgt_tokens=400",
              "--set", "train.warmup_steps=30", "--set", "model.p_drop=0", "--set", "train.lr_scale=0.2",
              "--set", "train.eps_ls=0"]


@pytest.fixture(scope="session")
def copy_checkpoint(tmp_path_factory, copy_data_dir) -> Path:
    """The tiny preset (post-norm, d_k = d_model / h) trained 300 steps on the copy task: it copies
    unseen sentences, all but a few of them. (At 200 steps which sentences it copies moved with the
    last bits of the training arithmetic, one CPU's or one kernel's against another's.)"""
    from aiayn.cli import main
    out = tmp_path_factory.mktemp("copy_run")
    assert main(["train", "--data", str(copy_data_dir), "--out", str(out), "--max-steps", "300", *COPY_TRAIN]) == 0
    return out / "last.pt"


@pytest.fixture(scope="session")
def confident_model(copy_checkpoint):
    """The trained copy model (float32, eval) and 5 sources (B, S) it copies with wide margins: at
    every greedy step its best token leads the next by ``CONFIDENT_MARGIN`` nats or more (the first 5
    of 40 unseen sentences that do; which ones can depend on the roundings the model was trained
    with). For comparing paths that round differently (bfloat16, and bfloat16 emulated in float32 on
    CPUs without its instructions): rounding that moves log-probabilities by less than half that gap
    cannot change a decision, so such searches must agree token for token on any CPU; a random
    model's near-ties would make agreement depend on the instruction set."""
    from aiayn.decode.adapter import CachedDecoder
    from aiayn.decode.loading import load_model_for_inference
    from aiayn.decode.search import SpecialIds
    model, src_tok, _ = load_model_for_inference(copy_checkpoint)
    eos = SpecialIds().eos

    def batch(rows):
        src = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)  # (B, S), 0 = <pad>
        for b, row in enumerate(rows):
            src[b, :len(row)] = torch.tensor(row)
        return src

    rows = [src_tok.encode(line) + [eos] for line in copy_lines(40, seed=11)]
    src = batch(rows)
    with torch.inference_mode():  # greedy, teacher-forced on its own choices: each row's smallest lead
        dec = CachedDecoder(model)
        state, tokens = dec.start(src, src.size(1) + 1), torch.full((src.size(0),), SpecialIds().bos)
        live = torch.ones(src.size(0), dtype=torch.bool)  # (B,) rows that have not ended
        lead = torch.full((src.size(0),), float("inf"))  # (B,)
        for _ in range(src.size(1)):
            lp, state = dec.step(tokens, state)  # (B, V)
            top2 = lp.topk(2, dim=-1).values
            lead = torch.where(live, torch.minimum(lead, top2[:, 0] - top2[:, 1]), lead)
            tokens = lp.argmax(-1)
            live &= tokens != eos
    confident = [row for row, m in zip(rows, lead.tolist()) if m >= CONFIDENT_MARGIN][:5]
    assert len(confident) == 5, f"the copy model leads by {CONFIDENT_MARGIN} nats on only {len(confident)} of 40"
    return model, batch(confident)


@pytest.fixture(scope="session")
def untrained_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of the tiny preset, untrained, with a copy-task tokenizer of 29 pieces (300
    sentences): for what needs a real checkpoint file but no trained model (a second or two)."""
    import aiayn
    from aiayn import checkpoint as ck
    from aiayn.config import to_dict
    from aiayn.data.dataset import DataDir
    from aiayn.data.prepare import PrepareConfig, SplitFiles, prepare
    from aiayn.checkpoint.run import tokenizer_payload
    d = tmp_path_factory.mktemp("untrained")
    (d / "train.txt").write_text("\n".join(copy_lines(300, 1)) + "\n", encoding="utf-8")
    prepare({"train": SplitFiles(d / "train.txt", d / "train.txt")}, d / "data",
            PrepareConfig(vocab_size=29, num_workers=1))
    cfg = aiayn.get_preset("tiny", vocab_size=29)
    path = d / "model.pt"
    ck.atomic_save({"format": ck.FORMAT, "model": aiayn.Transformer(cfg).state_dict(), "model_config": to_dict(cfg),
                    "step": 0, "tokenizers": tokenizer_payload(DataDir(d / "data"))}, path)
    return path
