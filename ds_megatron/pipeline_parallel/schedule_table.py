"""Megatron's pipeline schedule as a table: which chunk each rank runs next, for execution and for capture.

Pure Python (no torch): the runtime (``pipeline_parallel.schedules``), the CUDA-graph capture plan
(``cuda_graphs.schedule``), ``ds-megatron plan`` and the tests all read the same order.

An ``order`` is a list of model-chunk numbers, 1-based: ``+c`` is a forward of local chunk ``c - 1``
for the next micro-batch of that chunk, ``-c`` a backward of local chunk ``c - 1`` (Transformer Engine's
``_order``).  Megatron-LM derives it from the interleaved 1F1B schedule in three steps, kept here
under its names:

* ``get_pp_rank_microbatches``: how many forwards a rank runs before its first backward
  (``num_warmup_microbatches``);
* ``get_schedule_table``: the (micro-batch, model chunk) sequence of forwards, the same on every rank
  (and, read with mirrored chunks, of backwards);
* ``convert_schedule_table_to_order``: warm-up forwards, then alternating forward/backward (1F1B), then
  cool-down backwards.

Rank ``r`` of ``p`` holds chunks ``r, r + p, r + 2p, ...`` of the model (virtual stage ``c * p + r`` is
its local chunk ``c``).  ``rank_operations`` spells a rank's order out as (forward or backward, chunk,
micro-batch); ``channel_messages`` lists what a rank sends to a neighbour, in the order it sends it,
which is the order the neighbour must receive it in; ``posted_receives`` and ``send_releases`` are when the
runtime posts its receive buffers and when it may let go of a send; ``simulate_pipeline`` runs every rank's order
against the data dependencies with fixed forward / backward costs: it proves the orders complete and
gives the step time and bubble of each schedule; ``simulate_shared_pipeline`` does the same on ranks that share
fewer cores than they are (a rank in its bubble lends its core to the ranks computing).
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

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
class Operation:
    """One entry of a rank's order: ``forward`` (else backward) of local ``chunk`` for ``microbatch``.

    ``part`` of a backward: ``"full"``, or the zero-bubble schedule's ``"input"`` (B: the input gradient,
    weight-gradient GEMMs deferred) and ``"weight"`` (W: those GEMMs)."""

    forward: bool
    chunk: int
    microbatch: int
    part: str = "full"


def rank_operations(num_microbatches: int, num_model_chunks: int, *, pipeline_parallel_size: int,
                    pipeline_parallel_rank: int, microbatch_group_size_per_vp_stage: Optional[int] = None,
                    forward_only: bool = False, schedule: str = "interleaved_1f1b") -> List[Operation]:
    """A rank's order with each entry's micro-batch: the k-th forward is table entry k, the k-th backward is
    table entry k with its chunk mirrored (per chunk, backwards come in the order of the forwards).
    ``schedule`` "zero_bubble": ``zero_bubble_orders`` (one chunk)."""
    return list(_rank_operations(num_microbatches, num_model_chunks, pipeline_parallel_size, pipeline_parallel_rank,
                                 microbatch_group_size_per_vp_stage or pipeline_parallel_size, forward_only,
                                 schedule))


@functools.lru_cache(maxsize=4096)
def _rank_operations(num_microbatches: int, num_model_chunks: int, pipeline_parallel_size: int,
                     pipeline_parallel_rank: int, group: int, forward_only: bool,
                     schedule: str) -> Tuple[Operation, ...]:
    """``rank_operations``, made once per argument set (the plan's search asks for the same ranks' orders for
    every layout of one pipeline size)."""
    table = get_schedule_table(num_microbatches, num_model_chunks, group)
    if forward_only:
        return tuple(Operation(True, chunk, mb) for mb, chunk in table)
    if schedule == "zero_bubble":
        if num_model_chunks != 1:
            raise ValueError("the zero-bubble schedule (ZB-H1) runs one model chunk per rank")
        return _zero_bubble_orders(num_microbatches, pipeline_parallel_size)[pipeline_parallel_rank]
    order = get_order(num_microbatches, num_model_chunks, pipeline_parallel_size=pipeline_parallel_size,
                      pipeline_parallel_rank=pipeline_parallel_rank, microbatch_group_size_per_vp_stage=group)
    ops, fwd, bwd = [], 0, 0
    for c in order:
        if c > 0:
            mb, chunk = table[fwd]
            ops.append(Operation(True, chunk, mb))
            fwd += 1
        else:
            mb, chunk = table[bwd]
            ops.append(Operation(False, num_model_chunks - 1 - chunk, mb))
            bwd += 1
    return tuple(ops)


def virtual_stage(chunk: int, rank: int, pipeline_parallel_size: int) -> int:
    """The model-wide position of ``rank``'s local ``chunk``: chunks interleave over the ranks."""
    return chunk * pipeline_parallel_size + rank


