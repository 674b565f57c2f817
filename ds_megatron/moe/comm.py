"""Differentiable collectives the token dispatchers need, on any backend torch.distributed has.

* ``all_to_all``: ``all_to_all_single`` with (uneven) splits along dim 0;
  backward is the all-to-all with the splits swapped.
* ``all_gather_v`` / ``reduce_scatter_v``: all-gather / reduce-scatter along
  dim 0 with a different size per rank (the expert-tensor-parallel gather of
  routed tokens).  gloo's all-gather and reduce-scatter need equal sizes, so
  both are built from the uneven all-to-all, which gloo has: the all-gather
  sends the same block to every peer; the reduce-scatter sends each peer its
  block and sums what comes back.  They are each other's backward.

Groups are ``ParallelGroup``s; a group of one is the identity.  Split sizes
are Python lists (host values): the caller decides where the device-to-host
copy happens.
"""
from __future__ import annotations

from typing import List

import torch

from ..parallel_state import ParallelGroup
from ..utils.collectives import all_gather_into, all_to_all_single


def _all_to_all_raw(x: torch.Tensor, output_splits: List[int], input_splits: List[int],
                    group: ParallelGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    all_to_all_single(out, x, output_splits, input_splits, group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _all_to_all_raw(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all_raw(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: List[int], input_splits: List[int],
               group: ParallelGroup) -> torch.Tensor:
    """Rows ``input_splits[r]`` of ``x`` go to rank r; ``output_splits[r]`` rows arrive from rank r."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def _all_gather_v_raw(x: torch.Tensor, sizes: List[int], group) -> torch.Tensor:
    world = len(sizes)
    return _all_to_all_raw(x.repeat((world,) + (1,) * (x.dim() - 1)), sizes, [x.size(0)] * world, group)


def _reduce_scatter_v_raw(x: torch.Tensor, sizes: List[int], group: ParallelGroup) -> torch.Tensor:
    world, me = len(sizes), group.rank
    parts = _all_to_all_raw(x, [sizes[me]] * world, sizes, group)
    return parts.view((world, sizes[me]) + tuple(x.shape[1:])).sum(dim=0)


class _AllGatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _all_gather_v_raw(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_v_raw(grad, ctx.sizes, ctx.group), None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_v_raw(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_v_raw(grad, ctx.sizes, ctx.group), None, None


def all_gather_v(x: torch.Tensor, sizes: List[int], group: ParallelGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 (rank r contributes ``sizes[r]`` rows)."""
    if group.size == 1:
        return x
    return _AllGatherV.apply(x, list(sizes), group)


def reduce_scatter_v(x: torch.Tensor, sizes: List[int], group: ParallelGroup) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's block (``sizes[rank]`` rows) of dim 0."""
    if group.size == 1:
        return x
    return _ReduceScatterV.apply(x, list(sizes), group)


def all_gather_counts(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """[world, *x.shape]: every rank's (equal-shaped, non-differentiable) ``x``."""
    if group.size == 1:
        return x.unsqueeze(0)
    out = x.new_empty((group.size * x.numel(),))
    all_gather_into(out, x.reshape(-1).contiguous(), group)
    return out.view((group.size,) + tuple(x.shape))
