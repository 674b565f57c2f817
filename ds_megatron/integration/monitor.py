"""DeepSpeed's monitors (``tensorboard``, ``wandb``, ``comet``, ``csv_monitor`` sections) fed by our training job.

DeepSpeed builds ``engine.monitor`` (a ``MonitorMaster``, ``runtime/engine.py:610``) from those
sections and writes to it only the learning rate after each step (``Train/Samples/lr``, x = samples
seen; ``runtime/engine.py:3627``) and, with fp16 enabled, the loss scale.  The job hands it every
other value its ``metrics.jsonl`` gets, in the same ``(name, value, samples)`` events, through the
public ``write_events``; it writes on global rank 0 only (``monitor/monitor.py``).
"""
from __future__ import annotations

from typing import List, Tuple

Event = Tuple[str, float, int]


def monitor_enabled(engine) -> bool:
    monitor = getattr(engine, "monitor", None)
    return bool(monitor is not None and monitor.enabled)


def write_monitor_events(engine, events: List[Event]) -> None:
    """``engine.monitor.write_events(events)`` when a monitor section is enabled."""
    if events and monitor_enabled(engine):
        engine.monitor.write_events(events)


def engine_writes_loss_scale(engine) -> bool:
    """DeepSpeed writes ``Train/Samples/loss_scale`` itself when fp16 is on (``runtime/engine.py:3632``)."""
    return bool(engine.fp16_enabled())


__all__ = ["Event", "engine_writes_loss_scale", "monitor_enabled", "write_monitor_events"]
