"""torchrun's launcher (``torch.distributed.run``) for the data-parallel training the demo starts:
the same launcher, but stopped by a signal (Ctrl-C reaches it with its ranks, one process group) it
ends with the signal's status, 128 + N, and no traceback of its own; each rank says in one line
where the run resumes. The folder of the ranks' error files (``--log-dir``) is, unless given, a
temporary one deleted at the end: torchrun's own stays in the system's temporary folder, one a run.
``python -m aiayn.demo.launch`` takes torchrun's arguments."""
from __future__ import annotations

import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun
    argv = sys.argv[1:] if argv is None else argv
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
