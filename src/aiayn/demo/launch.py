"""torchrun's launcher (``torch.distributed.run``) for the data-parallel training the demo starts:
the same launcher, but stopped by a signal (Ctrl-C reaches it with its ranks, one process group) it
ends with the signal's status, 128 + N, and no traceback or warnings of its own (``SIGNAL_LINES``); each
rank says in one line where the run resumes. The folder of the ranks' error files (``--log-dir``) is, unless given, a
temporary one deleted at the end: torchrun's own stays in the system's temporary folder, one a run.
``python -m aiayn.demo.launch`` takes torchrun's arguments."""
from __future__ import annotations

import logging
import sys
import tempfile

# torchrun's warnings when a signal stops it ("Received 2 death signal, shutting down workers", then one
# "Sending process PID closing signal SIGINT" a rank): its loggers and their messages' formats
SIGNAL_LINES = {"torch.distributed.elastic.agent.server.api": "Received %s death signal, shutting down workers",
                "torch.distributed.elastic.multiprocessing.api": "Sending process %s closing signal %s"}


def _quiet_signal_lines() -> None:
    """Drop ``SIGNAL_LINES``: a Ctrl-C is the user's own, and the demo says in one line where it resumes."""
    for name, msg in SIGNAL_LINES.items():
        logging.getLogger(name).addFilter(lambda record, msg=msg: record.msg != msg)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun
    argv = sys.argv[1:] if argv is None else argv
    _quiet_signal_lines()
    try:
        with tempfile.TemporaryDirectory(prefix="aiayn-launch-") as logs:
            torchrun(["--log-dir", logs, *argv])  # first: a --log-dir of the caller's comes later and wins
    except SignalException as exc:  # torchrun's own report of SIGINT/SIGTERM, a traceback where uncaught
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
