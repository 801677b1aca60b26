"""Multi30k (Elliott et al. 2016), task 1: where its files are, fetching them when they are
nowhere here, and reading them. Used by the demo, ``aiayn data multi30k``, the tests and the
benchmarks.

A data root is a folder holding ``multi30k/raw/<split>.<lang>.gz`` (original text) and
``multi30k/tok/<split>.lc.norm.tok.<lang>`` (lowercased, Moses-tokenized; plain or ``.gz``).
Looked up in this order: ``--data-root``; ``$AIAYN_SHARED_DATA``; ``../shared/data`` beside the
checkout (or the current directory); the cache (``$AIAYN_CACHE``, else ``$XDG_CACHE_HOME/aiayn``
or ``~/.cache/aiayn``); and last, a download into the cache from the data set's own repository
(multi30k/dataset on GitHub; ``$AIAYN_DATA_URL`` replaces its base URL, the paths below it stay
the repository's). Every downloaded file is checked against the SHA-256 pinned below.
"""
from __future__ import annotations

import gzip
import os
import sys
from pathlib import Path

from aiayn.data.fetch import Pinned, fetch_all
from aiayn.errors import UserError

CHECKOUT = Path(__file__).resolve().parents[3]  # the repository (src/aiayn/data/multi30k.py)
BASE_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/"
TERMS = ("Multi30k (Elliott et al. 2016, github.com/multi30k/dataset, which has no license file) is partly "
         "derived from Flickr30K; its README provides it for non-commercial research and educational use, "
         "under the Flickr Terms of Use")
SPLITS = (("train", "train"), ("valid", "val"), ("test", "test_2016_flickr"))  # ours, the repository's
LANGS = ("en", "de")

# The repository's files (commit a3d2e0d, 2017 files): raw/ is served gzipped, tok/ as plain text.
_PINS = {
    "raw/train.en.gz": (568929, "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f"),
    "raw/train.de.gz": (637044, "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6"),
    "raw/val.en.gz": (21650, "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28"),
    "raw/val.de.gz": (24681, "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a"),
    "raw/test_2016_flickr.en.gz": (21077, "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9"),
    "raw/test_2016_flickr.de.gz": (22890, "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8"),
    "tok/train.lc.norm.tok.en": (1837696, "08925f8e0572bcd5a006702fc5fe20e2d77c6917d4eebd576fc20de6693c2119"),
    "tok/train.lc.norm.tok.de": (2150008, "cb5a23529b65ec2061f1dc446192a9c37382b63cc75f81a0be59d34894b3a505"),
    "tok/val.lc.norm.tok.en": (64608, "46573ce391ae227f1c72f873392436a20ef18e0a6d518098cfbd70b77c8572ec"),
    "tok/val.lc.norm.tok.de": (77273, "97232bd273eceb7207f689527386a97e4be2616b18ada47576bdaf96c8ae1f00"),
    "tok/test_2016_flickr.lc.norm.tok.en": (63307, "5b7f32627cf99eced828311b955dae9800bb52bc8b91cf8b6526829e605b29d2"),
    "tok/test_2016_flickr.lc.norm.tok.de": (71917, "c6a33d39d48f9f510de147651316cd9d918e09ad0219df734a2f16b6baccacc4"),
}
PINNED = [Pinned(f"data/task1/{path}", f"multi30k/{path}", size, sha) for path, (size, sha) in _PINS.items()]


def cache_root() -> Path:
    """Where downloaded data sets live: $AIAYN_CACHE, else $XDG_CACHE_HOME/aiayn, else ~/.cache/aiayn."""
    if os.environ.get("AIAYN_CACHE"):
        return Path(os.environ["AIAYN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aiayn"


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


def local_roots() -> list[Path]:
    """The data roots searched before a download, in order (``--data-root`` aside)."""
    roots = [Path(os.environ["AIAYN_SHARED_DATA"])] if os.environ.get("AIAYN_SHARED_DATA") else []
    roots += [base.parent / "shared" / "data" for base in (CHECKOUT, Path.cwd())]
    return [*dict.fromkeys(roots), cache_root()]


def _locate(root: Path, src: str, tgt: str) -> tuple[dict[str, Path], list[Path]]:
    """The files of one direction under ``root``/multi30k by "raw.SPLIT.LANG" and "tok.SPLIT.LANG"
    (a tok file plain or gzipped), and the ones missing."""
    m = root / "multi30k"
    files = {}
    for split, name in SPLITS:
        for lang in (src, tgt):
            files[f"raw.{split}.{lang}"] = m / "raw" / f"{name}.{lang}.gz"
            tok = m / "tok" / f"{name}.lc.norm.tok.{lang}"
            files[f"tok.{split}.{lang}"] = tok if tok.is_file() else tok.with_name(tok.name + ".gz")
    missing = [p for p in files.values() if not p.is_file()]
    return files, missing


def multi30k_files(root: Path, src: str, tgt: str, given: bool = False) -> dict[str, Path]:
    """The raw and tokenized train / valid / test_2016 files of one direction under
    ``root``/multi30k, by "raw.SPLIT.LANG" and "tok.SPLIT.LANG"; a missing one is an error naming it
    (a tokenized file in either of its forms). ``given``: ``root`` is the user's --data-root."""
    files, missing = _locate(root, src, tgt)
    if missing:
        names = [f"{p.with_suffix('')}[.gz]" if key.startswith("tok.") else str(p)  # tok: plain or gzipped
                 for key, p in files.items() if p in missing]
        hint = ("--data-root names the folder that holds multi30k/ (aiayn data multi30k --out DIR writes one); "
                "leave it out to use or download the shared copy") if given else \
            "pass --data-root (the folder holding multi30k/), or leave it out to download the files"
        raise UserError(f"Multi30k files not found under {root / 'multi30k'}: {', '.join(names[:3])}"
                        f"{' ...' if len(names) > 3 else ''}; {hint}")
    return files


def download_multi30k(root: Path, *, base_url: str | None = None, quiet: bool = False) -> Path:
    """Every pinned Multi30k file into ``root``/multi30k (those present are kept), from ``base_url``
    (a URL or a local folder), else $AIAYN_DATA_URL, else the data set's repository; the terms of
    use are printed first."""
    base = base_url or os.environ.get("AIAYN_DATA_URL") or BASE_URL
    if any(not (root / f.local).is_file() for f in PINNED):
        print(f"Downloading Multi30k into {root / 'multi30k'} from {base}\n{TERMS}.", file=sys.stderr, flush=True)
    fetch_all(base, PINNED, root, quiet=quiet)
    return root


def find_multi30k(data_root: str | Path | None, src: str, tgt: str, *, quiet: bool = False) -> dict[str, Path]:
    """The files of one direction: under ``data_root`` when it is given (missing ones are an error);
    else under the first of ``local_roots()`` that holds them all; else downloaded into the cache."""
    if data_root:
        return multi30k_files(Path(data_root), src, tgt, given=True)
    for root in local_roots():
        files, missing = _locate(root, src, tgt)
        if not missing:
            return files
    return multi30k_files(download_multi30k(cache_root(), quiet=quiet), src, tgt)


def read_text(path: Path, limit: int = 0) -> list[str]:
    """The lines of a plain or gzip text file (the first ``limit``; 0 = all), newlines stripped."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:limit] if limit else lines
