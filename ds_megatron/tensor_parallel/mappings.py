"""The conjugate communication operators of tensor (and sequence) parallelism.

Each operator is an autograd function whose backward is the conjugate of its
forward, as in section 3 of the Megatron-LM paper: ``copy_to`` (the paper's
*f*: identity forward, all-reduce backward) pairs with ``reduce_from`` (*g*:
all-reduce forward, identity backward); split pairs with all-gather; and the
sequence-parallel reduce-scatter pairs with all-gather along the sequence
dimension.  Tensors are ``[seq, batch, hidden]``: TP splits the last
dimension, sequence parallelism splits dimension 0.

Every function takes the tensor-parallel group explicitly, as a
``ParallelGroup`` (``parallel_state.tp``); a group of one
(``ParallelGroup.single("tp")``) is an identity with no communication.  Only
collectives that gloo supports on CPU are used (all_reduce, all-gather and
reduce-scatter into/from a single tensor).
"""
from __future__ import annotations

import torch

from ..parallel_state import ParallelGroup
from ..utils.collectives import all_gather_into, all_reduce, reduce_scatter_into
from .utils import divide


# --------------------------------------------------------------------- raw collectives
# Each returns a fresh contiguous tensor and never writes into its input: autograd
# may hand the same gradient tensor to several branches, so an in-place
# all-reduce of one branch's gradient would corrupt the others.

def _all_reduce(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    all_reduce(out, group)
    return out


def _split_along_last_dim(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    chunk = divide(x.size(-1), group.size)
    return x.narrow(-1, group.rank * chunk, chunk).contiguous()


def _split_along_first_dim(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    chunk = divide(x.size(0), group.size)
    return x.narrow(0, group.rank * chunk, chunk).contiguous()


def _gather_along_first_dim(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((group.size * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x, group)
    return out


def _gather_along_last_dim(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    # The collective concatenates along dim 0; re-lay the rank blocks along the last dim.
    stacked = _gather_along_first_dim(x, group)
    return torch.cat(stacked.chunk(group.size, dim=0), dim=-1).contiguous()


def _reduce_scatter_along_first_dim(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((divide(x.size(0), group.size),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, x, group)
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

def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Identity forward, all-reduce (sum) of the gradient over ``group`` backward."""
    if group.size == 1:
        return x
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """All-reduce (sum) over ``group`` forward, identity backward."""
    if group.size == 1:
        return x
    return _ReduceFromModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """This rank's slice of the last dim forward, all-gather of the gradient backward."""
    if group.size == 1:
        return x
    return _ScatterToModelParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """All-gather along the last dim forward, this rank's slice of the gradient backward."""
    if group.size == 1:
        return x
    return _GatherFromModelParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """This rank's slice of dim 0 (sequence) forward, all-gather of the gradient backward."""
    if group.size == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: ParallelGroup,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather along dim 0 forward; backward reduce-scatters (or just splits when
    ``tensor_parallel_output_grad`` is False, i.e. the consumer is replicated)."""
    if group.size == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor,
                                               group: ParallelGroup) -> torch.Tensor:
    """Reduce-scatter (sum) along dim 0 forward, all-gather of the gradient backward."""
    if group.size == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)
