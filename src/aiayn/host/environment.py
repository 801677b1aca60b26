"""What a result was computed with, for the results files that say how to repeat them (``aiayn demo``'s
results.json): the code (aiayn's version, and the git commit of the checkout it runs from), the
libraries whose operations give the numbers, the CPU (and the GPU), the threads, and the environment
variables that change which instructions or settings compute them. Why each matters:
docs/training.md, "Reproducibility"."""
from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

# the variables that change the numbers: denormals kept or flushed (aiayn/host/denormals.py), the C
# kernels' target (aiayn/kernels/loader.py), the instruction sets PyTorch, oneDNN and MKL are held to,
# and OpenMP's thread count (read by processes that do not set torch's own)
NUMERIC_VARIABLES = ("AIAYN_DENORMALS", "AIAYN_KERNELS_MARCH", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                     "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS")


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable ``name``, one of ``choices`` (the first where it is unset); a
    ``UserError`` naming it and them otherwise."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        from aiayn.errors import UserError
        allowed = " or ".join(map(repr, choices)) if len(choices) == 2 else f"one of {', '.join(choices)}"
        raise UserError(f"{name} must be {allowed}, got {value!r}")
    return value


def source_commit(package_dir: Path) -> dict[str, Any] | None:
    """The git commit of the checkout that tracks ``package_dir`` (aiayn's package folder), and whether
    its tracked files differ from that commit (``modified``); None for an installed copy, or where git
    cannot say. Reads only: ``git diff`` leaves the index as it is."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(package_dir), *args], capture_output=True, text=True, timeout=30)
    try:
        if git("ls-files", "--error-unmatch", "__init__.py").returncode != 0:  # not this checkout's file
            return None
        head = git("rev-parse", "HEAD")
        diff = git("diff", "--quiet", "HEAD", "--")
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0 or diff.returncode not in (0, 1):
        return None
    return {"commit": head.stdout.strip(), "modified": diff.returncode == 1}


@functools.cache
def written_by() -> dict[str, Any]:
    """The code that writes a checkpoint (``Contents.written_by``): aiayn's version and ``source_commit``
    (read once a process, where the code it runs was loaded from), torch's version."""
    import torch

    import aiayn
    return {"aiayn": aiayn.__version__, "source": source_commit(Path(aiayn.__file__).resolve().parent),
            "torch": str(torch.__version__)}


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (/proc/cpuinfo's) with its family and model numbers, which tell apart CPUs
    that a virtual machine names alike ("AMD EPYC (family 26, model 2)"); else what ``platform`` knows."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                break  # the first processor's block ends at its blank line
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    numbers = ", ".join(f"{k.removeprefix('cpu ')} {fields[k]}" for k in ("cpu family", "model") if k in fields)
    return f"{fields['model name']} ({numbers})" if numbers else fields["model name"]


def environment() -> dict[str, Any]:
    """This process's code, libraries, CPU, threads and numeric variables (module docstring); the GPU's
    name where CUDA is present."""
    import numpy
    import sentencepiece
    import torch

    import aiayn
    env: dict[str, Any] = {
        "aiayn": aiayn.__version__, "source": source_commit(Path(aiayn.__file__).resolve().parent),
        "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
        "sentencepiece": sentencepiece.__version__, "cpu": cpu_model(), "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "variables": {k: os.environ[k] for k in NUMERIC_VARIABLES if k in os.environ},
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env
