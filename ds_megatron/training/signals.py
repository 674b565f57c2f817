"""Stopping a training job gracefully, as clusters ask: on a signal, on a step schedule, or after a duration.

Megatron's ``exit_signal_handler`` / ``exit_interval`` / ``exit_duration_in_mins``
(``megatron.train``).  ``StopRequest.check(step)`` is called by every rank at every step
boundary and returns why to stop (or None); all ranks get the same answer, so they all
save the same checkpoint, flush their metrics and exit 0 together:

* SIGTERM (what Slurm and Kubernetes send before killing a job) and SIGUSR1 set a flag in
  the rank that receives them (Slurm signals every task; a signal to one rank is enough);
* a rank started by DeepSpeed's launcher also watches the launcher: its ``runner``
  (``deepspeed`` command) does not forward SIGTERM and dies alone, leaving the ranks
  training (``../shared/ENVIRONMENT.md``), so the runner's disappearance counts as SIGTERM;
* ``exit_duration_in_mins`` is measured on global rank 0's clock only;
* the flags are agreed with one all-reduce (MAX) over all ranks per step, only when a signal
  handler or a duration is configured; ``exit_interval`` needs none (every rank counts steps).

Handlers are installed by ``start`` in the main thread and the previous ones restored by
``close``, so a process that trains twice (the test harness) keeps its own.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Dict, Optional, Tuple

import torch

from ..config.training import TrainConfig
from ..parallel_state import ParallelGroup
from ..utils.collectives import MAX, all_reduce


class _OutputThatOutlivesItsReader:
    """``sys.stdout`` / ``sys.stderr`` of a rank that may lose its reader: when a multi-node launcher is stopped,
    pdsh and ssh go first, and a rank's next print would raise BrokenPipeError in the middle of a step or a
    save.  After the first broken pipe the stream writes to /dev/null, and the rank goes on to the stop that
    the launcher sends next (pdsh's ``pkill`` of each node's ``launch.py``, which SIGTERMs its ranks)."""

    def __init__(self, stream):
        self._stream = stream

    def _lost(self):
        self._stream = open(os.devnull, "w")

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._lost()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._lost()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def keep_running_without_output() -> None:
    """Wrap this process's stdout and stderr (once): a broken pipe silences them instead of failing the rank."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, _OutputThatOutlivesItsReader):
            setattr(sys, name, _OutputThatOutlivesItsReader(stream))


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_POLL_S = 0.5
# What a rank saw, as a code all ranks agree on (the largest wins), and how it is reported.
_REASONS = {1: "SIGTERM", 2: "SIGUSR1", 3: "the deepspeed launcher ended"}
_CODES = {signal.SIGTERM: 1, signal.SIGUSR1: 2}


def _proc_stat(pid: int) -> Optional[Tuple[int, int]]:
    """(parent pid, start time) of ``pid`` from /proc, None when it no longer exists (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def deepspeed_runner_pid() -> Optional[int]:
    """The ``deepspeed`` runner above this rank, when DeepSpeed's ``launch.py`` is our parent (else None)."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ")
    except OSError:
        return None
    if b"deepspeed.launcher.launch" not in cmdline and b"deepspeed/launcher/launch.py" not in cmdline:
        return None
    stat = _proc_stat(parent)
    return stat[0] if stat is not None and stat[0] > 1 else None


class StopRequest:
    """Why and when the job stops early (see the module docstring)."""

    def __init__(self, config: TrainConfig, world: ParallelGroup, device):
        self.config, self.world, self.device = config, world, device
        self.received = 0  # a _REASONS code, set by the handler / the launcher watch
        self._previous: Dict[int, object] = {}
        self._watch: Optional[threading.Thread] = None
        self._closing = threading.Event()
        self._start = time.monotonic()

    def start(self) -> "StopRequest":
        if self.config.exit_signal_handler and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            runner = deepspeed_runner_pid()
            if runner is not None:
                self._watch = threading.Thread(target=self._watch_runner, args=(runner, _proc_stat(runner)),
                                               name="ds-megatron-launcher-watch", daemon=True)
                self._watch.start()
        return self

    def _on_signal(self, signum, frame) -> None:
        self.received = max(self.received, _CODES[signum])

    def _watch_runner(self, pid: int, stat) -> None:
        while not self._closing.wait(LAUNCHER_POLL_S):
            if _proc_stat(pid) != stat:
                self.received = max(self.received, 3)
                return

    @property
    def _collective(self) -> bool:
        return bool(self._previous) or self.config.exit_duration_in_mins is not None

    def check(self, step: int) -> Optional[str]:
        """Why to stop after ``step`` (the same on every rank), or None.  Collective when signals or a
        duration are watched."""
        if self._collective:
            elapsed_min = (time.monotonic() - self._start) / 60
            duration = self.config.exit_duration_in_mins
            flags = torch.tensor([float(self.received),
                                  float(duration is not None and self.world.rank == 0 and elapsed_min >= duration)],
                                 device=self.device)
            all_reduce(flags, self.world, op=MAX)
            received, timed_out = (int(v) for v in flags.tolist())
            if received:
                return _REASONS[received]
            if timed_out:
                return f"exit_duration_in_mins={duration} reached"
        if self.config.exit_interval is not None and step % self.config.exit_interval == 0:
            return f"exit_interval={self.config.exit_interval} reached"
        return None

    def close(self) -> None:
        self._closing.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


__all__ = ["STOP_SIGNALS", "StopRequest", "deepspeed_runner_pid"]
