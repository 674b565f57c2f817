"""The highest point CPU tensor allocations reach while a function runs.

A CPU has no ``torch.cuda.max_memory_allocated``; torch's profiler with
``profile_memory`` records every allocation and free (``[memory]`` events,
signed bytes), so the running sum over them in time order, and its maximum,
is the peak of the tensors made inside the function over what was alive
before it.  The benchmarks put it next to ``ds-megatron plan``, and the plan's
tests hold the plan to it.

The profiler records a free only on a thread it profiles.  While it runs, each
gloo collective's work (with the profiler's record of it) holds the tensors
until a gloo worker thread drops the work, a moment after the caller has gone
on; when the caller drops its tensor first, the free happens on the worker
thread, unrecorded, and the tensor counts as alive to the end (seen in one
pass of several: 32 bytes of an 8-float all-reduce in 1 of 7 on two idle
ranks).  So while it measures, a blocking collective sleeps 5 ms after it
returns, long enough for the worker to drop the work (2 ms: 0 of 300 idle): those of
torch.distributed, and the all-gather and reduce-scatter that
``utils.collectives`` bound at its import (sequence parallelism's, unsettled
before).  On a loaded box a pass of a recomputed TP 2 + SP MoE model still
sometimes counts a reduce-scatter's buffer that the worker frees after the
sleep (seen: one pass in six or more); tests take the lowest of several.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterator, Tuple

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from . import collectives

# torch.distributed's blocking collectives (looked up by callers at call time, so a wrapper set here is the one run)
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "all_to_all", "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "send", "recv",
                "barrier")
# utils.collectives' own references to torch.distributed's single-tensor all-gather and reduce-scatter
_BOUND_COLLECTIVES = ("_all_gather_single", "_reduce_scatter_single")
SETTLE_SECONDS = 0.005


@contextlib.contextmanager
def _settled_collectives() -> Iterator[None]:
    """Each blocking collective returns after its gloo worker has let go of its tensors (module docstring)."""
    originals = {(dist, name): getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    originals.update({(collectives, name): getattr(collectives, name) for name in _BOUND_COLLECTIVES})

    def settled(collective):
        @functools.wraps(collective)
        def call(*args, **kwargs):
            out = collective(*args, **kwargs)
            if not kwargs.get("async_op"):
                time.sleep(SETTLE_SECONDS)
            return out
        return call

    for (owner, name), collective in originals.items():
        setattr(owner, name, settled(collective))
    try:
        yield
    finally:
        for (owner, name), collective in originals.items():
            setattr(owner, name, collective)


def peak_allocated_bytes(fn: Callable[[], Any]) -> Tuple[int, int, Any]:
    """``(peak, net, fn())``: the highest running total of CPU bytes allocated inside ``fn``, the total at its end."""
    with _settled_collectives(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live, result
