"""The bench scripts that read their arguments by position (no argparse) answer --help, or arguments that
do not fit their usage, with that usage and a nonzero exit, not a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script, arguments", [("cache_vs_recompute.py", ["--help"]),
                                               ("cache_vs_recompute.py", ["8000", "2"]),
                                               ("decode_ab.py", ["--help"]),
                                               ("decode_ab.py", ["small", "fp32", "explicit", "five"])])
def test_a_positional_script_answers_with_its_usage(script, arguments):
    done = subprocess.run([sys.executable, str(BENCH / script), *arguments], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"python bench/{script}" in done.stderr  # the usage line of its docstring
