"""WMT14 En-De and En-Fr (§5.1): the statmt.org archives of the training corpora, the dev set
(newstest2013) and the test set (newstest2014, full), fetched by ``aiayn data wmt14`` and the
fetch stage of scripts/wmt14.sh, and the files that script reads taken out of them.

Each archive goes through ``aiayn.data.fetch`` (resumable, a progress bar, checked before it gets
its name) into ``ROOT/wmt14/``; one already there is skipped. ``$AIAYN_WMT14_URL`` (or
``--base-url``) replaces https://www.statmt.org/ for a mirror; the paths below it stay statmt.org's.
"""
from __future__ import annotations

import logging
import os
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from aiayn.data.fetch import Pinned, fetch_all
from aiayn.errors import UserError, WriteError
from aiayn.files import UnpackBound

log = logging.getLogger(__name__)

BASE_URL = "https://www.statmt.org/"
ENV = "AIAYN_WMT14_URL"
PAIRS = ("en-de", "en-fr")


@dataclass(frozen=True)
class Archive:
    """One archive: its pin, and the file names (``{x}``: the pair's other language) of the
    members scripts/wmt14.sh reads, wherever they are in it."""

    pinned: Pinned
    members: tuple[str, ...]


def _pin(remote: str, size: int | None, sha256: str, md5: str = "") -> Pinned:
    return Pinned(remote, f"wmt14/{PurePosixPath(remote).name}", size, sha256, md5)


# Sizes and SHA-256 sums as published, not measured here:
#   tensorflow/datasets, tensorflow_datasets/url_checksums/wmt14_translate.txt: Europarl v7, Common
#     Crawl, News Commentary v9 (that SHA-256 also in andhus/ml-tools, ml_tools/dataset/sets/news_comentary.py);
#   tensorflow/datasets, tensorflow_datasets/url_checksums/wmt13_translate.txt and wmt15_translate.txt:
#     the UN corpus and the 10^9 French-English corpus;
#   andhus/ml-tools, ml_tools/dataset/sets/wmt14.py: dev.tgz's SHA-256 (no size published);
#   mjpost/sacrebleu, sacrebleu/dataset/__init__.py ("wmt14/full"): test-full.tgz's MD5, the only
#     checksum published for it (no size, no SHA-256).
ARCHIVES: dict[str, Archive] = {
    "europarl": Archive(_pin("wmt13/training-parallel-europarl-v7.tgz", 657_632_379,
                             "0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7"),
                        ("europarl-v7.{x}-en.en", "europarl-v7.{x}-en.{x}")),
    "commoncrawl": Archive(_pin("wmt13/training-parallel-commoncrawl.tgz", 918_311_367,
                                "c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5"),
                           ("commoncrawl.{x}-en.en", "commoncrawl.{x}-en.{x}")),
    "news-commentary": Archive(_pin("wmt14/training-parallel-nc-v9.tgz", 80_418_416,
                                    "cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485"),
                               ("news-commentary-v9.{x}-en.en", "news-commentary-v9.{x}-en.{x}")),
    "un": Archive(_pin("wmt13/training-parallel-un.tgz", 2_365_634_246,
                       "29141b5c1eba149a94f7a59d3b1a834b2e47fe0f8758d68dcd77a3d3f497ee47"),
                  ("undoc.2000.{x}-en.en", "undoc.2000.{x}-en.{x}")),
    "giga-fren": Archive(_pin("wmt10/training-giga-fren.tar", 2_595_102_720,
                              "3ff8319f6919393520559bfbc7ad6a747ec81b3abc7be9993b338d4b017b4d9a"),
                         ("giga-fren.release2.fixed.en.gz", "giga-fren.release2.fixed.{x}.gz")),
    "dev": Archive(_pin("wmt14/dev.tgz", None, "cda0f85309e8ea4c9c2bc142cd795fb2771a5939ed5b4527b525dae05fa0c145"),
                   ("newstest2013.en", "newstest2013.{x}", "newstest2013-src.en.sgm", "newstest2013-ref.{x}.sgm")),
    "test": Archive(_pin("wmt14/test-full.tgz", None, "", md5="a8cd784e006feb32ac6f3d9ec7eb389a"),
                    ("newstest2014-{x}en-src.en.sgm", "newstest2014-{x}en-ref.{x}.sgm")),
}
CORPORA = {"en-de": ("europarl", "commoncrawl", "news-commentary", "dev", "test"),
           "en-fr": ("europarl", "commoncrawl", "news-commentary", "un", "giga-fren", "dev", "test")}


