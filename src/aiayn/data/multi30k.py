"""Multi30k (Elliott et al. 2016) as ``../shared/data/multi30k`` lays it out: where the files are,
and reading them. Used by the demo, the tests and the benchmarks."""
from __future__ import annotations

import gzip
import os
from pathlib import Path

from aiayn.errors import UserError

CHECKOUT = Path(__file__).resolve().parents[3]  # the repository (src/aiayn/data/multi30k.py)


def default_data_root() -> str:
    """$AIAYN_SHARED_DATA, else ../shared/data beside the checkout (this repository's layout)."""
    env = os.environ.get("AIAYN_SHARED_DATA")
    if env:
        return env
    for base in (CHECKOUT, Path.cwd()):
        cand = base.parent / "shared" / "data"
        if cand.is_dir():
            return str(cand)
    return str(CHECKOUT.parent / "shared" / "data")


def multi30k_files(root: Path, src: str, tgt: str) -> dict[str, Path]:
    """The raw and tokenized (``tok/*.lc.norm.tok``) train / valid / test_2016 files of one direction under
    ``root``/multi30k, by "raw.SPLIT.LANG" and "tok.SPLIT.LANG"; a missing one is an error naming it."""
    m = root / "multi30k"
    files = {}
    for split, name in (("train", "train"), ("valid", "val"), ("test", "test_2016_flickr")):
        for lang in (src, tgt):
            files[f"raw.{split}.{lang}"] = m / "raw" / f"{name}.{lang}.gz"
            files[f"tok.{split}.{lang}"] = m / "tok" / f"{name}.lc.norm.tok.{lang}.gz"
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise UserError(f"Multi30k files not found under {m}: {', '.join(missing[:3])}"
                        f"{' ...' if len(missing) > 3 else ''}; pass --data-root (the folder holding multi30k/)")
    return files


def read_text(path: Path, limit: int = 0) -> list[str]:
    """The lines of a plain or gzip text file (the first ``limit``; 0 = all), newlines stripped."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:limit] if limit else lines
