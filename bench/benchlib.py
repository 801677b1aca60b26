"""Shared pieces of the speed benchmarks: machine description, timing statistics,
peak memory, result files, and interleaved measurement of several systems.

Every system under test (aiayn fp32, aiayn bf16, Hugging Face Marian, CTranslate2, ...) runs
in its own worker process, built once and then driven by the parent in rounds A B C A B C ...
so that slow drifts of the machine (thermal, another process waking up) hit every system
alike. Separate processes also give each system its own peak RSS, keep one rival's crash
from losing the others' numbers, and keep the thread pools of different runtimes (PyTorch's
OpenMP, CTranslate2's) from spinning against each other.

Environment: BENCH_THREADS (default 2) threads per system; BENCH_RESULTS (default
bench/results) for the JSON files.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("bench")

# Nothing is downloaded (the rivals are built from configurations), and no progress bars in logs.
# Set before transformers is imported, here or in the worker processes (they inherit it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_THREADS = int(os.environ.get("BENCH_THREADS", "2"))
# Seconds the parent waits between two timed runs: CTranslate2's Intel OpenMP threads keep
# spinning for up to 200 ms (KMP_BLOCKTIME) after a call; the next system must not pay for it.
GAP_S = 0.3


def results_dir() -> Path:
    path = Path(os.environ.get("BENCH_RESULTS", BENCH_DIR / "results"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """Options every interleaved benchmark shares; None = the per-size default (``fill_defaults``)."""
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="threads per system (intra-op)")
    ap.add_argument("--reps", type=int, default=None, help="measured rounds (each round runs every system once)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds first")
    ap.add_argument("--min-reps", type=int, default=None, help="rounds always measured, even past --budget-s")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new round once the measured rounds took this long (after --min-reps)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="a system taking longer for one call fails")
    ap.add_argument("--systems", default=None, help="comma-separated subset of the systems to run")
    ap.add_argument("--name", default=None, help="result file name (default: derived from the arguments)")


def fill_defaults(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


# The model sizes raced (the shapes of the reference rival measurements' "base" and "small"): base = Table 3's base model; small = the "multi30k" preset (d_model 256,
# 3+3 layers, d_ff 1024, 4 heads of d_k = d_v = 64). Vocabulary 8000 for both, as the rivals.
# "tiny" is for seconds-long smoke runs of the harness only.
SIZES = {
    "base": ("base", {"vocab_size": 8000, "attn_bias": True}),  # as measured, and as the rivals' Marian
    "small": ("multi30k", {}),
    "tiny": ("tiny", {"vocab_size": 1000}),
    # a recipe file's model: aiayn demo's, Wu et al.'s transformer-tiny
    "main": BENCH_DIR.parent / "recipes" / "multi30k.json",
}


def model_config(size: str):
    """The aiayn ModelConfig of a benchmark size."""
    import aiayn

    if isinstance(SIZES[size], Path):
        from aiayn.train.config import load_recipe
        return load_recipe(SIZES[size]).model
    preset, overrides = SIZES[size]
    return aiayn.get_preset(preset, **overrides)


# -- machine ---------------------------------------------------------------------------------------


def _lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}


ISA_HOLD_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                      "AIAYN_KERNELS_MARCH", "CT2_FORCE_CPU_ISA")


def machine_info(threads: int) -> dict[str, Any]:
    """What the numbers were measured on: CPU model, cores, ISA features, library versions."""
    import torch

    cpu = _lscpu()
    flags = set(cpu.get("Flags", "").split())
    info: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_model": cpu.get("Model name", platform.processor()),
        "logical_cpus": os.cpu_count(),
        "cores_per_socket": cpu.get("Core(s) per socket"),
        "sockets": cpu.get("Socket(s)"),
        "threads_per_core": cpu.get("Thread(s) per core"),
        "isa": sorted(flags & {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"}),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": threads,
        "loadavg_start": os.getloadavg(),
        # instruction sets held below the CPU's own (bench/run_all.sh HOLD_ISA=avx2)
        "isa_held": {k: os.environ[k] for k in ISA_HOLD_VARIABLES if k in os.environ},
    }
    for mod in ("transformers", "ctranslate2", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing rival is recorded, not fatal
            info[mod] = None
    return info


def multi30k_eval_sets(src_lang: str, data_root: str = "", threads: int = 2) -> dict[str, Any]:
    """For the scripts that re-score finished ``aiayn demo`` runs: the ``aiayn`` command's process settings
    and ``threads`` threads, then the Multi30k evaluation text ``aiayn demo`` reads (aiayn.demo.multi30k's files;
    ``data_root`` empty = its default): the target language, validation source and tokenized
    references, test_2016 source, tokenized and raw references."""
    import torch

    from aiayn.data.multi30k import default_data_root, multi30k_files, read_text
    from aiayn.host.process import configure_process

    configure_process()
    torch.set_num_threads(threads)

    src, tgt = src_lang, "de" if src_lang == "en" else "en"
    files = multi30k_files(Path(data_root or default_data_root()), src, tgt)
    return {"src": src, "tgt": tgt,
            "val_src": read_text(files[f"raw.valid.{src}"]), "val_tok": read_text(files[f"tok.valid.{tgt}"]),
            "test_src": read_text(files[f"raw.test.{src}"]), "test_tok": read_text(files[f"tok.test.{tgt}"]),
            "test_raw": read_text(files[f"raw.test.{tgt}"])}


def proc_status_kb(pid: int | str = "self") -> dict[str, int]:
    """The kB fields of /proc/<pid>/status (VmRSS, VmHWM, RssAnon, RssFile, ...); {} where it cannot
    be read (no /proc, the process gone; an exited child not yet reaped has no memory fields)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0])
    return out


