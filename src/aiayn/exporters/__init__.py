"""Exporters: an aiayn checkpoint in another toolkit's format, every weight copied.

- ``aiayn.exporters.ct2``: a CTranslate2 model directory (``aiayn export``);
- ``aiayn.exporters.hf``: a Hugging Face ``MarianMTModel`` directory (``aiayn export --format hf``).

Both write through ``ExportDir``, so an export is put in place whole and replaces only an
earlier export. (The way back, a Marian directory read as a checkpoint, is ``aiayn.hf_import``.)
"""
from __future__ import annotations

import json
from pathlib import Path

from aiayn.files import OutputDir

RECORD = "aiayn.json"  # what says a folder is an export of aiayn's (the only folders --overwrite replaces)


class ExportDir(OutputDir):
    """The output folder of an export (``OutputDir``): written whole or not at all; an existing
    one is replaced only with ``overwrite`` and only if it is an earlier export (it holds
    ``RECORD``, which every export writes)."""

    def __init__(self, out: str | Path, overwrite: bool = False):
        super().__init__(out, overwrite=overwrite, ours=lambda d: (d / RECORD).is_file(),
                         what="a model aiayn exported")

    def finish(self, tmp: Path) -> None:
        if not (tmp / RECORD).exists():
            (tmp / RECORD).write_text(json.dumps({"exported_by": "aiayn"}) + "\n")
