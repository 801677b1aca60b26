"""Same seed, same numbers: short training runs, their resumes and a translation, reduced to digests.

A change of structure (files moved, interfaces narrowed) must change no number. This script trains
the tiny preset on the first 2,000 Multi30k pairs in each training mode (one process in fp32 and in
bf16, a run stopped at step 10 and resumed, two processes with DDP and with local SGD, R-Drop), then
translates 50 validation sentences with beam 4 in fp32, int8 and bf16, and writes one digest per
case: the training log without its clock fields, the model weights after the last step, the 4-best
translations with their scores (the scores carry the numbers where 20 steps teach few words).
Run it before and after a change and compare the two JSON files:

    python bench/fingerprint.py --shared ../shared --out /tmp/fp-before.json
    python bench/fingerprint.py --shared ../shared --out /tmp/fp-after.json
    diff /tmp/fp-before.json /tmp/fp-after.json

bf16 and int8 cases are skipped where the CPU lacks their instructions (they would be emulated and
slow); the file says which cases ran.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

STEPS = 20


def aiayn(*argv: str, processes: int = 1) -> str:
    """Run the ``aiayn`` command (in ``processes`` processes under torchrun); its standard output."""
    cmd = [sys.executable, "-m", "aiayn.cli", *argv]
    if processes > 1:
        cmd = [sys.executable, "-m", "aiayn.demo.launch", "--standalone", f"--nproc_per_node={processes}",
               "-m", "aiayn.cli", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"aiayn {' '.join(argv)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def head(src: Path, dst: Path, n: int) -> Path:
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt", encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as g:
        for i, line in enumerate(f):
            if i == n:
                break
            g.write(line)
    return dst


def prepare(shared: Path, work: Path) -> Path:
    m = shared / "data" / "multi30k" / "raw"
    files = {}
    for split, n in (("train", 2000), ("val", 200)):
        for lang in ("en", "de"):
            files[split, lang] = head(m / f"{split}.{lang}.gz", work / f"{split}.{lang}", n)
    out = work / "data"
    aiayn("prepare", "--train-src", str(files["train", "en"]), "--train-tgt", str(files["train", "de"]),
          "--valid-src", str(files["val", "en"]), "--valid-tgt", str(files["val", "de"]),
          "--vocab-size", "500", "--num-workers", "1", "--quiet", "--out", str(out))
    return out


def is_clock_or_memory(key: str) -> bool:
    """A log field that measures the machine (time, rate, memory), not the run's numbers."""
    return key.endswith(("_s", "_mb", "_seconds")) or "per_s" in key


def digest_log(run: Path) -> str:
    lines = []
    for line in (run / "train_log.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if not is_clock_or_memory(k)}
        lines.append(json.dumps(row, sort_keys=True))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def digest_weights(ckpt: Path) -> str:
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["model"]
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def train(data: Path, run: Path, steps: int, *sets: str) -> dict:
    processes = 2 if "processes=2" in sets else 1
    sets = tuple(s for s in sets if s != "processes=2")
    aiayn("train", "--data", str(data), "--out", str(run), "--preset", "tiny", "--no-progress",
          "--max-steps", str(steps), "--set", "train.seed=7", "--set", "train.log_every_steps=2",
          "--set", "train.validate_every_steps=10", "--set", "train.save_every_steps=10",
          "--set", "train.save_every_min=0", "--set", "train.max_time_min=0",
          "--set", "train.max_src_tokens=600", "--set", "train.max_tgt_tokens=600",
          "--set", "train.warmup_steps=10", *(a for s in sets for a in ("--set", s)), processes=processes)
    return {"log": digest_log(run), "weights": digest_weights(run / "last.pt")}


def translate(ckpt: Path, src: Path, precision: str) -> str:
    out = aiayn("translate", "--checkpoint", str(ckpt), "--input", str(src), "--beam-size", "4",
                "--precision", precision, "--nbest", "4", "--min-len", "3", "--quiet")
    return hashlib.sha256(out.encode()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, required=True, help="the shared folder holding data/multi30k")
    ap.add_argument("--out", type=Path, required=True, help="JSON file of digests")
    args = ap.parse_args()
    from aiayn.train.runtime import cpu_supports_bf16

    bf16 = cpu_supports_bf16()
    cases = {
        "fp32": ("train.precision=fp32",),
        "bf16": ("train.precision=bf16",) if bf16 else None,
        "ddp": ("train.precision=fp32", "processes=2"),
        "local_sgd": ("train.precision=fp32", "processes=2", "train.local_sgd_period=4"),
        "rdrop": ("train.precision=fp32", "train.rdrop_alpha=1.0"),
    }
    result: dict = {"torch": torch.__version__, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = prepare(args.shared.resolve(), work)
        for name, sets in cases.items():
            if sets is None:
                result["cases"][name] = "skipped: no native bf16 on this CPU"
                continue
            result["cases"][name] = train(data, work / name, STEPS, *sets)
            print(name, result["cases"][name], flush=True)
        # A run stopped at step 10 and resumed to 20 must be the run of 20 steps.
        train(data, work / "resumed", 10, *cases["fp32"])
        result["cases"]["fp32_resumed"] = train(data, work / "resumed", STEPS, *cases["fp32"])
        print("fp32_resumed", result["cases"]["fp32_resumed"], flush=True)
        src = head(work / "val.en", work / "val50.en", 50)
        ckpt = work / "fp32" / "last.pt"
        result["translate"] = {"fp32": translate(ckpt, src, "fp32")}
        try:
            result["translate"]["int8"] = translate(ckpt, src, "int8")
        except SystemExit as e:
            result["translate"]["int8"] = f"not run: {str(e).splitlines()[-1]}"
        if bf16:
            result["translate"]["bf16"] = translate(ckpt, src, "bf16")
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