def sends_of(op: Operation, rank: int, pipeline_parallel_size: int,
             num_model_chunks: int) -> Optional[Tuple[int, Tuple[str, int, int]]]:
    """``(destination rank, (kind, receiving virtual stage, micro-batch))`` that ``op`` sends, or None.

    A forward sends its output to the next virtual stage (none from the last); a backward sends the
    gradient of its input to the previous one (none from the first)."""
    p = pipeline_parallel_size
    vs = virtual_stage(op.chunk, rank, p)
    if op.part == "weight":
        return None
    if op.forward:
        if vs == p * num_model_chunks - 1:
            return None
        return (rank + 1) % p, ("activation", vs + 1, op.microbatch)
    if vs == 0:
        return None
    return (rank - 1) % p, ("gradient", vs - 1, op.microbatch)


def receives_of(op: Operation, rank: int, pipeline_parallel_size: int,
                num_model_chunks: int) -> Optional[Tuple[int, Tuple[str, int, int]]]:
    """``(source rank, message)`` that ``op`` needs before it runs, or None (see ``sends_of``)."""
    p = pipeline_parallel_size
    vs = virtual_stage(op.chunk, rank, p)
    if op.part == "weight":
        return None
    if op.forward:
        return None if vs == 0 else ((rank - 1) % p, ("activation", vs, op.microbatch))
    if vs == p * num_model_chunks - 1:
        return None
    return (rank + 1) % p, ("gradient", vs, op.microbatch)


def channel_messages(operations: Sequence[Operation], rank: int, pipeline_parallel_size: int,
                     num_model_chunks: int) -> Dict[int, List[Tuple[str, int, int]]]:
    """What ``rank`` sends to each destination rank, in the order it sends it (its receiver's order too)."""
    out: Dict[int, List[Tuple[str, int, int]]] = {}
    for op in operations:
        sent = sends_of(op, rank, pipeline_parallel_size, num_model_chunks)
        if sent is not None:
            out.setdefault(sent[0], []).append(sent[1])
    return out


