"""Soak test of `aiayn serve` on 127.0.0.1: the service under a bounded crowd of clients for N minutes.

Clients (threads of this process, each kind a fixed number):
  normal        well-formed requests (1-3 Multi30k sentences, beam 1 or 4), back to back
  slow_ok       well-formed requests whose body trickles in, but within the body timeout
  slow_headers  headers sent one byte every 0.5 s, never finished (the server must cut them: 408)
  slow_body     headers, then a body slower than the body timeout (408)
  idle          connects and sends nothing (408 after the header timeout)
  oversized     bodies over the limit (declared and chunked), too many or too long sentences,
                deep nesting, NaN, a 20 kB header, text/plain, a foreign Host
  disconnect    sends a request and hangs up before the answer (the server must not decode it)
  health        GET /health every 0.25 s
A slow client still connected when the time is up is counted as "still_open_at_end".
Nothing may be lost: every well-formed request (normal, slow_ok) must get an HTTP answer, and
/health must answer throughout. At the end the server gets SIGTERM while normal clients still
send; it must exit 0 within its drain bound.

Reports requests served, outcomes by client kind, latency percentiles of normal requests, /health
latency, the server's peak RSS (VmHWM) and its /metrics counters, as
bench/results/<machine-and-date>/serve_soak.json (or $BENCH_RESULTS).

    nice -n 10 python bench/serve_soak.py --minutes 2
Without --checkpoint the tiny preset is trained for --train-steps steps on 2,000 Multi30k
pairs first (a nearly untrained model: its translations are noise; the service is what is tested).
"""
from __future__ import annotations

import argparse
import gzip
import http.client
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine_info, peak_rss_mb, proc_status_kb, setup_logging  # noqa: E402

log = logging.getLogger("bench")
REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("AIAYN_SHARED_DATA", REPO.parent / "shared" / "data"))
SERVER_OPTS = {"--threads": "1", "--max-len-b": "10", "--max-sentences": "8", "--max-request-bytes": "16384",
               "--header-timeout-s": "2", "--body-timeout-s": "2", "--keep-alive-s": "2", "--max-connections": "64",
               "--request-timeout-s": "20", "--shutdown-timeout-s": "5", "--max-beam": "4",
               "--max-connections-per-client": "64", "--client-requests-per-s": "0"}  # every client here is
# 127.0.0.1: one address, as behind a reverse proxy (bench/serve_fairness.py measures the per-client caps)
CLIENTS = {"normal": 4, "slow_ok": 1, "slow_headers": 2, "slow_body": 1, "idle": 1, "oversized": 1,
           "disconnect": 1, "health": 1}


def cli(*argv: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "aiayn.cli", *argv], env=env, check=True, **kw)


def make_checkpoint(work: Path, steps: int) -> Path:
    """The tiny preset trained ``steps`` steps on the first 2,000 Multi30k En-De pairs (BPE 500)."""
    raw, files = DATA / "multi30k" / "raw", []
    for split, name, n in (("train", "train", 2000), ("valid", "val", 100), ("test", "val", 100)):
        for side, lang in (("src", "en"), ("tgt", "de")):
            with gzip.open(raw / f"{name}.{lang}.gz", "rt", encoding="utf-8") as f:
                (work / f"{split}.{lang}").write_text("".join(next(f) for _ in range(n)), encoding="utf-8")
            files += [f"--{split}-{side}", str(work / f"{split}.{lang}")]
    cli("prepare", "--vocab-size", "500", "--out", str(work / "data"), "--num-workers", "1", *files,
        stdout=subprocess.DEVNULL)
    cli("train", "--data", str(work / "data"), "--out", str(work / "run"), "--preset", "tiny", "--max-steps",
        str(steps), "--no-progress", "--set", "train.save_every_min=0", "--set", "train.validate_every_steps=0",
        "--set", "train.precision=fp32", "--set", "train.threads=1", stdout=subprocess.DEVNULL)
    return work / "run" / "last.pt"


