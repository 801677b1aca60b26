"""A run stopped on 2 processes resumes on 1, and one stopped on 1 resumes on 2, continuing its epoch
with exactly the pairs it had not trained on (CPU, gloo; docs/checkpoints.md, "Data-parallel resume")."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn import checkpoint as ck
from tests.train.test_training import _train_cmd

# Runs `aiayn train` and writes the pairs of every step it takes: one line a step, this rank's
# batches as lists of pair indices, to $PAIRS_LOG.rankR.
RECORDER = """
import json, os, sys
from aiayn.cli import main
from aiayn.train.step import TrainStep

take_step = TrainStep.step

def recorded(self, micro, *args, **kwargs):
    with open(os.environ["PAIRS_LOG"] + ".rank" + os.environ.get("RANK", "0"), "a") as f:
        f.write(json.dumps([b.indices.tolist() for b in micro]) + "\\n")
    return take_step(self, micro, *args, **kwargs)

TrainStep.step = recorded
sys.exit(main(sys.argv[1:]))
"""


def _run(recorder: Path, data: Path, out: Path, processes: int, steps: int, log: Path, *sets: str) -> str:
    """Train ``out`` to ``steps`` on ``processes`` processes (torchrun for 2), recording each step's
    pairs; returns stderr."""
    extra = ["--set", "model.p_drop=0.1", "--set", "train.max_time_min=1000",
             *[a for kv in sets for a in ("--set", kv)]]
    argv = _train_cmd(data, out, steps, extra)[3:]  # (after: python -m aiayn.cli)
    launch = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      f"--nproc_per_node={processes}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PAIRS_LOG": str(log)}
    res = subprocess.run([*launch, str(recorder), *argv], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stderr


def _steps(log: Path, processes: int) -> list[list[list[int]]]:
    """[step][rank] -> that rank's batch of the step (one batch a step: accum_steps 1)."""
    ranks = [[json.loads(line) for line in Path(f"{log}.rank{r}").read_text().splitlines()] for r in range(processes)]
    assert len({len(r) for r in ranks}) == 1
    return [[r[k][0] for r in ranks] for k in range(len(ranks[0]))]


@pytest.mark.slow
def test_resume_on_another_number_of_processes_trains_the_pairs_not_yet_seen(small_data_dir, tmp_path):
    """One process trains 12 steps: the reference order of epoch 0's batches. A run trains 3 steps on
    2 processes (batches 0-5), then resumes on 1 to step 9 (batches 6-11); another trains 3 steps on 1
    process, then resumes on 2 to step 6 (step k, rank r: batch 3 + 2k + r). Each takes the
    reference's batches in order, no pair twice. (The epoch's end: tests/data/test_resume_ranks.py.)"""
    recorder = tmp_path / "record.py"
    recorder.write_text(RECORDER)
    _run(recorder, small_data_dir, tmp_path / "ref", 1, 12, tmp_path / "ref.pairs")
    order = [s[0] for s in _steps(tmp_path / "ref.pairs", 1)]
    for before, after, stop, end in ((2, 1, 3, 9), (1, 2, 3, 6)):
        run = tmp_path / f"run{before}{after}"
        _run(recorder, small_data_dir, run, before, stop, tmp_path / f"{run.name}a.pairs")
        assert ck.load_checkpoint(run / "last.pt")["sampler"]["batches_done"] == stop * before
        err = _run(recorder, small_data_dir, run, after, end, tmp_path / f"{run.name}b.pairs")
        assert err.count(f"trained by {before} process(es), resumed by {after}") == 1  # one warning, main rank's
        assert "every rank starts from the main rank's generator states" in err
        assert f"a step holds {after} batches, was {before} (train.accum_steps)" in err  # accum_steps 1

        first = [b for step in _steps(tmp_path / f"{run.name}a.pairs", before) for b in step]
        rest = [b for step in _steps(tmp_path / f"{run.name}b.pairs", after) for b in step]
        assert first == order[:stop * before]
        assert rest == order[stop * before:stop * before + (end - stop) * after]  # in the epoch's order
        seen, now = {i for b in first for i in b}, [i for b in rest for i in b]
        assert len(now) == len(set(now)) and not seen & set(now)  # no pair twice
        assert ck.load_checkpoint(run / "last.pt")["sampler"]["batches_done"] == len(first) + len(rest)


def test_ranks_that_share_their_gradients_resume_with_one_adam(caplog):
    """A local-SGD checkpoint keeps an Adam state per rank. Resumed as local SGD on as many ranks,
    each rank takes its own; resumed as DDP, every rank keeps the main rank's (which the restore
    gave), since different moments would turn one averaged gradient into different updates and the
    ranks' weights would drift apart without a word."""
    import logging
    import torch
    from types import SimpleNamespace
    from aiayn.train import runtime as rt
    from aiayn.train.parallel import DataParallel, LocalSGD

    def adam_after(steps: int) -> dict:
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.Adam([w], lr=0.1)
        for k in range(steps):
            w.grad = torch.full((3,), float(k + 1))
            opt.step()
        return opt.state_dict()

    main_rank, rank1 = adam_after(1), adam_after(3)
    saved = SimpleNamespace(rank_optimizers=[main_rank, rank1], optimizer=main_rank)
    for strategy, rank, expected in ((LocalSGD(rt.Place(rt.Dist(1, 2), torch.device("cpu"), "fp32"), 2), 1, rank1),
                                     (DataParallel(rt.Place(rt.Dist(1, 2), torch.device("cpu"), "fp32")), 1, main_rank),
                                     (DataParallel(rt.Place(rt.Dist(0, 2), torch.device("cpu"), "fp32")), 0, main_rank)):
        opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.1)
        opt.load_state_dict(main_rank)  # what Learner.restore gave every rank
        with caplog.at_level(logging.WARNING):
            strategy.resume_optimizer(opt, saved)
        state = opt.state_dict()["state"][0]
        assert int(state["step"]) == int(expected["state"][0]["step"]), (type(strategy).__name__, rank)
        assert torch.equal(state["exp_avg"], expected["state"][0]["exp_avg"])
    assert caplog.text.count("this run shares one among its ranks: the main rank's") == 1  # said by the main rank