@functools.lru_cache(maxsize=4096)
def posted_receives(num_microbatches: int, num_model_chunks: int, pipeline_parallel_size: int,
                    pipeline_parallel_rank: int, microbatch_group_size_per_vp_stage: Optional[int] = None,
                    schedule: str = "interleaved_1f1b") -> Tuple[Tuple[Operation, int], ...]:
    """``rank``'s order with, per operation, how many receive buffers the runtime posts right before it (it posts
    a neighbour's messages in that neighbour's send order, up to the one the operation needs; -1: it needs none,
    else the one it needs is then taken).  Made once per schedule: the memory plan walks it for every layout."""
    p, v, rank = pipeline_parallel_size, num_model_chunks, pipeline_parallel_rank

    def order(r):
        return _rank_operations(num_microbatches, v, p, r, microbatch_group_size_per_vp_stage or p, False, schedule)
    expected = {src: list(channel_messages(order(src), src, p, v).get(rank, []))
                for src in {(rank - 1) % p, (rank + 1) % p} - {rank}}
    posted, out = set(), []
    for op in order(rank):
        needed = receives_of(op, rank, p, v)
        if needed is None:
            out.append((op, -1))
            continue
        src, message = needed
        count = 0
        while message not in posted:
            posted.add(expected[src].pop(0))
            count += 1
        posted.discard(message)
        out.append((op, count))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def send_releases(num_microbatches: int, num_model_chunks: int, pipeline_parallel_size: int,
                  pipeline_parallel_rank: int, microbatch_group_size_per_vp_stage: Optional[int] = None,
                  schedule: str = "interleaved_1f1b",
                  forward_only: bool = False) -> Tuple[Tuple[Tuple[int, Tuple[str, int, int]], ...], ...]:
    """Per operation of ``rank``'s order, the ``(destination, message)`` sends it may wait on and drop right after
    the operation's receive: those its source had taken (an operation of the source's order received them) by the
    time it sent the message received.  Causality: that message left after the source had the data, so the
    send is complete, or completing without the source (a send waited on earlier could block on a receiver that
    is not ready yet).  A send in no entry is covered by no later message (the step's last ones): wait at the
    end.  Made once per schedule, like ``posted_receives``."""
    p, v, rank = pipeline_parallel_size, num_model_chunks, pipeline_parallel_rank

    def order(r):
        return _rank_operations(num_microbatches, v, p, r, microbatch_group_size_per_vp_stage or p, forward_only,
                                schedule)
    ours = order(rank)
    out: List[List[Tuple[int, Tuple[str, int, int]]]] = [[] for _ in ours]
    for peer in {(rank - 1) % p, (rank + 1) % p} - {rank}:
        # In the peer's order: the operation that takes each of our messages, and the one that sends each of its.
        taken_at, sent_at = {}, {}
        for i, op in enumerate(order(peer)):
            got, sent = receives_of(op, peer, p, v), sends_of(op, peer, p, v)
            if got is not None and got[0] == rank:
                taken_at[got[1]] = i
            if sent is not None and sent[0] == rank:
                sent_at[sent[1]] = i
        held: List[Tuple[str, int, int]] = []
        for i, op in enumerate(ours):  # an operation receives before it sends
            got = receives_of(op, rank, p, v)
            if got is not None and got[0] == peer:
                after = sent_at[got[1]]
                out[i].extend((peer, m) for m in held if taken_at[m] <= after)
                held = [m for m in held if taken_at[m] > after]
            sent = sends_of(op, rank, p, v)
            if sent is not None and sent[0] == peer:
                held.append(sent[1])
    return tuple(tuple(entry) for entry in out)


def zero_bubble_orders(num_microbatches: int, pipeline_parallel_size: int) -> List[List[Operation]]:
    """Every rank's order of ZB-H1 (``_zero_bubble_orders``, made once per size: the plan's search and memory walk
    ask for every rank of the same pipeline many times)."""
    return [list(ops) for ops in _zero_bubble_orders(num_microbatches, pipeline_parallel_size)]


