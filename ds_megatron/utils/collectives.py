"""The torch.distributed collectives the package uses, taking a ``ParallelGroup``.

A group of one never communicates: each function returns at once (copying
where the output is another tensor), so no caller hands torch.distributed a
``None`` group, which torch would read as the whole world.  The single-tensor
gather / scatter collectives are called under their current names (torch 2.13
renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` and warns on the old ones;
older torch, 2.11 on the GPU machine, has only the old ones).

Being the one place the package's data collectives go through, this module
also counts them: inside ``with count_bytes() as counter:`` every collective
that communicates is recorded with its group and payload, and
``CollectiveRecord.bus_bytes`` converts the payload the way nccl-tests does
(all-reduce x 2(n-1)/n; all-gather, reduce-scatter and all-to-all x (n-1)/n,
of the gathered output, the reduced input and the sent buffer; a ring exchange or a send x 1 of
what each rank sends), so figures
compare with the layout's formula whatever the machine.  Outside such a block
the cost is one list test per call.  DeepSpeed's pipeline engine sends the
hidden states between stages itself; ``integration/pipeline.py`` routes those
sends through ``record`` so that they are counted too.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..parallel_state import ParallelGroup

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

SUM, MAX, AVG = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG


# nccl-tests' bus-bandwidth factors: what crosses each rank's link per byte of payload.
_BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
               "ring_exchange": lambda n: 1.0, "send": lambda n: 1.0}


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective this rank issued: ``op``, the group's kind and size, and the payload in bytes
    (nccl-tests' size: the all-reduced tensor, the all-gathered output, the reduce-scattered input,
    the all-to-all's send buffer)."""

    op: str
    group: str
    group_size: int
    payload_bytes: int
    shape: Tuple[int, ...] = ()  # of the tensor the payload is counted on

    @property
    def bus_bytes(self) -> float:
        return self.payload_bytes * _BUS_FACTOR[self.op](self.group_size)


@dataclass
class ByteCounter:
    """The collectives issued inside one ``count_bytes()`` block, in order."""

    records: List[CollectiveRecord] = field(default_factory=list)

    def select(self, op: Optional[str] = None, group: Optional[str] = None) -> List[CollectiveRecord]:
        return [r for r in self.records if (op is None or r.op == op) and (group is None or r.group == group)]

    def payload_bytes(self, op: Optional[str] = None, group: Optional[str] = None) -> int:
        return sum(r.payload_bytes for r in self.select(op, group))

    def bus_bytes(self, op: Optional[str] = None, group: Optional[str] = None) -> float:
        return sum(r.bus_bytes for r in self.select(op, group))

    def summary(self) -> Dict[tuple, Dict[str, float]]:
        """{(op, group): {"calls", "payload_bytes", "bus_bytes"}}."""
        out: Dict[tuple, Dict[str, float]] = {}
        for r in self.records:
            row = out.setdefault((r.op, r.group), {"calls": 0, "payload_bytes": 0, "bus_bytes": 0.0})
            row["calls"] += 1
            row["payload_bytes"] += r.payload_bytes
            row["bus_bytes"] += r.bus_bytes
        return out


_counters: List[ByteCounter] = []


@contextlib.contextmanager
def count_bytes() -> Iterator[ByteCounter]:
    """Record every communicating collective issued through this module inside the block (blocks may nest)."""
    counter = ByteCounter()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def record(op: str, group: ParallelGroup, tensor: torch.Tensor) -> None:
    """Count ``tensor`` as the payload of ``op`` over ``group`` in every open ``count_bytes()`` block."""
    if _counters:
        record = CollectiveRecord(op, group.kind, group.size, tensor.numel() * tensor.element_size(),
                                  tuple(tensor.shape))
        for counter in _counters:
            counter.records.append(record)


def _torch_group(group: ParallelGroup):
    if group.group is None:
        raise RuntimeError(f"the {group.kind} group of {group.size} ranks has no process group (it was made for "
                           "laying data out on one process); build it with ParallelState.build")
    return group.group


def all_reduce(tensor: torch.Tensor, group: ParallelGroup, op=SUM, async_op: bool = False):
    """In place over ``group``; the work handle when ``async_op`` (None for a group of one)."""
    if group.size == 1:
        return None
    record("all_reduce", group, tensor)
    return dist.all_reduce(tensor, op=op, group=_torch_group(group), async_op=async_op)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: ParallelGroup, async_op: bool = False):
    """Every rank's ``tensor`` (equal sizes) concatenated along dim 0 into ``output``."""
    if group.size == 1:
        if output.data_ptr() != tensor.data_ptr():
            output.copy_(tensor)
        return None
    record("all_gather", group, output)
    return _all_gather_single(output, tensor, group=_torch_group(group), async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, group: ParallelGroup, op=SUM,
                        async_op: bool = False):
    """The sum over ``group`` of ``tensor``, this rank's 1/size block of dim 0 into ``output``."""
    if group.size == 1:
        if output.data_ptr() != tensor.data_ptr():
            output.copy_(tensor)
        return None
    record("reduce_scatter", group, tensor)
    return _reduce_scatter_single(output, tensor, op=op, group=_torch_group(group), async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Optional[List[int]],
                      input_split_sizes: Optional[List[int]], group: ParallelGroup) -> None:
    """Rows ``input_split_sizes[r]`` of ``tensor`` go to rank r, ``output_split_sizes[r]`` rows come from it."""
    if group.size == 1:
        output.copy_(tensor)
        return
    record("all_to_all", group, tensor)
    dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                           input_split_sizes=input_split_sizes, group=_torch_group(group))


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, group: ParallelGroup, tag: int = 0) -> List:
    """Start sending ``send`` to the next rank of ``group`` and receiving ``recv`` from the previous one.

    Returns the work handles to wait on (none for a group of one, where ``recv`` gets ``send``).  The
    tag keeps two exchanges in flight to the same neighbour apart (context parallelism's K/V and dK/dV)."""
    if group.size == 1:
        recv.copy_(send)
        return []
    record("ring_exchange", group, send)
    pg = _torch_group(group)
    nxt, prev = group.ranks[(group.rank + 1) % group.size], group.ranks[(group.rank - 1) % group.size]
    return [dist.isend(send, nxt, group=pg, tag=tag), dist.irecv(recv, prev, group=pg, tag=tag)]


def all_gather_object(obj, group: ParallelGroup) -> List:
    """Every rank's picklable ``obj``, in ``group``'s rank order (``[obj]`` for a group of one; not counted:
    pickled objects, not tensors)."""
    if group.size == 1:
        return [obj]
    out = [None] * group.size
    dist.all_gather_object(out, obj, group=_torch_group(group))
    return out


def barrier(group: Optional[ParallelGroup] = None) -> None:
    """Wait until every rank of ``group`` (None: every rank of the job) arrives (nothing is sent: not counted)."""
    if group is None:
        dist.barrier()
    elif group.size > 1:
        dist.barrier(group=_torch_group(group))
