"""What a run shows while it trains (the main rank's): ``train_log.jsonl``, TensorBoard curves, the
tqdm bar on a terminal (a log line at each train-log step elsewhere), and at the end ``summary.json``
with the paper's training-cost estimate (Table 2). docs/training.md lists every field and its unit.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import sys
import time
from pathlib import Path

from aiayn.files import atomic_write, write_json_atomic
from aiayn.progress import progress_shown
from aiayn.train import runtime as rt
from aiayn.checkpoint.run import TrainState

log = logging.getLogger(__name__)


class Monitor:
    """The main rank's outputs while training: ``train_log.jsonl``, TensorBoard curves and the
    tqdm bar. On the other ranks every method does nothing (the one place rank decides them).
    ``progress``: a bar where stderr is a terminal (``aiayn.progress.progress_shown``), the log lines
    going above it; without one (a pipe, a file, ``--no-progress``) each train-log step is a log line."""

    def __init__(self, run_dir: Path, state: TrainState, is_main: bool, progress: bool, max_steps: int):
        self.run_dir, self.state, self.is_main = run_dir, state, is_main
        self.jsonl = self.writer = self.bar = self.earlier_summary = None
        self.logs_above_bar = contextlib.ExitStack()
        self.max_steps = max_steps if max_steps < 1_000_000 else None  # a time-bounded run has no step total
        self.window_tokens, self.window_t0 = 0, time.monotonic()  # since the last train-log line
        if not is_main:
            return
        # A resumed run trains again the steps after its checkpoint: what the interrupted run logged of
        # them is dropped (the train log's lines, TensorBoard's events from the next step on), so that
        # each step has the numbers of the weights it went on from.
        forget_after(run_dir / "train_log.jsonl", state.step)
        # a finished run's summary, which a run that trains on from its checkpoint outdates (``advance``)
        self.earlier_summary = run_dir / "summary.json"
        self.jsonl = open(run_dir / "train_log.jsonl", "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
            _after_earlier_events(run_dir / "tensorboard")
            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=state.step + 1)
        except ImportError:  # tensorboard is a dependency, but keep training without it
            self.writer = None
        if progress and progress_shown():
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm
            self.bar = tqdm(total=self.max_steps, initial=state.step, unit="step", file=sys.stderr,
                            dynamic_ncols=True, mininterval=2.0)
            self.logs_above_bar.enter_context(logging_redirect_tqdm())  # a log line never lands on the bar

    def scalars(self, values: dict) -> None:
        """One line of ``train_log.jsonl`` at the current step; the numbers also to TensorBoard."""
        if not self.is_main:
            return
        self.jsonl.write(json.dumps({"step": self.state.step, **values}) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, self.state.step)

    def count(self, tokens: int) -> None:
        """Target tokens trained on since the last synchronization point (for ``tokens_per_s``)."""
        self.window_tokens += tokens

    @contextlib.contextmanager
    def paused(self):
        """Time that is not training (validation, checkpoints), left out of ``tokens_per_s``."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.window_t0 += time.monotonic() - t0

    def train_step(self, loss: float, nll: float, kl: float | None, tokens: float, lr: float, norm: float,
                   lr_at: dict | None = None) -> None:
        """A line of the train log and the progress bar's numbers (without a bar, a log line): the
        step's sums per target token in nats (``kl``: R-Drop's, or None) and e to the NLL, its rate and
        the progress the rate was taken at (``lr_at``: ``Schedule.rate``'s keywords, from which
        ``aiayn plot lr --run`` recomputes it), its gradients' norm before clipping (fairseq's gnorm),
        and the target tokens per second of training since the last line."""
        if not self.is_main:
            return
        tps = self.window_tokens / max(time.monotonic() - self.window_t0, 1e-9)
        self.window_tokens, self.window_t0 = 0, time.monotonic()
        state = self.state
        ppl = math.exp(min(nll / tokens, 50))  # (valid_ppl's cap: e^50 is past any model's)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss / tokens:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", ep=state.epoch)
        else:
            total = f"/{self.max_steps}" if self.max_steps is not None else ""
            log.info("step %d%s: loss %.3f nll %.3f ppl %.2f lr %.3g grad_norm %.3f tok/s %s epoch %d", state.step,
                     total, loss / tokens, nll / tokens, ppl, lr, norm, f"{tps:,.0f}", state.epoch)
        rss = rt.resident_mb()
        self.scalars({"train_loss": loss / tokens, "train_nll": nll / tokens, "train_ppl": ppl, "lr": lr,
                      **({"lr_at": lr_at} if lr_at else {}), "grad_norm": norm,
                      **({"train_kl": kl / tokens} if kl is not None else {}),
                      "tokens_per_s": tps, "epoch": state.epoch, "elapsed_s": state.train_seconds,
                      **({"rss_mb": rss} if rss is not None else {})})

    def advance(self) -> None:
        """A step counted. At the first, a finished run's ``summary.json`` is removed: the run goes on
        past the checkpoint it describes, and a new one is written at the end (a run stopped before
        then has none, rather than one that says it finished at an earlier step)."""
        if self.earlier_summary is not None:
            self.earlier_summary.unlink(missing_ok=True)
            self.earlier_summary = None
        if self.bar is not None:
            self.bar.update(1)

    def close(self, summary: dict) -> None:
        """The end of the run: ``summary.json`` (the demo reads its presence as "trained"), its text
        printed, and the outputs closed."""
        if not self.is_main:
            return
        write_json_atomic(self.run_dir / "summary.json", summary)
        self.end()
        print(summary_text(summary), flush=True)

    def end(self) -> None:
        """Close the outputs, at the run's end or on its way out (Ctrl-C, an error): the bar ended with
        its line, so that what follows starts a line of its own; TensorBoard's queued events written."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.logs_above_bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None


EVENT_FILE = re.compile(r"events\.out\.tfevents\.(\d+)\.")  # TensorBoard's: the second it was made, host, pid, a count


def _after_earlier_events(folder: Path) -> None:
    """Wait, if need be, into the second after the last that an event file in ``folder`` was made in.
    TensorBoard reads a folder's event files in the order of their names, which begin with that second
    and end with the pid and an unpadded count: a resumed run's file made in the same second could
    be read before the one it continues (".10" before ".9"), and its steps then purged as a restart's."""
    stamps = [int(m.group(1)) for p in folder.glob("events.out.tfevents.*") if (m := EVENT_FILE.match(p.name))]
    if stamps and max(stamps) == int(time.time()):
        time.sleep(max(stamps) + 1 - time.time())