@functools.lru_cache(maxsize=32)
def _zero_bubble_orders(num_microbatches: int, pipeline_parallel_size: int) -> Tuple[Tuple[Operation, ...], ...]:
    """Every rank's order of ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), one chunk each.

    Each backward is split into B (the input gradient, which the previous stage waits for) and W (the
    weight gradients).  The forwards and B's keep 1F1B's order.  Rank r holds ``p - r`` micro-batches in
    flight under 1F1B, the first rank ``p``; so in the steady state rank r may leave up to r W's waiting
    (a micro-batch stays alive until its W) without any rank holding more than 1F1B's peak, ``p``
    micro-batches; in the cool-down every W waits.  Waiting W's fill the time a rank would spend waiting
    for an input.  Which W goes where is decided once,
    by running every rank's order with unit costs (F = B = W), so the order is fixed: the same on every
    run and known to every rank.  Per rank, W's run in the order of their B's (so every weight's gradient
    sums its micro-batches in 1F1B's order).
    """
    p, m = pipeline_parallel_size, num_microbatches
    base = []
    for r in range(p):
        ops = rank_operations(m, 1, pipeline_parallel_size=p, pipeline_parallel_rank=r)
        base.append([op if op.forward else Operation(False, op.chunk, op.microbatch, "input") for op in ops])
    out: List[List[Operation]] = [[] for _ in range(p)]
    pending: List[List[Operation]] = [[] for _ in range(p)]
    position, clock = [0] * p, [0.0] * p
    forwards_left = [m] * p
    arrived: Dict[Tuple[str, int, int], float] = {}

    def run(r: int, op: Operation, start: float) -> None:
        out[r].append(op)
        clock[r] = start + 1.0
        sent = sends_of(op, r, p, 1)
        if sent is not None:
            arrived[sent[1]] = clock[r]

    # The ranks by (clock, rank), kept sorted as one rank's clock moves per turn: each turn runs the first that can.
    queue = [(0.0, r) for r in range(p)]
    remaining = p
    while remaining:
        for turn, (_, r) in enumerate(queue):
            if position[r] == len(base[r]):
                if pending[r]:
                    run(r, pending[r].pop(0), clock[r])
                    break
                continue
            op = base[r][position[r]]
            needed = receives_of(op, r, p, 1)
            ready_at = 0.0 if needed is None else arrived.get(needed[1])
            if ready_at is not None and ready_at <= clock[r]:
                position[r] += 1
                run(r, op, clock[r])
                if op.forward:
                    forwards_left[r] -= 1
                else:
                    pending[r].append(Operation(False, op.chunk, op.microbatch, "weight"))
                    if forwards_left[r] > 0 and len(pending[r]) > r:
                        run(r, pending[r].pop(0), clock[r])  # steady state: at most r W's wait
            elif pending[r]:
                run(r, pending[r].pop(0), clock[r])  # a gap: fill it with a W
            elif ready_at is not None:
                clock[r] = ready_at  # idle until the input arrives
            else:
                continue  # blocked on a message not sent yet
            break
        else:
            raise ValueError("the zero-bubble orders deadlock")
        del queue[turn]
        bisect.insort(queue, (clock[r], r))
        remaining -= position[r] == len(base[r]) and not pending[r]
    return tuple(tuple(ops) for ops in out)


