"""Pipeline schedule orders for graph capture, and how many graphs and static buffers they need.

Pure Python (no torch): the CLI can print these and tests run them anywhere.

Transformer Engine's ``make_graphed_callables(_order=...)`` captures the
layers of one pipeline rank in the order that rank will run them.  An
``order`` is a list of model-chunk numbers, 1-based: ``+c`` is a forward of
local chunk ``c - 1`` for the next micro-batch of that chunk, ``-c`` is a
backward of local chunk ``c - 1``.  Megatron-LM derives it from the
interleaved 1F1B schedule in three steps, reproduced here with its names:

* ``get_pp_rank_microbatches``: how many forwards a rank runs before its first
  backward (``num_warmup_microbatches``);
* ``get_schedule_table``: the (micro-batch, model chunk) sequence of forwards,
  the same on every rank (and, read with mirrored chunks, of backwards);
* ``convert_schedule_table_to_order``: warm-up forwards, then alternating
  forward/backward (1F1B), then cool-down backwards.

``plan_cuda_graphs`` then simulates TE's buffer reuse
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


def get_pp_rank_microbatches(num_microbatches: int, num_model_chunks: int,
                             microbatch_group_size_per_vp_stage: Optional[int], *, pipeline_parallel_size: int,
                             pipeline_parallel_rank: int, forward_only: bool = False) -> Tuple[int, bool, int, int]:
    """(total_num_microbatches, are_all_microbatches_in_warmup, num_warmup_microbatches, num_microbatches_remaining).

    Megatron-LM's function of the same name, with the PP size and rank passed
    in instead of read from globals.  ``num_model_chunks > 1`` is the
    interleaved schedule; its warm-up is
    ``(PP - rank - 1) * 2 + (VPP - 1) * microbatch_group_size_per_vp_stage``.
    Without PP there is no warm-up: each forward is followed by its backward.
    """
    _check_positive("num_microbatches", num_microbatches)
    _check_positive("num_model_chunks", num_model_chunks)
    _check_positive("pipeline_parallel_size", pipeline_parallel_size)
    if not 0 <= pipeline_parallel_rank < pipeline_parallel_size:
        raise ValueError(f"pipeline_parallel_rank={pipeline_parallel_rank} is outside [0, {pipeline_parallel_size}); "
                         "pass this rank's index in its pipeline group")
    if num_model_chunks > 1 and pipeline_parallel_size == 1:
        raise ValueError(f"num_model_chunks={num_model_chunks} needs pipeline_parallel_size > 1 (virtual pipeline "
                         "stages interleave across pipeline ranks); use one model chunk without PP")
    group = num_microbatches if microbatch_group_size_per_vp_stage is None else microbatch_group_size_per_vp_stage
    _check_positive("microbatch_group_size_per_vp_stage", group)
    total = num_microbatches * num_model_chunks
    if forward_only:
        warmup = total
    elif pipeline_parallel_size > 1:
        if num_model_chunks == 1:
            warmup = pipeline_parallel_size - pipeline_parallel_rank - 1
        else:
            warmup = (pipeline_parallel_size - pipeline_parallel_rank - 1) * 2 + (num_model_chunks - 1) * group
    else:
        warmup = 0
    all_in_warmup = warmup >= total
    warmup = min(warmup, total)
    return total, all_in_warmup, warmup, total - warmup


def get_num_warmup_microbatches(num_microbatches: int, num_model_chunks: int,
                                microbatch_group_size_per_vp_stage: Optional[int], *, pipeline_parallel_size: int,
                                pipeline_parallel_rank: int) -> int:
    """The warm-up forwards of one pipeline rank (see ``get_pp_rank_microbatches``)."""
    return get_pp_rank_microbatches(num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage,
                                    pipeline_parallel_size=pipeline_parallel_size,
                                    pipeline_parallel_rank=pipeline_parallel_rank)[2]


def get_schedule_table(num_microbatches: int, num_model_chunks: int,
                       microbatch_group_size_per_vp_stage: int) -> List[Tuple[int, int]]:
    """The forward sequence as (microbatch_id, model_chunk_id): per group of micro-batches, chunk-major.

    With 8 micro-batches, 2 chunks, groups of 4:
    (0,0) (1,0) (2,0) (3,0) (0,1) ... (3,1) (4,0) ... (7,0) (4,1) ... (7,1).
    The last group takes whatever micro-batches remain.
    """
    _check_positive("num_microbatches", num_microbatches)
    _check_positive("num_model_chunks", num_model_chunks)
    _check_positive("microbatch_group_size_per_vp_stage", microbatch_group_size_per_vp_stage)
    table = []
    for group_start in range(0, num_microbatches, microbatch_group_size_per_vp_stage):
        group_end = min(group_start + microbatch_group_size_per_vp_stage, num_microbatches)
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in range(group_start, group_end))
    return table


def convert_schedule_table_to_order(num_warmup_microbatches: int, num_model_chunks: int,
                                    schedule_table: Sequence[Tuple[int, int]]) -> List[int]:
    """TE's ``_order`` for one rank: warm-up forwards, 1F1B pairs, cool-down backwards.

    A forward of chunk ``k`` is ``k + 1``; the backward schedule visits chunks
    mirrored (the last chunk's backward comes first), so entry ``k`` of the
    table becomes the backward ``k - num_model_chunks``, i.e. chunk
    ``num_model_chunks - 1 - k``.
    """
    if not schedule_table:
        raise ValueError("schedule_table is empty; build it with get_schedule_table")
    if not 0 <= num_warmup_microbatches <= len(schedule_table):
        raise ValueError(f"num_warmup_microbatches={num_warmup_microbatches} is outside [0, {len(schedule_table)}] "
                         "(the schedule's length); take it from get_pp_rank_microbatches")
    chunk_ids = [chunk for _, chunk in schedule_table]
    forward_order = [chunk + 1 for chunk in chunk_ids]
    backward_order = [chunk - num_model_chunks for chunk in chunk_ids]
    order = forward_order[:num_warmup_microbatches]
    for i in range(num_warmup_microbatches, len(forward_order)):
        order.append(forward_order[i])
        order.append(backward_order[i - num_warmup_microbatches])
    if num_warmup_microbatches > 0:
        order.extend(backward_order[-num_warmup_microbatches:])
    return order


def get_order(num_microbatches: int, num_model_chunks: int, *, pipeline_parallel_size: int,
              pipeline_parallel_rank: int, microbatch_group_size_per_vp_stage: Optional[int] = None) -> List[int]:
    """The three steps above in one call; the group size defaults to PP, as in Megatron-LM."""
    group = microbatch_group_size_per_vp_stage or pipeline_parallel_size
    warmup = get_num_warmup_microbatches(num_microbatches, num_model_chunks, group,
                                         pipeline_parallel_size=pipeline_parallel_size,
                                         pipeline_parallel_rank=pipeline_parallel_rank)
    return convert_schedule_table_to_order(warmup, num_model_chunks,
                                           get_schedule_table(num_microbatches, num_model_chunks, group))


def check_order(order: Sequence[int], num_model_chunks: int, num_microbatches: int) -> None:
    """ValueError unless every chunk runs each micro-batch's forward before its backward, once each.

    Per chunk the k-th backward is the backward of the k-th forward (both run
    in schedule-table order), so "forward before backward" means: at every
    prefix of the order, no chunk has more backwards than forwards.
    """
    fwd = [0] * num_model_chunks
    bwd = [0] * num_model_chunks
    for pos, c in enumerate(order):
        if c == 0 or abs(c) > num_model_chunks:
            raise ValueError(f"order[{pos}]={c} is not a chunk number in +-[1, {num_model_chunks}]")
        chunk = abs(c) - 1
        if c > 0:
            fwd[chunk] += 1
        else:
            bwd[chunk] += 1
            if bwd[chunk] > fwd[chunk]:
                raise ValueError(f"order[{pos}]={c}: backward #{bwd[chunk]} of chunk {chunk} comes before its forward")
    if fwd != [num_microbatches] * num_model_chunks or bwd != fwd:
        raise ValueError(f"order has forwards {fwd} and backwards {bwd} per chunk; each must be {num_microbatches}")


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


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


__all__ = ["CudaGraphPlan", "check_order", "convert_schedule_table_to_order", "get_num_warmup_microbatches",
           "get_order", "get_pp_rank_microbatches", "get_schedule_table", "plan_cuda_graphs", "simulate_buffer_reuse"]
