"""The highest point CPU tensor allocations reach while a function runs.

A CPU has no ``torch.cuda.max_memory_allocated``; torch's profiler with
``profile_memory`` records every allocation and free (``[memory]`` events,
signed bytes), so the running sum over them in time order, and its maximum,
is the peak of the tensors made inside the function over what was alive
before it.  The benchmarks put it next to ``ds-megatron plan``, and the plan's
tests hold the plan to it.
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(fn: Callable[[], Any]) -> Tuple[int, int, Any]:
    """``(peak, net, fn())``: the highest running total of CPU bytes allocated inside ``fn``, the total at its end."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live, result
