"""Fairness soak of `aiayn serve`: ordinary clients with and without one abusive client, in one run.

One server on 127.0.0.1 (the per-client caps at their defaults); every client has its own
loopback address, as a client is a peer address. Two phases of --minutes each:
  alone    ordinary clients (127.0.0.10, .11, ...): 1-3 Multi30k sentences per request, beam 4, the
           default alpha, a new connection per request, a pause of --think-s (+-50%) in between
  abused   the same ordinary clients, while one abusive client (127.0.0.2) floods at its caps:
           max_connections_per_client kept-alive connections sending requests back to back, each
           max_sentences sentences of nearly max_sentence_tokens tokens, beam max_beam and an alpha
           of its own (so no two of them could share a model call), more sentences than its queue
           share, and one more thread opening connections beyond its connection cap (in a process
           of its own, so that its threads do not hold up the ordinary ones in this process);
           with --abuse small, a flood of the smallest requests instead: one short sentence each, beam 1,
           an alpha of its own, back to back on every connection it may keep
Reports per phase the ordinary clients' latency percentiles (answered requests), their error
rate and refusals (429/503), the abusive client's outcomes, and the server's counters, as
bench/results/<machine-and-date>/serve_fairness.json (or --out). Target: the ordinary p99
with the abusive client within 3x of without, and no ordinary request refused.

    nice -n 10 python bench/serve_fairness.py --minutes 1.5
Without --checkpoint the tiny preset is trained for --train-steps steps on 2,000 Multi30k pairs
first (serve_soak.py's model: nearly untrained, so outputs run to their length limit; the
service is what is measured).
"""
from __future__ import annotations

import argparse
import http.client
import json
import logging
import multiprocessing as mp
import os
import random
import resource
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine_info, setup_logging  # noqa: E402
from serve_soak import (REPO, free_port, make_checkpoint, percentiles, result_folder, scrape_metrics,  # noqa: E402
                        sentences, start_server)

log = logging.getLogger("bench")
SERVER_OPTS = {"--threads": "1", "--max-len-b": "10", "--max-beam": "4", "--request-timeout-s": "30",
               "--shutdown-timeout-s": "5"}
ABUSER = "127.0.0.2"
SHORT = ["A dog.", "Two men.", "A girl runs.", "People walk.", "A red car."]


class Phase:
    """Outcomes and latencies by client kind while ``running()``."""

    def __init__(self, port: int, seconds: float):
        self.port, self.until = port, time.monotonic() + seconds
        self.outcomes: dict[str, Counter] = {"ordinary": Counter(), "abusive": Counter(), "abusive_extra": Counter()}
        self.latency: list[float] = []
        self.lock = threading.Lock()

    def running(self) -> bool:
        return time.monotonic() < self.until

    def note(self, kind: str, outcome: str, seconds: float | None = None) -> None:
        with self.lock:
            self.outcomes[kind][outcome] += 1
            if seconds is not None:
                self.latency.append(seconds)