def sentences() -> list[str]:
    with gzip.open(DATA / "multi30k" / "raw" / "val.en.gz", "rt", encoding="utf-8") as f:
        return [line.strip() for line, _ in zip(f, range(500)) if line.strip()]


class Soak:
    """The shared record of every client's outcomes; ``until`` is when the clients stop."""

    def __init__(self, port: int, until: float, sents: list[str]):
        self.port, self.until, self.sents = port, until, sents
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.cut_after: dict[str, list[float]] = defaultdict(list)  # seconds until the server closed a slow client
        self.lock = threading.Lock()

    def note(self, kind: str, outcome: str, seconds: float | None = None) -> None:
        with self.lock:
            self.outcomes[kind][outcome] += 1
            if seconds is not None:
                self.latency[kind].append(seconds)

    def running(self) -> bool:
        return time.monotonic() < self.until

    def body(self, rng: random.Random) -> bytes:
        return json.dumps({"sentences": rng.sample(self.sents, rng.randint(1, 3)), "beam": rng.choice((1, 4))}).encode()

    def connect(self, timeout: float = 30.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def head(self, length: int, path: str = "/translate", extra: str = "") -> bytes:
        return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {length}\r\n{extra}\r\n").encode()


def status_of(sock: socket.socket) -> str:
    """The status code of the answer on ``sock`` (read until the server closes), or why there is none."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        return data[9:12].decode() if data.startswith(b"HTTP/1.1 ") else "reset"
    except socket.timeout:
        return "client_timeout"
    finally:
        sock.close()
    return data[9:12].decode() if data.startswith(b"HTTP/1.1 ") else "closed_without_answer"


def post(soak: Soak, body: bytes, timeout: float = 60.0) -> tuple[str, float]:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", soak.port, timeout=timeout)
    try:
        conn.request("POST", "/translate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return str(resp.status), time.perf_counter() - t0
    except ConnectionRefusedError:
        return "connection_refused", time.perf_counter() - t0  # never accepted (after the server exited)
    except (OSError, http.client.HTTPException) as exc:
        return f"lost:{type(exc).__name__}", time.perf_counter() - t0  # accepted, never answered
    finally:
        conn.close()


def normal(soak: Soak, seed: int) -> None:
    rng = random.Random(seed)
    while soak.running():
        outcome, seconds = post(soak, soak.body(rng))
        soak.note("normal", outcome, seconds if outcome == "200" else None)


def slow_ok(soak: Soak, seed: int) -> None:
    """A body in 4 pieces over ~1 s (the body timeout is 2 s): slow, but must be served."""
    rng = random.Random(seed)
    while soak.running():
        body, t0 = soak.body(rng), time.perf_counter()
        try:
            sock = soak.connect()
            sock.sendall(soak.head(len(body), extra="Connection: close\r\n"))
            for i in range(4):
                time.sleep(0.25)
                sock.sendall(body[i * len(body) // 4:(i + 1) * len(body) // 4])
            outcome = status_of(sock)
        except OSError as exc:
            outcome = f"lost:{type(exc).__name__}"
        outcome = outcome if outcome.isdigit() or outcome.startswith("lost:") else f"lost:{outcome}"
        soak.note("slow_ok", outcome, time.perf_counter() - t0 if outcome == "200" else None)


def trickle(soak: Soak, kind: str, first: bytes, piece: bytes, every_s: float) -> None:
    """Send ``first``, then ``piece`` every ``every_s`` seconds until the server answers or closes."""
    t0 = time.perf_counter()
    try:
        sock = soak.connect(timeout=30)
        sock.sendall(first)
        sock.settimeout(every_s)
        while soak.running():
            try:
                data = sock.recv(65536)
                outcome = data[9:12].decode() if data.startswith(b"HTTP/1.1 ") else "closed_without_answer"
                break
            except socket.timeout:
                sock.sendall(piece)
        else:
            outcome = "still_open_at_end"
        sock.close()
    except (ConnectionResetError, BrokenPipeError):
        outcome = "reset"
    soak.note(kind, outcome)
    with soak.lock:
        soak.cut_after[kind].append(time.perf_counter() - t0)


def slow_clients(soak: Soak, kind: str, seed: int) -> None:
    while soak.running():
        if kind == "slow_headers":
            trickle(soak, kind, b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"X", 0.5)
        elif kind == "slow_body":
            trickle(soak, kind, soak.head(400) + b'{"sentences": ["', b"a", 0.5)
        else:  # idle
            trickle(soak, kind, b"", b"", 0.5)


def oversized_requests(soak: Soak) -> list[tuple[str, bytes, bytes]]:
    """(name, head, body) of requests the server must refuse with a 4xx."""
    ok = json.dumps({"sentences": ["A dog."]}).encode()
    big = json.dumps({"sentences": ["word " * 5000]}).encode()
    many = json.dumps({"sentences": ["A dog."] * 50}).encode()
    long = json.dumps({"sentences": ["the dog " * 150]}).encode()
    deep = b"[" * 5000 + b"]" * 5000
    nan = b'{"sentences": ["A dog."], "alpha": NaN}'
    return [("declared_10MB", soak.head(10_000_000), b"x" * 65536),
            ("body_over_limit", soak.head(len(big)), big),
            ("too_many_sentences", soak.head(len(many)), many),
            ("sentence_too_long", soak.head(len(long)), long),
            ("deep_nesting", soak.head(len(deep)), deep),
            ("nan", soak.head(len(nan)), nan),
            ("header_20kB", soak.head(len(ok), extra=f"X-Pad: {'p' * 20000}\r\n"), ok),
            ("text_plain", soak.head(len(ok)).replace(b"application/json", b"text/plain"), ok),
            ("foreign_host", soak.head(len(ok)).replace(b"Host: 127.0.0.1", b"Host: evil.example"), ok)]


def oversized(soak: Soak, seed: int) -> None:
    cases = oversized_requests(soak)
    while soak.running():
        for name, head, body in cases:
            try:
                sock = soak.connect()
                sock.sendall(head + body)
                outcome = status_of(sock)
            except (ConnectionResetError, BrokenPipeError):
                outcome = "reset"
            except OSError as exc:
                outcome = f"error:{type(exc).__name__}"
            soak.note("oversized", f"{name}:{outcome}")


def disconnect(soak: Soak, seed: int) -> None:
    """A full request (3 sentences, beam 4), then hang up at once or after half the body."""
    rng = random.Random(seed)
    while soak.running():
        body = json.dumps({"sentences": rng.sample(soak.sents, 3), "beam": 4}).encode()
        half = rng.random() < 0.3
        try:
            sock = soak.connect()
            sock.sendall(soak.head(len(body)) + (body[:len(body) // 2] if half else body))
            time.sleep(0.01)
            sock.close()
            soak.note("disconnect", "hung_up_mid_body" if half else "hung_up_before_answer")
        except OSError as exc:
            soak.note("disconnect", f"error:{type(exc).__name__}")
        time.sleep(0.05)


def health(soak: Soak, seed: int) -> None:
    while soak.running():
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{soak.port}/health", timeout=10) as resp:
                resp.read()
                outcome = str(resp.status)
        except OSError as exc:
            outcome = f"lost:{type(exc).__name__}"
        soak.note("health", outcome, time.perf_counter() - t0)
        time.sleep(0.25)


def percentiles(xs: list[float]) -> dict[str, float | int | None]:
    if not xs:
        return {"n": 0}
    ms = np.array(xs) * 1000
    return {"n": len(xs), "p50_ms": round(float(np.percentile(ms, 50)), 1), "p95_ms": round(float(np.percentile(ms, 95)), 1),
            "p99_ms": round(float(np.percentile(ms, 99)), 1), "max_ms": round(float(ms.max()), 1)}


def start_server(checkpoint: Path, port: int, log_path: Path, opts: dict[str, str] = SERVER_OPTS,
                 start_s: float = 120.0) -> subprocess.Popen:
    argv = [sys.executable, "-m", "aiayn.cli", "serve", "--checkpoint", str(checkpoint), "--port", str(port)]
    for k, v in opts.items():
        argv += [k, v]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(argv, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + start_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not start within {start_s:.0f} s")


def scrape_metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return {x.rsplit(" ", 1)[0]: float(x.rsplit(" ", 1)[1]) for x in lines
            if x and not x.startswith("#") and "_bucket" not in x}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float | None:
    kb = proc_status_kb(pid).get("VmRSS")
    return kb / 1024.0 if kb is not None else None


def run_clients(soak: Soak, proc: subprocess.Popen) -> list[tuple[float, float | None]]:
    """All clients until ``soak.until``; returns the server's RSS sampled every 5 s."""
    targets = {"normal": normal, "slow_ok": slow_ok, "oversized": oversized, "disconnect": disconnect,
               "health": health}
    threads = []
    for kind, n in CLIENTS.items():
        for i in range(n):
            fn = targets.get(kind)
            args = (soak, 1000 * len(threads) + i) if fn else (soak, kind, i)
            threads.append(threading.Thread(target=fn or slow_clients, args=args, name=f"{kind}-{i}", daemon=True))
    for t in threads:
        t.start()
    t0, rss = time.monotonic(), []
    while soak.running():
        rss.append((round(time.monotonic() - t0, 1), rss_mb(proc.pid)))
        if proc.poll() is not None:
            raise RuntimeError(f"the server died with {proc.returncode} during the soak")
        time.sleep(min(5.0, max(0.05, soak.until - time.monotonic())))
    for t in threads:
        t.join(60)
    return rss


def sigterm_under_load(soak: Soak, proc: subprocess.Popen) -> dict:
    """SIGTERM while 4 normal clients send; how long the server takes to exit, and what they got."""
    soak.until = time.monotonic() + 60
    threads = [threading.Thread(target=normal, args=(soak, 9000 + i), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "killed after 60 s"
    exit_s = time.monotonic() - t0
    soak.until = 0
    for t in threads:
        t.join(60)
    # uvicorn re-raises the SIGTERM it caught once its shutdown is complete: -15 is the clean exit
    return {"exit_code": rc, "exit_seconds": round(exit_s, 2), "bound_seconds": float(SERVER_OPTS["--shutdown-timeout-s"]) + 5}


def summarize(latency: dict[str, list[float]], cut_after: dict[str, list[float]], before: dict[str, Counter],
              metrics: dict[str, float]) -> dict:
    served = {k: dict(c) for k, c in before.items()}
    lost = sum(n for k in ("normal", "slow_ok") for o, n in before[k].items() if not o.isdigit())
    health_failed = sum(n for o, n in before["health"].items() if o != "200")
    return {
        "requests_served_200": before["normal"]["200"] + before["slow_ok"]["200"],
        "requests_total": sum(sum(c.values()) for c in before.values()),
        "outcomes_by_client_kind": served,
        "lost_well_formed": lost,
        "normal_latency": percentiles(latency["normal"]),
        "slow_ok_latency": percentiles(latency["slow_ok"]),
        "health_latency": percentiles(latency["health"]),
        "health_failures": health_failed,
        "slow_client_cut_after": {k: percentiles(v) for k, v in cut_after.items()},
        "server_metrics": {k: v for k, v in metrics.items() if k.startswith(("aiayn_events", "aiayn_requests_total",
                                                                            "aiayn_skipped", "aiayn_model_calls"))},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="how long the clients run (default 3)")
    ap.add_argument("--checkpoint", type=Path, help="checkpoint to serve (default: a tiny one trained here)")
    ap.add_argument("--train-steps", type=int, default=50, help="steps of the tiny checkpoint (default 50)")
    ap.add_argument("--out", type=Path, help="result JSON (default bench/results/<machine-and-date>/serve_soak.json)")
    args = ap.parse_args()
    setup_logging()
    with tempfile.TemporaryDirectory(prefix="serve-soak-") as tmp:
        work = Path(tmp)
        checkpoint = args.checkpoint or make_checkpoint(work, args.train_steps)
        port = free_port()
        proc = start_server(checkpoint, port, work / "server.log")
        log.info("server pid %d on port %d; clients for %.1f min: %s", proc.pid, port, args.minutes, CLIENTS)
        soak = Soak(port, time.monotonic() + 60 * args.minutes, sentences())
        load_start = os.getloadavg()
        try:
            rss = run_clients(soak, proc)
            metrics = scrape_metrics(port)
            peak = peak_rss_mb(proc.pid)
            before = {k: Counter(c) for k, c in soak.outcomes.items()}
            soak.outcomes.clear()
            during, soak.latency = soak.latency, defaultdict(list)  # the SIGTERM phase's latencies are apart
            shutdown = sigterm_under_load(soak, proc)
            shutdown["client_outcomes"] = {k: dict(c) for k, c in soak.outcomes.items()}
            shutdown["accepted_but_unanswered"] = sum(n for o, n in soak.outcomes["normal"].items() if o.startswith("lost:"))
        finally:
            if proc.poll() is None:
                proc.kill()
        server_log = (work / "server.log").read_text(errors="replace").splitlines()
    shutdown["clean_shutdown_logged"] = any("Application shutdown complete" in x for x in server_log)
    result = {"benchmark": "serve_soak", "minutes": args.minutes, "machine": machine_info(1),
              "nice": os.nice(0), "note": "the machine was shared with other work during the run",
              "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
              "checkpoint": str(args.checkpoint) if args.checkpoint else
              f"tiny preset (2 layers, d_model 64) trained {args.train_steps} steps on 2,000 Multi30k pairs",
              "server_options": SERVER_OPTS, "clients": CLIENTS, **summarize(during, soak.cut_after, before, metrics),
              "server_peak_rss_mb": peak, "server_rss_mb_every_5s": rss, "sigterm": shutdown,
              "server_log_tail": server_log[-8:], "server_log_tracebacks": sum("Traceback" in x for x in server_log),
              "server_log_first_traceback": first_traceback(server_log)}
    result["ok"] = (result["lost_well_formed"] == 0 and result["health_failures"] == 0
                    and shutdown["exit_code"] in (0, -signal.SIGTERM) and shutdown["clean_shutdown_logged"]
                    and shutdown["accepted_but_unanswered"] == 0 and shutdown["exit_seconds"] <= shutdown["bound_seconds"]
                    and result["server_log_tracebacks"] == 0)
    out = args.out or REPO / "bench" / "results" / result_folder(result["machine"]) / "serve_soak.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    log.info("wrote %s: %d served, %d lost, normal p50/p95/p99 %s/%s/%s ms, health max %s ms, peak RSS %.0f MB, ok=%s",
             out, result["requests_served_200"], result["lost_well_formed"], result["normal_latency"].get("p50_ms"),
             result["normal_latency"].get("p95_ms"), result["normal_latency"].get("p99_ms"),
             result["health_latency"].get("max_ms"), peak or 0, result["ok"])
    return 0 if result["ok"] else 1


def first_traceback(lines: list[str]) -> list[str]:
    for i, line in enumerate(lines):
        if "Traceback" in line:
            return lines[max(0, i - 2):i + 120]
    return []


def result_folder(machine: dict) -> str:
    """e.g. intel-xeon-2core-2026-11-26 (vendor and family words of the CPU model, cores, date)."""
    words = [w for w in machine["cpu_model"].lower().replace("(r)", "").replace("(tm)", "").split()
             if w.isalpha() and w not in ("processor", "cpu", "core")][:2]
    return f"{'-'.join(words) or 'cpu'}-{machine['logical_cpus']}core-{machine['date'][:10]}"


if __name__ == "__main__":
    sys.exit(main())
