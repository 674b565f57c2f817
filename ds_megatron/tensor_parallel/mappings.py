"""The conjugate communication operators of tensor (and sequence) parallelism.

Each operator is an autograd function whose backward is the conjugate of its
forward, as in section 3 of the Megatron-LM paper: ``copy_to`` (the paper's
*f*: identity forward, all-reduce backward) pairs with ``reduce_from`` (*g*:
all-reduce forward, identity backward); split pairs with all-gather; and the
sequence-parallel reduce-scatter pairs with all-gather along the sequence
dimension.  Tensors are ``[seq, batch, hidden]``: TP splits the last
dimension, sequence parallelism splits dimension 0.

Every function takes the tensor-parallel ``torch.distributed.ProcessGroup``
explicitly.  ``group=None`` means "no tensor parallelism" (a group of one), not
the world group, and a group of one is an identity with no communication.
Only collectives that gloo supports on CPU are used (all_reduce, all-gather
and reduce-scatter into/from a single tensor).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..utils.collectives import all_gather_single as _all_gather_single
from ..utils.collectives import reduce_scatter_single as _reduce_scatter_single
from .utils import divide


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Size of ``group``; ``None`` counts as a group of one."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank in ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


# --------------------------------------------------------------------- raw collectives
# Each returns a fresh contiguous tensor and never writes into its input: autograd
# may hand the same gradient tensor to several branches, so an in-place
# all-reduce of one branch's gradient would corrupt the others.

def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _split_along_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    chunk = divide(x.size(-1), world)
    start = group_rank(group) * chunk
    return x.narrow(-1, start, chunk).contiguous()


def _split_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    chunk = divide(x.size(0), world)
    start = group_rank(group) * chunk
    return x.narrow(0, start, chunk).contiguous()


def _gather_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    x = x.contiguous()
    out = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


def _gather_along_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    # The collective concatenates along dim 0; re-lay the rank blocks along the last dim.
    world = group_size(group)
    stacked = _gather_along_first_dim(x, group)
    return torch.cat(stacked.chunk(world, dim=0), dim=-1).contiguous()


def _reduce_scatter_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    x = x.contiguous()
    out = torch.empty((divide(x.size(0), world),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


# --------------------------------------------------------------------- autograd functions

class _CopyToModelParallelRegion(torch.autograd.Function):
    """The paper's f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """The paper's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim; backward all-gathers it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_last_dim(grad, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather along the last dim; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_along_last_dim(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the sequence dim; backward all-gathers it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_first_dim(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather along the sequence dim.

    Backward reduce-scatters when the gathered tensor feeds a tensor-parallel
    computation (each rank's gradient is then a partial sum over its weight
    shard); otherwise every rank already holds the full gradient and only
    keeps its slice.
    """

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad, ctx.group), None, None
        return _split_along_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence dim; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_first_dim(grad, ctx.group), None


# --------------------------------------------------------------------- public API

def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Identity forward, all-reduce (sum) of the gradient over ``group`` backward."""
    if group_size(group) == 1:
        return x
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """All-reduce (sum) over ``group`` forward, identity backward."""
    if group_size(group) == 1:
        return x
    return _ReduceFromModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """This rank's slice of the last dim forward, all-gather of the gradient backward."""
    if group_size(group) == 1:
        return x
    return _ScatterToModelParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """All-gather along the last dim forward, this rank's slice of the gradient backward."""
    if group_size(group) == 1:
        return x
    return _GatherFromModelParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """This rank's slice of dim 0 (sequence) forward, all-gather of the gradient backward."""
    if group_size(group) == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup],
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather along dim 0 forward; backward reduce-scatters (or just splits when
    ``tensor_parallel_output_grad`` is False, i.e. the consumer is replicated)."""
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor,
                                               group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Reduce-scatter (sum) along dim 0 forward, all-gather of the gradient backward."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)