def peak_rss_mb(pid: int | None = None) -> float | None:
    """Peak resident set size of this process (ru_maxrss is in KiB on Linux), or of process ``pid``
    (VmHWM in /proc; None where that cannot be read)."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    kb = proc_status_kb(pid).get("VmHWM")
    return kb / 1024.0 if kb is not None else None


def train_as_demo(data: Path, out: Path, recipe: Path, processes: int, threads: int, sets: list[str],
                  env: dict[str, str] | None = None) -> tuple[dict[str, Any], Any]:
    """A real ``aiayn train`` of ``recipe`` on a prepared data directory as ``aiayn demo`` starts it
    (``processes`` data-parallel processes through its torchrun launcher, ``threads`` each, ``--set`` each of
    ``sets``), its output discarded: the run's summary.json and ``wait4``'s resource usage of the
    launcher and its ranks (ru_maxrss: the largest process's peak). A failed run ends the script."""
    launch = ([sys.executable, "-m", "aiayn.demo.launch", "--standalone", f"--nproc_per_node={processes}"]
              if processes > 1 else [sys.executable])
    cmd = [*launch, "-m", "aiayn.cli", "train", "--data", str(data), "--out", str(out), "--recipe", str(recipe),
           "--no-progress"]
    for s in (f"train.threads={threads}", *sets):
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{out}: aiayn train failed (exit code {code})")
    return json.loads((out / "summary.json").read_text()), usage


def time_stats(times: list[float]) -> dict[str, Any]:
    return {"n": len(times), "median": statistics.median(times), "min": min(times), "max": max(times),
            "all": times}


# -- result files ----------------------------------------------------------------------------------


def write_result(name: str, payload: dict[str, Any]) -> Path:
    payload = {**payload, "loadavg_end": os.getloadavg()}
    path = results_dir() / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)  # a killed run never leaves a half-written file behind
    log.info("wrote %s", path)
    return path


def read_result(name: str) -> dict[str, Any] | None:
    path = results_dir() / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def peak_gflops(dtype: str = "fp32") -> float | None:
    """Median GFLOP/s of the 2048^3 matmul from matmul_peak.json (run matmul_peak.py first)."""
    res = read_result("matmul_peak")
    try:
        return float(res["cases"][f"{dtype}_2048"]["gflops_median"])
    except (TypeError, KeyError, ValueError):
        return None


# -- interleaved measurement in worker processes -------------------------------------------------------


# The process settings the ``aiayn`` command makes at start-up (aiayn/cli.py), for aiayn's systems.
AIAYN_PROCESS = {"malloc": "reuse", "denormals": "flush", "hugepages": "on"}