def archives(pair: str) -> list[Archive]:
    """The archives of ``pair`` ("en-de" or "en-fr"): its training corpora (§5.1), dev and test."""
    if pair not in CORPORA:
        raise UserError(f"WMT14 pair {pair!r}: one of {', '.join(PAIRS)}")
    return [ARCHIVES[name] for name in CORPORA[pair]]


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def download_wmt14(root: Path, pair: str, *, base_url: str | None = None, quiet: bool = False) -> list[Path]:
    """The archives of ``pair`` in ``root``/wmt14 (those there already are skipped), from
    ``base_url``, else $AIAYN_WMT14_URL, else statmt.org. A file whose size or SHA-256 no published
    source gives is named before the download, and by ``fetch`` after it."""
    base = base_url or os.environ.get(ENV) or BASE_URL
    pins = [a.pinned for a in archives(pair)]
    missing = []
    for p in pins:
        if (root / p.local).is_file():
            log.info("%s: present, skipped", p.local)
        else:
            missing.append(p)
    if missing:
        known = sum(p.size for p in missing if p.size is not None)
        unsized = [PurePosixPath(p.remote).name for p in missing if p.size is None]
        log.info("WMT14 %s: %d archive(s), %s%s, into %s from %s", pair, len(missing), _gb(known),
                 f" and {', '.join(unsized)} (size not published)" if unsized else "", root / "wmt14", base)
        for p in missing:
            if not p.sha256:
                log.warning("%s: no SHA-256 is published for it: %s", PurePosixPath(p.remote).name,
                            "checked by its MD5 only" if p.md5 else "kept UNVERIFIED")
    return fetch_all(base, pins, root, quiet=quiet, env=ENV)


def unpack(root: Path, pair: str) -> Path:
    """The members scripts/wmt14.sh reads, from each archive of ``pair`` under ``root``/wmt14 (as
    ``download_wmt14`` left them), extracted there with the archive's folders. An archive done for
    this pair before (its ``.NAME.unpacked-PAIR`` marker) is skipped; an interrupted one is redone.
    Each member is written as ``NAME.part`` and renamed once whole (``_extract``), so an extraction
    that stops (Ctrl-C, a full disk: a WriteError, the archive kept) leaves no file under a name the
    script reads. What one archive may give is bounded (``UnpackBound``: ten times its size and 64 MiB)."""
    out = root / "wmt14"
    x = pair.split("-")[1]
    for a in archives(pair):
        path = root / a.pinned.local
        marker = out / f".{path.name}.unpacked-{pair}"
        if marker.is_file():
            continue
        if not path.is_file():
            raise UserError(f"{path}: not there; run `aiayn data wmt14 --pair {pair} --out {root}` first")
        wanted = {m.format(x=x) for m in a.members}
        log.info("%s: extracting %s", path.name, ", ".join(sorted(wanted)))
        found, bound = set(), UnpackBound(path)
        try:
            with tarfile.open(path) as tar:
                for member in tar:
                    name = PurePosixPath(member.name).name
                    if member.isfile() and name in wanted:
                        bound.take(member.name, member.size)
                        _extract(tar, member, out)
                        found.add(name)
        except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            raise UserError(f"{path}: cannot unpack it ({exc}); remove it and run again to download it anew") from None
        if not_found := wanted - found:
            raise UserError(f"{path}: holds no {', '.join(sorted(not_found))}; is it the WMT14 archive?")
        marker.touch()
    return out


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, out: Path) -> None:
    """``member`` of ``tar`` into ``out`` with its folders (``filter="data"``), through ``NAME.part``
    renamed once whole. A write that fails (a full disk; not the archive's fault) is a WriteError
    naming the file; the ``.part`` is removed whatever stops it."""
    safe = tarfile.data_filter(member, str(out))  # its name as it lands under out (a leading / dropped)
    target = out / safe.name
    part = target.with_name(target.name + ".part")
    try:
        tar.extract(safe.replace(name=safe.name + ".part", deep=False), out, filter="data")
        os.replace(part, target)
    except OSError as exc:
        part.unlink(missing_ok=True)
        if exc.errno is None:  # gzip's BadGzipFile: the archive, not the disk
            raise
        raise WriteError(f"{target}: cannot write ({exc.strerror}); free some space and run the same command "
                         f"again (the archive {Path(tar.name).name} is kept)") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
