"""``aiayn serve`` interrupted twice (Ctrl-C, Ctrl-C) while a request is being translated: the
request is answered 503 with a JSON error, as every refused request is, and the process ends at
once with status 130, not with an abort of a worker thread still in the model at Python's exit.
A real process (its signals, its exit), serving the tiny checkpoint with a translation that lasts
until it is stopped."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from aiayn.serve.server import FORCED_ANSWERS_S, FORCED_EXIT, FORCED_WORKERS_S

# `aiayn serve` whose model call repeats its search until the call's ``stop`` ends it (a request
# that holds a worker for as long as the service lets it)
ENDLESS = """
import sys
from aiayn.cli import main
from aiayn.decode.translator import Translator
search = Translator.translate_ids
def translate_ids(self, ids, prefixes=None, progress=None, stop=None):
    print("translating", file=sys.stderr, flush=True)
    while True:
        search(self, ids, prefixes, progress, stop)  # raises Stopped once stop() says so
Translator.translate_ids = translate_ids
sys.exit(main(sys.argv[1:]))
"""
APP_STOP_S = 5.0  # what the app's own shutdown waits for the workers at most (serve/app.py's lifespan)
EXIT_BOUND_S = FORCED_ANSWERS_S + FORCED_WORKERS_S + APP_STOP_S + 10.0  # + 10 s for Python's exit on a busy machine


class Lines:
    """The lines a process writes to stderr, read as they come; ``wait_for`` a pattern."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match:
        end = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                left = end - time.monotonic()
                assert left > 0, f"no line matched {pattern!r}:\n{''.join(self.lines)[-3000:]}"
                self._changed.wait(left)


def _post(url: str, body: dict, answers: list) -> None:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            answers.append((r.status, r.read()))
    except urllib.error.HTTPError as e:
        answers.append((e.code, e.read()))


def _interrupted(checkpoint, extra: list[str], interrupt) -> tuple[int, list, str]:
    """`aiayn serve` of ``checkpoint`` (with ``extra`` options) translating one request without end,
    then ``interrupt(proc, err)`` (signals; returns the exit status): the status, the request's
    answers and what the process wrote to stderr."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    proc = subprocess.Popen([sys.executable, "-c", ENDLESS, "serve", "--checkpoint", str(checkpoint),
                             "--port", "0", "--threads", "1", *extra], env=env, stderr=subprocess.PIPE, text=True)
    try:
        err = Lines(proc.stderr)
        port = err.wait_for(r"serving .* on http://127\.0\.0\.1:(\d+)/").group(1)
        answers: list = []
        client = threading.Thread(target=_post, args=(f"http://127.0.0.1:{port}/translate",
                                                      {"sentences": ["A man rides a bicycle."]}, answers))
        client.start()
        err.wait_for("^translating")
        rc = interrupt(proc, err)
        client.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, answers, "".join(err.lines)


def test_ctrl_c_twice_answers_the_request_in_progress_503_and_exits_130(tiny_checkpoint):
    def twice(proc, err):
        proc.send_signal(signal.SIGINT)
        err.wait_for("signal 2: new requests get 503")
        proc.send_signal(signal.SIGINT)
        return proc.wait(EXIT_BOUND_S)
    rc, answers, text = _interrupted(tiny_checkpoint, [], twice)
    assert rc == FORCED_EXIT, text[-3000:]
    [(status, body)] = answers
    assert status == 503 and "stopped before the request was translated" in json.loads(body)["error"], body
    assert "terminate called" not in text and "Traceback" not in text, text[-3000:]


def test_a_call_running_past_the_drain_is_answered_503_before_uvicorn_cancels_it(tiny_checkpoint):
    """One SIGTERM, a request whose model call outlasts the drain (``--shutdown-timeout-s 1``) and
    uvicorn's graceful time after it (+ 5 s): the request is answered 503 with the JSON error before
    uvicorn cancels its task (which answered starlette's plain 500), and the command ends as a
    drained SIGTERM does (uvicorn raises the signal again once it has shut down: -15; 0 where an older
    uvicorn does not)."""
    def once(proc, err):
        proc.send_signal(signal.SIGTERM)
        return proc.wait(1 + 5 + APP_STOP_S + 10.0)
    rc, answers, text = _interrupted(tiny_checkpoint, ["--shutdown-timeout-s", "1"], once)
    [(status, body)] = answers
    assert status == 503 and "stopped before the request was translated" in json.loads(body)["error"], body
    assert rc in (0, -signal.SIGTERM) and "terminate called" not in text and "Traceback" not in text, text[-3000:]
