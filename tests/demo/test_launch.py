"""The demo's launcher of data-parallel training (aiayn.demo.launch): torchrun's, quiet when a
Ctrl-C stops it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

RANK = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))  # a rank that says nothing when interrupted
    open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}"), "w").close()
    time.sleep(120)
""")


def test_an_interrupted_launcher_ends_with_130_and_no_traceback(tmp_path):
    """Ctrl-C sends SIGINT to the launcher and its ranks (one process group): torchrun raises its
    SignalException, a 20-line traceback where uncaught, and warns of the signal and of each rank it
    stops; the launcher ends with 128 + 2, quietly."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    proc = subprocess.Popen([sys.executable, "-m", "aiayn.demo.launch", "--standalone", "--nproc_per_node=2",
                             str(script), str(tmp_path)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "SignalException" not in err, err
    assert "death signal" not in err and "closing signal" not in err, err  # torchrun's warnings on a signal


def test_the_launcher_leaves_nothing_in_the_temporary_folder(tmp_path):
    """torchrun makes a folder for the ranks' error files in the system's temporary folder
    (``torchelastic_*``) and leaves it there, one for every run."""
    script, tmp = tmp_path / "rank.py", tmp_path / "tmp"
    script.write_text("import os, sys\nopen(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').close()\n")
    tmp.mkdir()
    done = subprocess.run([sys.executable, "-m", "aiayn.demo.launch", "--standalone", "--nproc_per_node=2",
                           str(script), str(tmp_path)], env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "rank0").exists() and (tmp_path / "rank1").exists()
    assert sorted(p.name for p in tmp.iterdir()) == []
