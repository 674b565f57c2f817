"""The torch.distributed collectives the package uses, taking a ``ParallelGroup``.

A group of one never communicates: each function returns at once (copying
where the output is another tensor), so no caller hands torch.distributed a
``None`` group, which torch would read as the whole world.  The single-tensor
gather / scatter collectives are called under their current names (torch 2.13
renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` and warns on the old ones;
older torch, 2.11 on the GPU machine, has only the old ones).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from ..parallel_state import ParallelGroup

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

SUM, MAX, AVG = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG


def _torch_group(group: ParallelGroup):
    if group.group is None:
        raise RuntimeError(f"the {group.kind} group of {group.size} ranks has no process group (it was made for "
                           "laying data out on one process); build it with ParallelState.build")
    return group.group


def all_reduce(tensor: torch.Tensor, group: ParallelGroup, op=SUM, async_op: bool = False):
    """In place over ``group``; the work handle when ``async_op`` (None for a group of one)."""
    if group.size == 1:
        return None
    return dist.all_reduce(tensor, op=op, group=_torch_group(group), async_op=async_op)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: ParallelGroup, async_op: bool = False):
    """Every rank's ``tensor`` (equal sizes) concatenated along dim 0 into ``output``."""
    if group.size == 1:
        if output.data_ptr() != tensor.data_ptr():
            output.copy_(tensor)
        return None
    return _all_gather_single(output, tensor, group=_torch_group(group), async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, group: ParallelGroup, op=SUM,
                        async_op: bool = False):
    """The sum over ``group`` of ``tensor``, this rank's 1/size block of dim 0 into ``output``."""
    if group.size == 1:
        if output.data_ptr() != tensor.data_ptr():
            output.copy_(tensor)
        return None
    return _reduce_scatter_single(output, tensor, op=op, group=_torch_group(group), async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Optional[List[int]],
                      input_split_sizes: Optional[List[int]], group: ParallelGroup) -> None:
    """Rows ``input_split_sizes[r]`` of ``tensor`` go to rank r, ``output_split_sizes[r]`` rows come from it."""
    if group.size == 1:
        output.copy_(tensor)
        return
    dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                           input_split_sizes=input_split_sizes, group=_torch_group(group))