# Composite systems of the translation benchmark: each is the faster of its members (the
# reduced-precision aiayn, and CTranslate2 float32 in its better use of the same threads).
# Both toolkits are judged on their better use of the threads: one process on all of them, or
# processes of one thread each (aiayn's DecodeConfig.workers, CTranslate2's inter_threads).
BEST_OF = {"aiayn-best-fp32": ("aiayn-fp32", "aiayn-fp32-inter"),
           "aiayn-best-reduced": ("aiayn-bf16", "aiayn-bf16w", "aiayn-int8", "aiayn-int8bf16",
                                  "aiayn-bf16w-inter", "aiayn-int8bf16-inter"),
           "ct2-best-fp32": ("ct2-fp32", "ct2-fp32-inter")}


@dataclass
class System:
    """One system under test. ``build(**kwargs)`` runs inside the worker and returns a callable
    ``run() -> dict`` (the dict: anything worth recording about the call, e.g. output lengths)."""

    name: str
    build: Callable[..., Callable[[], dict]]
    kwargs: dict[str, Any] = field(default_factory=dict)
    # "reuse": the worker calls aiayn.host.allocator.reuse_freed_memory() first, as the aiayn
    # command does at start-up; "system": glibc's defaults (what a rival's user gets).
    malloc: str = "system"
    # "flush": the worker calls aiayn.host.denormals.flush_denormals() before anything else, as the
    # aiayn command does at start-up; "keep": IEEE denormals (what a rival's user gets).
    denormals: str = "keep"
    # "on": the worker calls aiayn.host.hugepages.use_huge_pages() before its first tensor, as the
    # aiayn command does at start-up; "off": 4 kB pages (what a rival's user gets).
    hugepages: str = "off"


def _worker(conn, system: System, threads: int) -> None:
    """Build the system, then time one call per "run" message; report peak RSS on "stop"."""
    try:
        if system.hugepages == "on":  # before the first tensor: PyTorch reads the setting once
            from aiayn.host.hugepages import use_huge_pages

            use_huge_pages()
        import torch

        if system.denormals == "flush":  # before the thread pool exists, so that every thread has it
            from aiayn.host.denormals import flush_denormals

            flush_denormals()
        torch.set_num_threads(threads)
        if system.malloc == "reuse":
            from aiayn.host.allocator import reuse_freed_memory

            reuse_freed_memory()
        rss0 = peak_rss_mb()
        t0 = time.perf_counter()
        run = system.build(**system.kwargs)
        conn.send(("ready", {"build_s": time.perf_counter() - t0, "rss_before_build_mb": rss0,
                             "rss_after_build_mb": peak_rss_mb()}))
    except BaseException:  # noqa: BLE001 - reported to the parent, which carries on
        conn.send(("error", traceback.format_exc()))
        return
    cpu_s = wall_s = 0.0
    while True:
        msg = conn.recv()
        if msg == "stop":
            conn.send(("stopped", {"peak_rss_mb": peak_rss_mb(),
                                   "cores_used_avg": cpu_s / wall_s if wall_s else None}))
            return
        try:
            c0, t0 = os.times(), time.perf_counter()
            info = run() or {}
            dt = time.perf_counter() - t0
            c1 = os.times()
            cpu_s += (c1.user - c0.user) + (c1.system - c0.system)
            wall_s += dt
            conn.send(("ok", dt, info))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
            return