@dataclass(frozen=True)
class PipelineTiming:
    """``simulate_pipeline``'s result: the step's length and, per rank, the time it computed and when it
    finished its last operation."""

    step_time: float
    busy: Tuple[float, ...]
    finish: Tuple[float, ...] = ()

    @property
    def bubble(self) -> float:
        """The idle share of the step, averaged over the ranks."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step_time)


def simulate_pipeline(num_microbatches: int, num_model_chunks: int, pipeline_parallel_size: int,
                      microbatch_group_size_per_vp_stage: Optional[int] = None, forward_time: float = 1.0,
                      backward_time: float = 2.0, schedule: str = "interleaved_1f1b",
                      costs: Optional[Sequence[Sequence[Tuple[float, float, float]]]] = None,
                      message_time: float = 0.0) -> PipelineTiming:
    """Every rank runs its order; an operation starts when the rank is free and its input has arrived
    ``message_time`` after it was sent (the sender goes on meanwhile).  ValueError if the orders deadlock.
    ``forward_time`` / ``backward_time``: one chunk's (the zero-bubble schedule's B and W take half of
    ``backward_time`` each); ``costs[rank][chunk]``, when given, each chunk's own (forward, B, W) instead (a
    full backward is B + W): uneven stages and the real split of a backward."""
    p, v = pipeline_parallel_size, num_model_chunks
    programs = _programs(num_microbatches, v, p, microbatch_group_size_per_vp_stage or p, schedule)
    if costs is None:
        costs = [[(forward_time, backward_time / 2, backward_time / 2)] * v for _ in range(p)]
    # Each rank's cost of each (kind, chunk): forward, full backward (B + W), B, W.
    price = [[(f, b + w, b, w)[kind] for kind in range(4)] for f, b, w in (c for rank in costs for c in rank)]
    arrived: List[Optional[float]] = [None] * (2 * p * v * num_microbatches)
    clock, busy, position = [0.0] * p, [0.0] * p, [0] * p
    remaining = sum(1 for program in programs if program)
    while remaining:
        progressed = False
        for r in range(p):
            program, at, now, spent = programs[r], position[r], clock[r], busy[r]
            while at < len(program):
                kind, chunk, needed, sent = program[at]
                if needed >= 0:
                    ready = arrived[needed]
                    if ready is None:
                        break
                    if ready > now:
                        now = ready
                cost = price[r * v + chunk][kind]
                now = now + cost
                spent += cost
                if sent >= 0:
                    arrived[sent] = now + message_time
                at += 1
            if at != position[r]:
                position[r], clock[r], busy[r] = at, now, spent
                progressed = True
                remaining -= at == len(program)
        if not progressed:
            stuck = {r: rank_operations(num_microbatches, v, pipeline_parallel_size=p, pipeline_parallel_rank=r,
                                        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
                                        schedule=schedule)[position[r]]
                     for r in range(p) if position[r] < len(programs[r])}
            raise ValueError(f"the pipeline orders deadlock: ranks wait at {stuck}")
    return PipelineTiming(max(clock), tuple(busy), tuple(clock))


def simulate_shared_pipeline(num_microbatches: int, num_model_chunks: int, pipeline_parallel_size: int,
                             costs: Sequence[Sequence[Tuple[Tuple[float, float], ...]]], rates: Sequence[float],
                             microbatch_group_size_per_vp_stage: Optional[int] = None,
                             schedule: str = "interleaved_1f1b", message_time: float = 0.0,
                             tails: Optional[Sequence[Sequence[Tuple[float, float]]]] = None,
                             message_work: float = 0.0) -> PipelineTiming:
    """``simulate_pipeline`` on ranks that share their compute (processor sharing): an operation first computes
    its work, then waits out its collectives; while ``k`` ranks compute, each advances at ``rates[k]`` of its own
    rate (a rank waiting for a message or in a collective computes nothing and slows no one).
    ``costs[rank][chunk]``: the (work in seconds at the full rate, collective seconds) of its forward, B and W
    (a full backward is B + W); ``tails[rank]``: such pairs the rank runs after its last operation (the step's
    gradient reduction and optimizer); ``message_work``: the work a message adds to the operation that sends it
    and to the one that receives it (a CPU's copies through the socket).  ``busy``: each rank's seconds inside its
    operations and tail."""
    p, v = pipeline_parallel_size, num_model_chunks
    programs = _programs(num_microbatches, v, p, microbatch_group_size_per_vp_stage or p, schedule)
    # Each rank's segments: (work, collective seconds, the message it waits for, the one it sends).
    segments = []
    for r in range(p):
        price = [(f, (b[0] + w[0], b[1] + w[1]), b, w) for f, b, w in costs[r]]
        own = [(price[chunk][kind][0] + message_work * ((needed >= 0) + (sent >= 0)), price[chunk][kind][1],
                needed, sent) for kind, chunk, needed, sent in programs[r]]
        segments.append(own + [(work, comm, -1, -1) for work, comm in (tails[r] if tails else ())])
    arrived: List[Optional[float]] = [None] * (2 * p * v * num_microbatches)
    position, phase = [0] * p, [0] * p  # phase: 0 waiting to start the segment, 1 computing, 2 in its collective
    left, until, start = [0.0] * p, [0.0] * p, [0.0] * p
    busy, finish = [0.0] * p, [0.0] * p
    now = 0.0
    while True:
        changed = True
        while changed:  # what starts or ends at ``now`` (a message sent now may start a rank already passed)
            changed = False
            for r in range(p):
                while position[r] < len(segments[r]):
                    work, comm, needed, sent = segments[r][position[r]]
                    if phase[r] == 0:
                        if needed >= 0 and (arrived[needed] is None or arrived[needed] > now):
                            break
                        phase[r], left[r], start[r] = 1, work, now
                    if phase[r] == 1:
                        if left[r] > 0:
                            break
                        phase[r], until[r] = 2, now + comm
                    if until[r] > now:
                        break
                    if sent >= 0:
                        arrived[sent] = now + message_time
                    busy[r] += now - start[r]
                    finish[r] = now
                    position[r], phase[r], changed = position[r] + 1, 0, True
        computing = [r for r in range(p) if position[r] < len(segments[r]) and phase[r] == 1]
        rate = rates[len(computing)]
        ends = {r: now + left[r] / rate for r in computing}
        waits = [until[r] for r in range(p) if position[r] < len(segments[r]) and phase[r] == 2]
        waits += [arrived[segments[r][position[r]][2]] for r in range(p) if position[r] < len(segments[r])
                  and phase[r] == 0 and arrived[segments[r][position[r]][2]] is not None]
        if not ends and not waits:
            if any(position[r] < len(segments[r]) for r in range(p)):
                raise ValueError(f"the pipeline orders deadlock: ranks wait at segments {position}")
            return PipelineTiming(max(finish), tuple(busy), tuple(finish))
        step = min(list(ends.values()) + waits)
        for r in computing:
            left[r] = 0.0 if ends[r] <= step else left[r] - (step - now) * rate
        now = step


@functools.lru_cache(maxsize=256)
def _programs(num_microbatches: int, num_model_chunks: int, pipeline_parallel_size: int, group: int,
              schedule: str) -> Tuple[Tuple[Tuple[int, int, int, int], ...], ...]:
    """Every rank's order as (kind: 0 forward, 1 full backward, 2 B, 3 W; chunk; the message it waits for, the
    one it sends, -1 for none), made once per schedule for ``simulate_pipeline``.  A message is numbered by
    (activation or gradient, receiving virtual stage, micro-batch): ``receives_of`` and ``sends_of`` in numbers
    (``tests/test_plan_time.py`` holds them equal)."""
    p, v, m = pipeline_parallel_size, num_model_chunks, num_microbatches
    last, gradient = p * v - 1, p * v * m  # the last virtual stage; where the gradients' numbers start
    kinds = {"full": 1, "input": 2, "weight": 3}
    out = []
    for r in range(p):
        program = []
        for op in _rank_operations(m, v, p, r, group, False, schedule):
            vs = op.chunk * p + r
            if op.forward:
                program.append((0, op.chunk, -1 if vs == 0 else vs * m + op.microbatch,
                                -1 if vs == last else (vs + 1) * m + op.microbatch))
            elif op.part == "weight":
                program.append((3, op.chunk, -1, -1))
            else:
                program.append((kinds[op.part], op.chunk, -1 if vs == last else gradient + vs * m + op.microbatch,
                                -1 if vs == 0 else gradient + (vs - 1) * m + op.microbatch))
        out.append(tuple(program))
    return tuple(out)


def interleaved_bubble(num_microbatches: int, num_model_chunks: int, pipeline_parallel_size: int) -> float:
    """The seed's bubble share of a step: (p - 1) / (v * m + p - 1) (v = 1: plain 1F1B)."""
    p, v, m = pipeline_parallel_size, num_model_chunks, num_microbatches
    return (p - 1) / (v * m + p - 1)


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


__all__ = ["Operation", "PipelineTiming", "channel_messages", "check_order", "convert_schedule_table_to_order", "get_num_warmup_microbatches", "get_order", "get_pp_rank_microbatches", "get_schedule_table", "interleaved_bubble", "rank_operations", "receives_of", "send_releases", "sends_of", "simulate_pipeline", "simulate_shared_pipeline", "virtual_stage", "zero_bubble_orders"]
