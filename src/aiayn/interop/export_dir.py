"""The output folder of an export (``ct2_export``, ``hf_export``): put in place whole, replacing
only an earlier export."""
from __future__ import annotations

import json
import os
from pathlib import Path

from aiayn.files import OutputDir, current_umask

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
        mode = 0o666 & ~current_umask()  # as open() gives: a writer's private 0600 (safetensors') is not kept
        for path in tmp.rglob("*"):
            if path.is_file() and not path.is_symlink():
                os.chmod(path, mode)
