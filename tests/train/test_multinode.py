"""Two nodes: two torchrun launchers joined by a c10d rendezvous train as one node of two processes,
bit for bit (on this machine, CPU and gloo; NCCL across real nodes is not tested here: docs/training.md)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiayn import checkpoint as ck
from tests.train.test_training import _free_port, _logged, _torchrun_cmd, _train_cmd, _wait_for_all

# dropout on, so the ranks' generators matter; a time budget never reached; room for a slow start
EXTRA = ["--set", "model.p_drop=0.1", "--set", "train.max_time_min=1000", "--set", "train.dist_timeout_s=600"]
STEPS = 4


def _node_cmd(node_rank: int, port: int, argv: list[str]) -> list[str]:
    """One node's launcher: as on a cluster, but with the rendezvous on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "aiayn-two-nodes", "-m", "aiayn.cli", *argv]


@pytest.mark.slow
def test_two_nodes_train_as_one_node_of_two_processes(small_data_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = tmp_path / "one_node"
    res = subprocess.run(_torchrun_cmd(small_data_dir, one, STEPS, EXTRA), env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]

    two = tmp_path / "two_nodes"
    argv = _train_cmd(small_data_dir, two, STEPS, EXTRA)[3:]  # (after: python -m aiayn.cli)
    port = _free_port()
    logs = [open(tmp_path / f"node{r}.log", "w") for r in range(2)]
    nodes = [subprocess.Popen(_node_cmd(r, port, argv), env=env, stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(2)]
    assert _wait_for_all(nodes, logs) == [0, 0], "".join((tmp_path / f"node{r}.log").read_text()[-2000:]
                                                          for r in range(2))

    a, b = ck.load_checkpoint(one / "last.pt"), ck.load_checkpoint(two / "last.pt")
    assert a["step"] == b["step"] == STEPS and a["tokens"] == b["tokens"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert _logged(one) == _logged(two) and sorted(_logged(two)) == list(range(1, STEPS + 1))  # the losses, exactly
    assert len(b["rank_rng"]) == 2  # two ranks, one on each node


@pytest.mark.slow
def test_nodes_that_see_other_run_directories_are_refused_at_once(small_data_dir, tmp_path):
    """RUN not on a file system the nodes share: one node finds the run's checkpoint, the other none.
    Every rank stops at the start, saying what each found, instead of training from two states until
    one waits out train.dist_timeout_s; the run directory is as it was on each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    seen, empty = tmp_path / "node_a", tmp_path / "node_b"
    seen.mkdir()
    empty.mkdir()
    argv = _train_cmd(small_data_dir, Path("run"), STEPS, [*EXTRA[:-2], "--set", "train.dist_timeout_s=60"])[3:]
    subprocess.run(_train_cmd(small_data_dir, Path("run"), 2, EXTRA[:-2]), env=env, cwd=seen, check=True,
                   capture_output=True)
    before = {p.name: p.read_bytes() for p in (seen / "run").iterdir() if p.is_file()}
    port = _free_port()
    logs = [open(tmp_path / f"node{r}.log", "w") for r in range(2)]
    nodes = [subprocess.Popen(_node_cmd(r, port, argv), env=env, cwd=folder, stdout=logs[r], stderr=subprocess.STDOUT)
             for r, folder in enumerate((seen, empty))]
    try:  # (each node's end awaited: a launcher killed early could end its rank within its start)
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        for node, log in zip(nodes, logs):
            node.kill()
            log.close()
    said = "".join((tmp_path / f"node{r}.log").read_text() for r in range(2))
    assert codes[0] and codes[1], said[-3000:]
    assert "--out: rank 1 finds " in said and "every process must read the same --out and --data" in said, said[-3000:]
    assert "last.pt at step 2" in said and "no checkpoint (a new run)" in said
    assert "waited train.dist_timeout_s" not in said and "lost its connection" not in said, said[-3000:]
    assert not (empty / "run").exists()
    assert {p.name: p.read_bytes() for p in (seen / "run").iterdir() if p.is_file()} == before


SBATCH = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "train.sbatch"


@pytest.mark.parametrize("gpus", [{"SLURM_GPUS_ON_NODE": "4"}, {"SLURM_GPUS_PER_NODE": "a100:4"}])
def test_the_sbatch_script_starts_one_launcher_per_node_with_the_rendezvous_on_the_first(tmp_path, gpus):
    """scripts/slurm/train.sbatch with stand-ins for scontrol (two hosts) and srun (prints its command)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n')
    (bin_dir / "srun").write_text('#!/bin/sh\necho "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_ID": "42", **gpus}
    res = subprocess.run(["bash", str(SBATCH), "DATA", "RECIPE", "RUN", "--set", "train.accum_steps=1"], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [
        "--ntasks-per-node=1", "--kill-on-bad-exit=1", "torchrun", "--nnodes", "2", "--nproc-per-node", "4",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu07:29500", "--rdzv-id", "aiayn-42", "-m", "aiayn.cli",
        "train", "--data", "DATA", "--recipe", "RECIPE", "--out", "RUN", "--no-progress", "--set",
        "train.accum_steps=1"]
    assert "2 node(s) x 4 GPU(s), rendezvous on gpu07:29500" in res.stderr
    env.pop(next(iter(gpus)))
    res = subprocess.run(["bash", str(SBATCH), "DATA", "RECIPE", "RUN"], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "submit with --gpus-per-node G" in res.stderr
