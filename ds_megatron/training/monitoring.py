"""What the training loop reports and where: ``metrics.jsonl``, the rank-0 progress line, DeepSpeed's monitors;
and the guard that stops a run whose loss is no longer finite.

``PendingSteps`` keeps each step's loss (and MoE routing losses) on the device and brings the
steps of a log interval to the host with one all-reduce and one read.  ``Reporter.report`` takes
the steps the loop just brought to the host (one read per
``log_interval``) with their host-side fields and, for each step:

* appends a strict-JSON record to ``metrics.jsonl`` (rank 0; non-finite values as null);
* sends the same values to DeepSpeed's monitors (``MONITOR_EVENTS``; x = samples seen, DeepSpeed's
  convention): ``engine.monitor``, the ``MonitorMaster`` DeepSpeed builds from the ``tensorboard`` /
  ``wandb`` / ``comet`` / ``csv_monitor`` sections, through its public ``write_events`` (it writes on
  global rank 0 only); DeepSpeed writes the learning rate after each step, and with fp16 the loss
  scale, itself;
* checks them with the ``NonFiniteGuard`` (every rank: the values are the same on all of them,
  so all stop at the same step);

then prints one progress line for the interval: loss, lr, tokens/s, grad norm, loss scale, peak
memory, ETA.  On a terminal at least ``MIN_BAR_COLUMNS`` wide the line is a tqdm bar's postfix;
otherwise (a log file, a pipe, a zero-width terminal) it is printed.
"""
from __future__ import annotations

import math
import os
import resource
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from tqdm import tqdm

from ..errors import NonFiniteLossError
from ..models.gpt import MTP_LOSS
from ..parallel_state import ParallelGroup
from ..utils.collectives import all_reduce
from .metrics import MetricsLog, progress_text

Event = Tuple[str, float, int]  # a DeepSpeed monitor event: (name, value, samples seen)

MIN_BAR_COLUMNS = 40
MONITOR_EVENTS = {"loss": "Train/Samples/train_loss", "grad_norm": "Train/Samples/grad_norm",
                  "loss_scale": "Train/Samples/loss_scale", "tokens_per_s": "Train/Samples/tokens_per_second",
                  "skipped_steps": "Train/Samples/skipped_steps", "val_loss": "Validation/Samples/loss"}


