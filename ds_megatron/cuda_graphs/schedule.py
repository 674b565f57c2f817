"""How many graphs and static buffers a pipeline rank's capture needs, in the order it runs.

Pure Python (no torch): the CLI can print these and tests run them anywhere.

Transformer Engine's ``make_graphed_callables(_order=...)`` captures the
layers of one pipeline rank in the order that rank will run them: the order
of ``pipeline_parallel.schedule_table`` (Megatron's ``get_schedule_table`` /
``convert_schedule_table_to_order``), the one our pipeline runtime executes.

``plan_cuda_graphs`` simulates TE's buffer reuse
(``_reuse_graph_input_output_buffers``): a forward may take over the static
input buffer of a forward whose backward already ran.  The number of static
buffers is therefore set by the in-flight micro-batches (proportional to PP),
not by the number of micro-batches; the number of graphs is
``2 x layers`` without PP (1F1B lets every micro-batch reuse one graph pair)
and ``2 x layers x micro-batches`` with PP (a graph's internal activations
stay alive until its own backward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from ..pipeline_parallel.schedule_table import (check_order, convert_schedule_table_to_order,
                                                get_num_warmup_microbatches, get_order, get_pp_rank_microbatches,
                                                get_schedule_table)


@dataclass(frozen=True)
class CudaGraphPlan:
    """What one pipeline rank captures: TE's ``_order`` (None without PP) and the memory it implies.

    ``sample_buffer`` maps each forward graph (TE's per-callable index:
    chunk-major, then micro-batch, then layer) to the static input buffer it
    uses; ``num_static_input_buffers`` is how many distinct buffers that is.
    ``peak_in_flight`` is the most chunk-forwards alive at once (forwarded,
    not yet backwarded): the seed's ``(PP - rank - 1) * 2 + (VPP - 1) * PP + 1``.
    """

    order: Optional[Tuple[int, ...]]
    num_microbatches: int
    num_layers_per_chunk: Tuple[int, ...]
    num_graphs: int
    num_static_input_buffers: int
    sample_buffer: Tuple[int, ...]
    peak_in_flight: int

    @property
    def graphs_per_layer(self) -> int:
        """How many graph callables each layer gets (replayed by micro-batch index modulo this)."""
        return 1 if self.order is None else self.num_microbatches


def simulate_buffer_reuse(order: Sequence[int], num_layers_per_chunk: Sequence[int], num_microbatches: int,
                          sample_keys: Optional[Sequence[Hashable]] = None) -> Tuple[List[int], int]:
    """(buffer of each forward graph, peak chunk-forwards in flight) under TE's reuse rule.

    The rule: when a chunk's backward runs, the static inputs of that chunk's
    oldest outstanding forward become free, and a later forward of a layer
    whose inputs look the same (``sample_keys``, one per layer of the rank,
    default: all alike) takes one of them instead of a new buffer.
    """
    num_chunks = len(num_layers_per_chunk)
    prefix = [0]
    for n in num_layers_per_chunk:
        prefix.append(prefix[-1] + n)
    keys = list(sample_keys) if sample_keys is not None else [None] * prefix[-1]
    if len(keys) != prefix[-1]:
        raise ValueError(f"sample_keys has {len(keys)} entries but the chunks hold {prefix[-1]} layers; give one per layer")
    buffers = [-1] * (prefix[-1] * num_microbatches)
    free: Dict[Hashable, List[int]] = {}
    outstanding: List[List[Tuple[Hashable, int]]] = [[] for _ in range(num_chunks)]
    fwd_idx = [0] * num_chunks
    num_buffers = in_flight = peak = 0
    for c in order:
        chunk = abs(c) - 1
        if c > 0:
            for layer in range(num_layers_per_chunk[chunk]):
                idx = prefix[chunk] * num_microbatches + fwd_idx[chunk] * num_layers_per_chunk[chunk] + layer
                key = keys[prefix[chunk] + layer]
                if free.get(key):
                    buffers[idx] = free[key].pop(0)
                else:
                    buffers[idx] = num_buffers
                    num_buffers += 1
                outstanding[chunk].append((key, buffers[idx]))
            fwd_idx[chunk] += 1
            in_flight += 1
            peak = max(peak, in_flight)
        else:
            released = outstanding[chunk][:num_layers_per_chunk[chunk]]
            outstanding[chunk] = outstanding[chunk][num_layers_per_chunk[chunk]:]
            for key, buf in released:
                free.setdefault(key, []).append(buf)
            in_flight -= 1
    return buffers, peak


def plan_cuda_graphs(num_layers_per_chunk: Sequence[int], num_microbatches: int, *, pipeline_parallel_size: int = 1,
                     pipeline_parallel_rank: int = 0, microbatch_group_size_per_vp_stage: Optional[int] = None,
                     sample_keys: Optional[Sequence[Hashable]] = None) -> CudaGraphPlan:
    """The capture plan of one rank: order, graph count and static input buffer count (the seed's memory table)."""
    layers = tuple(num_layers_per_chunk)
    if not layers or any(n < 0 for n in layers):
        raise ValueError(f"num_layers_per_chunk={list(layers)} must list each local chunk's graphable layer count")
    total_layers = sum(layers)
    if pipeline_parallel_size == 1 and len(layers) == 1:
        # forward_backward_no_pipelining runs each forward's backward at once: one graph pair
        # and one static input buffer per layer serve every micro-batch.
        return CudaGraphPlan(order=None, num_microbatches=num_microbatches, num_layers_per_chunk=layers,
                             num_graphs=2 * total_layers, num_static_input_buffers=total_layers,
                             sample_buffer=tuple(range(total_layers)), peak_in_flight=1)
    order = get_order(num_microbatches, len(layers), pipeline_parallel_size=pipeline_parallel_size,
                      pipeline_parallel_rank=pipeline_parallel_rank,
                      microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage)
    buffers, peak = simulate_buffer_reuse(order, layers, num_microbatches, sample_keys)
    return CudaGraphPlan(order=tuple(order), num_microbatches=num_microbatches, num_layers_per_chunk=layers,
                         num_graphs=2 * total_layers * num_microbatches,
                         num_static_input_buffers=len(set(buffers)), sample_buffer=tuple(buffers),
                         peak_in_flight=peak)


__all__ = ["CudaGraphPlan", "check_order", "convert_schedule_table_to_order", "get_num_warmup_microbatches",
           "get_order", "get_pp_rank_microbatches", "get_schedule_table", "plan_cuda_graphs", "simulate_buffer_reuse"]