class _Worker:
    def __init__(self, system: System, threads: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # not a daemon: a system may start processes of its own (aiayn's DecodeConfig.workers);
        # close() still ends a failed worker
        self.proc = ctx.Process(target=_worker, args=(child, system, threads), name=f"bench-{system.name}",
                                daemon=False)
        self.proc.start()
        child.close()

    def call(self, msg: str | None, timeout_s: float) -> tuple:
        try:
            if msg is not None:
                self.conn.send(msg)
            if not self.conn.poll(timeout_s):
                return ("error", f"timed out after {timeout_s:g}s")
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            return ("error", f"worker died: {exc!r} (exit code {self.proc.exitcode})")

    def close(self, failed: bool = False) -> None:
        """Wait for a stopped worker; end a failed (possibly hung) one at once."""
        self.proc.join(timeout=1 if failed else 30)
        if self.proc.is_alive():
            self.proc.terminate()  # our own child, by its handle
            self.proc.join(timeout=10)


def measure_interleaved(systems: list[System], *, threads: int, warmup: int, reps: int, min_reps: int,
                        budget_s: float, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Build every system (one after the other), then run rounds A B C A B C ...

    Returns per system: times (stats of the measured calls), the last call's info, build time,
    peak RSS, average cores used during the calls, or ``error`` with the traceback. A system
    that fails drops out; the others go on.
    """
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)  # inherited by workers
    out: dict[str, dict[str, Any]] = {}
    workers: dict[str, _Worker] = {}
    for s in systems:
        log.info("building %s", s.name)
        w = _Worker(s, threads)
        kind, *rest = w.call(None, timeout_s)
        if kind != "ready":
            log.error("%s failed to build:\n%s", s.name, rest[0])
            out[s.name] = {"error": rest[0]}
            w.close(failed=True)
            continue
        out[s.name] = {**rest[0], "times_s": []}
        workers[s.name] = w
    t_measured, rounds = 0.0, 0
    for r in range(warmup + reps):
        measured = r >= warmup
        if measured and rounds >= min_reps and t_measured >= budget_s:
            log.info("budget of %.0fs reached after %d measured rounds", budget_s, rounds)
            break
        for name, w in list(workers.items()):
            time.sleep(GAP_S)
            kind, *rest = w.call("run", timeout_s)
            if kind != "ok":
                log.error("%s failed in round %d:\n%s", name, r, rest[0])
                out[name]["error"] = rest[0]
                w.close(failed=True)
                del workers[name]
                continue
            dt, info = rest
            out[name]["info"] = info
            if measured:
                out[name]["times_s"].append(dt)
                t_measured += dt
            log.info("%s %s %.3fs", "run" if measured else "warmup", name, dt)
        rounds += measured
    for name, w in workers.items():
        kind, *rest = w.call("stop", 60)
        if kind == "stopped":
            out[name].update(rest[0])
        w.close()
    for res in out.values():
        times = res.pop("times_s", [])
        if "error" in res:  # a system that failed part-way is reported as failed, not with partial numbers
            res["times_before_error_s"] = times
        elif times:
            res["time"] = time_stats(times)
    return out


NO_BF16 = "not run: this CPU has no bf16 instructions (avx512_bf16, amx_bf16); bf16 would be emulated"


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions, by the test ``precision auto`` uses
    (``aiayn.train.runtime.cpu_supports_bf16``: AVX512-BF16 or AMX). Without it PyTorch emulates bf16 matmuls, 30-500x
    slower than float32 (measured on an AVX2-only AMD EPYC), and timing a bf16 system only costs
    minutes. BENCH_BF16=1 times them anyway."""
    from aiayn.train.runtime import cpu_supports_bf16

    return os.environ.get("BENCH_BF16") == "1" or cpu_supports_bf16()


def without_emulated_bf16(systems: list[System]) -> tuple[list[System], dict[str, dict]]:
    """The systems to time, and a result (``NO_BF16``) for each bf16 system left out on a CPU without bf16."""
    if cpu_has_bf16():
        return systems, {}
    keep = [s for s in systems if "bf16" not in s.name]
    skipped = {s.name: {"error": NO_BF16} for s in systems if "bf16" in s.name}
    for name in skipped:
        log.warning("%s: %s (BENCH_BF16=1 times it anyway)", name, NO_BF16)
    return keep, skipped


def status(result: dict) -> str:
    """What a table shows for a system without timings: "not run" (left out on purpose) or "FAILED"."""
    return "not run" if str(result.get("error", "")).startswith("not run") else "FAILED"


def pick(systems: list[System], names: str | None) -> list[System]:
    """The subset named in --systems (comma-separated), in the given order."""
    if not names:
        return systems
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {s.name: s for s in systems}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; known: {', '.join(known)}")
    return [known[n] for n in wanted]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(x: float | None, spec: str = ".0f", missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A plain aligned table on stdout (CLI output)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