def forget_after(log: Path, step: int) -> None:
    """Rewrite the train log ``log`` (atomically) without its lines of steps after ``step``, the
    checkpoint a run resumes from, and without a line cut short by a kill; unchanged if it has none."""
    try:
        lines = log.read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        return
    kept = [line for line in lines if _logged_step(line) <= step]
    if len(kept) != len(lines):
        atomic_write(log, lambda f: f.write("".join(kept).encode("utf-8")))


def _logged_step(line: str) -> float:
    """The step of a train log line; infinity for a line that is not a complete JSON object with one."""
    try:
        value = json.loads(line) if line.endswith("\n") else None
    except ValueError:
        value = None
    step = value.get("step") if isinstance(value, dict) else None
    return step if isinstance(step, int) else math.inf


def summary(state: TrainState, best_metric: str, n_params: int, place: rt.Place, stop_reason: str,
            valid: dict | None, epochs: float) -> dict:
    """Run summary with the paper's training-cost estimate (Table 2) beside the counted FLOPs. ``epochs``:
    the epochs trained, fractional (``BatchStream.epochs``: the epochs completed and the share of the
    current one's batches trained), over the whole run, a resumed one included, as ``steps``."""
    dist, device = place.dist, place.device
    peak = rt.matmul_tflops(device)
    hours = state.train_seconds / 3600
    return {
        "steps": state.step, "epochs": round(epochs, 6), "stop_reason": stop_reason,
        "target_tokens": state.tokens, "train_seconds": round(state.train_seconds, 1),
        "tokens_per_s": round(state.tokens / max(state.train_seconds, 1e-9), 1),
        "params": n_params, "devices": dist.world_size, "device": str(device), "precision": place.precision,
        "valid": valid, "best_valid_loss": state.best_valid_loss,
        **({"best_valid_bleu": state.best_valid_bleu} if math.isfinite(state.best_valid_bleu) else {}),
        "best_metric": best_metric,
        "valid_seconds": round(state.valid_seconds, 1), "valid_bleu_seconds": round(state.valid_bleu_seconds, 1),
        "counted_flops": state.flops,
        "device_fp32_matmul_tflops": round(peak, 4),
        # Table 2: training time x number of devices x sustained FLOP/s of the device
        "table2_cost_estimate_flops": state.train_seconds * dist.world_size * peak * 1e12,
        "model_flops_utilization_vs_fp32_matmul": state.flops / max(state.train_seconds * dist.world_size * peak * 1e12, 1),
        "hours": round(hours, 3),
    }


def summary_text(s: dict) -> str:
    v = s["valid"] or {}
    vtxt = f", valid loss {v['valid_loss']:.3f} ppl {v['valid_ppl']:.2f}" if v else ""
    vtxt += f" BLEU {v['valid_bleu']:.2f}" if "valid_bleu" in v else ""  # (train.valid_bleu)
    return (f"trained {s['steps']} steps ({s['epochs']:.2f} epochs, {s['target_tokens']:,} target tokens) in "
            f"{s['train_seconds']:.0f} s, {s['tokens_per_s']:,.0f} tok/s, stop: {s['stop_reason']}{vtxt}\n"
            f"cost: counted {s['counted_flops']:.3g} FLOPs; Table 2 estimate (time x devices x "
            f"{s['device_fp32_matmul_tflops']:.3f} TFLOP/s) {s['table2_cost_estimate_flops']:.3g} FLOPs")