def request(conn: http.client.HTTPConnection, body: dict) -> str:
    conn.request("POST", "/translate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    return str(resp.status)


def ordinary(phase: Phase, source: str, sents: list[str], think_s: float, seed: int) -> None:
    rng = random.Random(seed)
    while phase.running():
        body = {"sentences": rng.sample(sents, rng.randint(1, 3)), "beam": 4}
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", phase.port, timeout=60, source_address=(source, 0))
        try:
            outcome = request(conn, body)
        except (OSError, http.client.HTTPException) as exc:
            outcome = f"lost:{type(exc).__name__}"
        finally:
            conn.close()
        phase.note("ordinary", outcome, time.perf_counter() - t0 if outcome == "200" else None)
        time.sleep(think_s * rng.uniform(0.5, 1.5))


def abusive(phase: Phase, long_sents: list[str], limits: dict, seed: int, small: bool) -> None:
    """One kept-alive connection sending the heaviest requests it may, back to back (``small``: the
    smallest, one short sentence at beam 1, as fast as they are answered)."""
    rng = random.Random(seed)
    conn = http.client.HTTPConnection("127.0.0.1", phase.port, timeout=60, source_address=(ABUSER, 0))
    while phase.running():
        if small:
            body = {"sentences": [rng.choice(SHORT)], "beam": 1, "alpha": round(rng.uniform(0.0, 2.0), 4)}
        else:
            body = {"sentences": rng.sample(long_sents, limits["max_sentences"]), "beam": limits["max_beam"],
                    "alpha": round(rng.uniform(0.0, 2.0), 4)}
        try:
            outcome = request(conn, body)
        except (OSError, http.client.HTTPException) as exc:
            outcome = f"lost:{type(exc).__name__}"
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", phase.port, timeout=60, source_address=(ABUSER, 0))
        phase.note("abusive", outcome)
        if outcome == "429":
            time.sleep(0.01)  # its queue share is full: straight back (a pause keeps this process off the CPU)
    conn.close()


def abusive_extra(phase: Phase) -> None:
    """Connections beyond the abusive client's cap, opened one after another (each should be 429)."""
    body = json.dumps({"sentences": ["A dog."]})
    while phase.running():
        conn = http.client.HTTPConnection("127.0.0.1", phase.port, timeout=30, source_address=(ABUSER, 0))
        try:
            conn.request("POST", "/translate", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            outcome = str(resp.status)
        except (OSError, http.client.HTTPException) as exc:
            outcome = f"reset:{type(exc).__name__}"  # refused and closed at once, before the answer was read
        finally:
            conn.close()
        phase.note("abusive_extra", outcome)
        time.sleep(0.02)


def long_sentences(checkpoint: Path, sents: list[str], max_tokens: int, n: int, seed: int = 0) -> list[str]:
    """``n`` sentences of Multi30k sentences joined to just under ``max_tokens`` source tokens (EOS included)."""
    sys.path.insert(0, str(REPO / "src"))
    from aiayn.decode.loading import load_model_for_inference
    _, src_tok, _ = load_model_for_inference(checkpoint)
    rng, out = random.Random(seed), []
    while len(out) < n:
        text = rng.choice(sents)
        while True:
            longer = f"{text} {rng.choice(sents)}"
            if len(src_tok.encode_batch([longer])[0]) + 1 > max_tokens:
                break
            text = longer
        out.append(text)
    return out


def abusive_client(port: int, seconds: float, long_sents: list[str], limits: dict, small: bool, pipe) -> None:
    """The abusive client's threads, in a process of their own (so that they do not hold up the ordinary
    clients' threads in this one); its outcomes go back through ``pipe``."""
    pipe.recv()  # the go
    phase = Phase(port, seconds)
    threads = [threading.Thread(target=abusive, args=(phase, long_sents, limits, 100 + i, small),
                                daemon=True)
               for i in range(limits["max_connections_per_client"])]
    threads.append(threading.Thread(target=abusive_extra, args=(phase,), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    pipe.send(({k: dict(c) for k, c in phase.outcomes.items()}, round(usage.ru_utime + usage.ru_stime, 1)))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_phase(name: str, port: int, seconds: float, args, sents: list[str], long_sents: list[str] | None,
              limits: dict, server_pid: int) -> dict:
    before, server_cpu, load = scrape_metrics(port), cpu_seconds(server_pid), os.getloadavg()[0]
    abuser_cpu = None
    abuser = None
    if long_sents is not None:
        pipe, child = mp.get_context("spawn").Pipe()
        abuser = mp.get_context("spawn").Process(target=abusive_client, args=(port, seconds, long_sents, limits,
                                                                                args.abuse == "small", child))
        abuser.start()
        pipe.send("go")
    phase = Phase(port, seconds)
    threads = [threading.Thread(target=ordinary, args=(phase, f"127.0.0.{10 + i}", sents, args.think_s, i), daemon=True)
               for i in range(args.ordinary)]
    log.info("phase %s: %d ordinary clients%s for %.0f s", name, len(threads),
             " and an abusive one" if abuser else "", seconds)
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    if abuser is not None:
        outcomes, abuser_cpu = pipe.recv()
        for kind, counts in outcomes.items():
            phase.outcomes[kind].update(counts)
        abuser.join(60)
    after = scrape_metrics(port)
    cpu = {"server_cpu_s": round(cpu_seconds(server_pid) - server_cpu, 1), "abusive_client_cpu_s": abuser_cpu,
           "wall_s": seconds, "loadavg_1min_start": load, "loadavg_1min_end": os.getloadavg()[0]}
    ordinary_total = sum(phase.outcomes["ordinary"].values())
    ordinary_errors = ordinary_total - phase.outcomes["ordinary"]["200"]
    return {
        "ordinary_latency": percentiles(phase.latency),
        "ordinary_requests": ordinary_total,
        "ordinary_error_rate": round(ordinary_errors / max(1, ordinary_total), 4),
        "ordinary_refused": phase.outcomes["ordinary"]["429"] + phase.outcomes["ordinary"]["503"],
        "outcomes": {k: dict(c) for k, c in phase.outcomes.items() if c},
        "cpu": cpu,
        "server_counters": {k: after[k] - before.get(k, 0) for k in after
                            if k.startswith(("aiayn_events", "aiayn_requests_total", "aiayn_model_calls",
                                             "aiayn_skipped"))
                            and after[k] != before.get(k, 0)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=1.5, help="length of each phase (default 1.5)")
    ap.add_argument("--ordinary", type=int, default=4, help="ordinary clients (default 4)")
    ap.add_argument("--think-s", type=float, default=0.2, help="an ordinary client's mean pause between requests")
    ap.add_argument("--abuse", choices=("long", "small"), default="long",
                    help="the abusive client's requests: the longest it may send (default), or a flood of the "
                         "smallest")
    ap.add_argument("--concurrent-calls", type=int, help="the server's --concurrent-calls (default: its default)")
    ap.add_argument("--yield-ms", type=float, help="the server's --yield-ms (default: its default)")
    ap.add_argument("--client-requests-per-s", type=float,
                    help="the server's --client-requests-per-s (default: its default)")
    ap.add_argument("--checkpoint", type=Path, help="checkpoint to serve (default: a tiny one trained here)")
    ap.add_argument("--train-steps", type=int, default=50, help="steps of the tiny checkpoint (default 50)")
    ap.add_argument("--out", type=Path,
                    help="result JSON (default bench/results/<machine-and-date>/serve_fairness.json)")
    args = ap.parse_args()
    setup_logging()
    sents = sentences()
    with tempfile.TemporaryDirectory(prefix="serve-fairness-") as tmp:
        work = Path(tmp)
        checkpoint = args.checkpoint or make_checkpoint(work, args.train_steps)
        port = free_port()
        opts = dict(SERVER_OPTS)
        for flag, value in (("--concurrent-calls", args.concurrent_calls), ("--yield-ms", args.yield_ms),
                            ("--client-requests-per-s", args.client_requests_per_s)):
            if value is not None:
                opts[flag] = str(value)
        proc = start_server(checkpoint, port, work / "server.log", opts, start_s=600)  # a busy machine
        load_start = os.getloadavg()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("GET", "/health")
            limits = json.loads(conn.getresponse().read())["limits"]
            assert request(conn, {"sentences": sents[:3]}) == "200"  # the first model call sets things up
            conn.close()
            long_sents = long_sentences(checkpoint, sents, limits["max_sentence_tokens"], 200)
            phases = {"alone": run_phase("alone", port, 60 * args.minutes, args, sents, None, limits, proc.pid),
                      "abused": run_phase("abused", port, 60 * args.minutes, args, sents, long_sents, limits,
                                          proc.pid)}
        finally:
            proc.terminate()
            proc.wait(30)
        server_log = (work / "server.log").read_text(errors="replace").splitlines()
    p99 = [phases[k]["ordinary_latency"].get("p99_ms") for k in ("alone", "abused")]
    ratio = round(p99[1] / p99[0], 2) if all(p99) else None
    result = {"benchmark": "serve_fairness", "minutes_per_phase": args.minutes, "machine": machine_info(1),
              "nice": os.nice(0), "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
              "checkpoint": str(args.checkpoint) if args.checkpoint else
              f"tiny preset (2 layers, d_model 64) trained {args.train_steps} steps on 2,000 Multi30k pairs",
              "server_options": opts, "limits": limits, "ordinary_clients": args.ordinary,
              "think_s": args.think_s, "abuse": args.abuse, "abusive_long_sentence_chars": sum(map(len, long_sents)) // len(long_sents),
              "phases": phases, "ordinary_p99_ratio": ratio,
              "server_log_tracebacks": sum("Traceback" in x for x in server_log)}
    result["ok"] = (ratio is not None and ratio <= 3.0 and phases["abused"]["ordinary_refused"] == 0
                    and phases["abused"]["ordinary_error_rate"] == 0 and result["server_log_tracebacks"] == 0)
    out = args.out or REPO / "bench" / "results" / result_folder(result["machine"]) / "serve_fairness.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    for name, ph in phases.items():
        lat = ph["ordinary_latency"]
        log.info("%s: ordinary p50/p99 %s/%s ms over %d requests, error rate %.4f, refused %d", name,
                 lat.get("p50_ms"), lat.get("p99_ms"), ph["ordinary_requests"], ph["ordinary_error_rate"],
                 ph["ordinary_refused"])
    log.info("wrote %s: p99 ratio %s (target <= 3), ok=%s", out, ratio, result["ok"])
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