def peak_memory_bytes(device) -> int:
    """This rank's peak memory: the CUDA allocator's peak on a GPU, the process's peak RSS on a CPU."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def terminal_columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class ProgressOutput:
    """Rank 0's progress: a tqdm bar on a wide enough terminal, else one printed line per log step."""

    def __init__(self, total: int, initial: int, stream=None, enabled: bool = True):
        self.total, self.enabled = total, enabled
        self.stream = stream if stream is not None else sys.stdout
        self.bar = None
        if enabled and self.stream.isatty() and terminal_columns(self.stream) >= MIN_BAR_COLUMNS:
            self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True, file=self.stream,
                            mininterval=0.5)

    def step(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and terminal_columns(self.stream) >= MIN_BAR_COLUMNS:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(text)
        else:
            self.message(f"step {step}/{self.total} | {text}")

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class NonFiniteGuard:
    """Megatron's ``check_for_nan_in_loss_and_grad`` for a whole run.

    A step is bad when its loss is not finite, or when its update was skipped for non-finite
    gradients and no fp16 loss scaling explains the skip (fp16's scaler skips steps on purpose
    while it finds its scale; those have finite losses).  ``max_steps`` bad steps in a row raise
    ``NonFiniteLossError``.
    """

    def __init__(self, enabled: bool, max_steps: int, loss_scaling: bool):
        self.enabled, self.max_steps, self.loss_scaling = enabled, max_steps, loss_scaling
        self.consecutive = 0

    def check(self, step: int, loss: float, skipped: bool) -> None:
        if not self.enabled:
            return
        bad_loss = not math.isfinite(loss)
        if bad_loss or (skipped and not self.loss_scaling):
            self.consecutive += 1
        else:
            self.consecutive = 0
            return
        if self.consecutive >= self.max_steps:
            what = f"the loss is {loss!r}" if bad_loss else "the update was skipped for non-finite gradients"
            raise NonFiniteLossError(
                f"step {step}: {what}, {self.consecutive} step(s) in a row (megatron.train."
                f"max_consecutive_nonfinite_steps={self.max_steps}); stopping. Check the data against the model "
                "(token ids below vocab_size), lower the learning rate, or turn megatron.train."
                "check_for_nan_in_loss_and_grad off to train on anyway")


def write_monitor_events(engine, events: List[Event]) -> None:
    """``engine.monitor.write_events(events)`` when a monitor section is enabled."""
    monitor = getattr(engine, "monitor", None)
    if events and monitor is not None and monitor.enabled:
        monitor.write_events(events)


def monitor_events(record: Dict[str, Any], samples: int, skip: Tuple[str, ...] = ()) -> List[Event]:
    """The DeepSpeed monitor events of one metrics record (finite numbers only)."""
    return [(name, float(record[key]), samples) for key, name in MONITOR_EVENTS.items()
            if key not in skip and isinstance(record.get(key), (int, float)) and not isinstance(record[key], bool)
            and math.isfinite(record[key])]


class PendingSteps:
    """Per-step values kept on the device and brought to the host once per log interval.

    Every ``add`` stores this step's loss (and the MoE routing losses) as device
    tensors; ``flush`` stacks all pending values, averages them over the
    data-parallel group with one all-reduce and reads them with one ``tolist()``:
    one host sync per log interval instead of several per step.
    """

    def __init__(self, dp: ParallelGroup, pipeline: Optional[ParallelGroup] = None):
        self.dp = dp
        # Pipeline: each stage tracks its own layers' routing losses (summed over the stages at flush), and
        # the logged loss adds them, as the PP=1 model's loss does (the last stage's MTP loss is in it already).
        self.pipeline = pipeline
        self.steps: List[int] = []
        self.values: List[Any] = []  # one 1-D device tensor per step: [loss, *moe losses]
        self.names: List[str] = []

    def add(self, step: int, loss, moe_losses: Dict[str, Any]) -> None:
        names = list(moe_losses)
        if self.steps and names != self.names:
            raise RuntimeError(f"step {step} reports MoE losses {names} but earlier steps {self.names}")
        self.names = names
        self.steps.append(step)
        self.values.append(torch.stack([loss.double(), *(v.double() for v in moe_losses.values())]))

    def flush(self) -> List[Tuple[int, float, Dict[str, float]]]:
        """[(step, loss, {moe loss name: value})] averaged over data parallel; one all-reduce, one sync."""
        if not self.steps:
            return []
        stacked = torch.stack(self.values)
        if self.pipeline is not None and self.names:
            moe = stacked[:, 1:].contiguous()
            all_reduce(moe, self.pipeline)
            # The routing losses join the logged loss; the MTP loss is in the last stage's loss already (scaled).
            routing = torch.tensor([name != MTP_LOSS for name in self.names], dtype=moe.dtype, device=moe.device)
            stacked = torch.cat([stacked[:, :1] + (moe * routing).sum(dim=1, keepdim=True), moe], dim=1)
        all_reduce(stacked, self.dp)
        rows = (stacked / self.dp.size).tolist()
        out = [(step, row[0], dict(zip(self.names, row[1:]))) for step, row in zip(self.steps, rows)]
        self.steps, self.values = [], []
        return out


class Reporter:
    """Writes, sends, checks and prints what the loop reports (see the module docstring)."""

    def __init__(self, engine, log: Optional[MetricsLog], progress: ProgressOutput, guard: NonFiniteGuard,
                 train_iters: int, tokens_per_step: int, device):
        self.engine, self.log, self.progress, self.guard = engine, log, progress, guard
        self.train_iters, self.tokens_per_step, self.device = train_iters, tokens_per_step, device
        # DeepSpeed writes the lr (and, with fp16, the loss scale) itself.
        self.skip_events = ("loss_scale",) if engine.fp16_enabled() else ()

    def report(self, rows: List[Tuple[int, float, Dict[str, float]]], records: Dict[int, Dict[str, Any]],
               seconds: float, steps: int) -> None:
        """``rows``: (step, DP-averaged loss, MoE losses) as ``PendingSteps.flush`` returns them;
        ``records``: the host-side fields of those steps (popped); ``seconds`` / ``steps``: the
        training time and steps of this interval (tokens/s and ETA)."""
        if not rows:
            return
        tok_s = self.tokens_per_step * steps / seconds if seconds > 0 else 0.0
        sec_per_step = seconds / steps if steps else 0.0
        record: Dict[str, Any] = {}
        skipped = []
        for step, loss, moe_losses in rows:
            host = records.pop(step)
            skipped.append(host.pop("skipped", False))
            record = {"step": step, "loss": loss, **host, **moe_losses}
            if step == rows[-1][0]:
                record["tokens_per_s"] = tok_s
            if self.log is not None:
                self.log.write(record)
                write_monitor_events(self.engine, monitor_events(record, record.get("consumed_samples", step),
                                                                 self.skip_events))
        for (step, loss, _), was_skipped in zip(rows, skipped):  # every step written first, then judged
            self.guard.check(step, loss, was_skipped)
        step, loss, moe_losses = rows[-1]
        text = progress_text(step, loss, record["lr"], tok_s, record.get("grad_norm"), record.get("loss_scale"),
                             eta_s=sec_per_step * (self.train_iters - step),
                             peak_memory=peak_memory_bytes(self.device))
        text += "".join(f" | {k} {v:.4f}" for k, v in moe_losses.items())
        self.progress.step(step, text)

    def report_validation(self, step: int, val_loss: float, samples: int) -> None:
        if self.log is not None:
            record = {"step": step, "val_loss": val_loss}
            self.log.write(record)
            write_monitor_events(self.engine, monitor_events(record, samples))
        self.progress.message(f"step {step}: validation loss {val_loss:.4f}")


__all__ = ["MIN_BAR_COLUMNS", "MONITOR_EVENTS", "NonFiniteGuard", "PendingSteps", "ProgressOutput", "Reporter",
           "monitor_events", "peak_memory_bytes", "terminal_columns", "write_monitor_events"]
