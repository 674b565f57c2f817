"""Deferred weight gradients (Megatron's ``delay_wgrad_compute``): the zero-bubble schedule's W pass.

A zero-bubble pipeline splits each backward into B, the input gradient the previous stage waits for,
and W, the weight gradients nobody waits for, which the schedule runs later, in what would be
bubble.  ``ColumnParallelLinear`` and ``RowParallelLinear`` given a ``WeightGradStore``
(``layers.attach_weight_grad_store``) compute their weight-gradient GEMM in backward as usual, unless the
store is deferring: then the GEMM is queued under the current key and runs when the schedule calls
``run(key)``.  The deferred gradient is the same GEMM on the same tensors, so it is bit-identical to
the undeferred one; it reaches the parameter through ``accumulate`` (the gradient buffers' own
accumulation, which also tells a bucket its gradient is in).  An fp8 linear (``fp8.fp8_linear``)
defers the same way: its queued GEMM holds the fp8 copies of X and dY that B made, not the 16-bit tensors; so do
the fp8 experts' grouped GEMMs (``fp8.grouped``, from ``moe/experts.py``).

Besides the plain linear: ``deferrable(fn, x, weight, store)`` splits any ``fn(x, weight)`` (the experts'
grouped GEMM) the same way through autograd's own backward of ``fn``, asked first for the input gradient and,
when W runs, for the weight's; the vocab-parallel loss takes a store for the output layer's weight
(``cross_entropy.linear_vocab_parallel_cross_entropy``).  Modules holding such weights declare a
``weight_grad_store`` attribute, which ``layers.attach_weight_grad_store`` sets.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Dict, Hashable, List, Optional

import torch

from ..fp8 import FP8LinearState, fp8_linear


def accumulate_into_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """The default ``accumulate``: what autograd does with a leaf's gradient."""
    param.grad = grad if param.grad is None else param.grad + grad


class WeightGradStore:
    """Weight-gradient GEMMs queued per key (a chunk and micro-batch) while ``deferring``, run by ``run``."""

    def __init__(self, accumulate: Callable[[torch.nn.Parameter, torch.Tensor], None] = accumulate_into_grad):
        self.accumulate = accumulate
        self._key: Optional[Hashable] = None
        self._pending: Dict[Hashable, List[Callable[[], None]]] = {}

    @contextlib.contextmanager
    def deferring(self, key: Hashable):
        """Inside, weight-gradient GEMMs are queued under ``key`` instead of computed."""
        if self._key is not None:
            raise RuntimeError("WeightGradStore.deferring is already active")
        self._key = key
        self._pending.setdefault(key, [])
        try:
            yield
        finally:
            self._key = None

    def put(self, compute: Callable[[], None]) -> bool:
        """Queue ``compute`` if deferring (True), else leave it to the caller (False)."""
        if self._key is None:
            return False
        self._pending[self._key].append(compute)
        return True

    def run(self, key: Hashable) -> None:
        """Compute and accumulate the weight gradients queued under ``key``, in the order they were queued."""
        with torch.no_grad():  # as inside backward: the saved activations must not start a graph
            for compute in self._pending.pop(key, []):
                compute()

    @property
    def pending(self) -> List[Hashable]:
        return list(self._pending)


def weight_grad_or_defer(store: Optional[WeightGradStore], param: torch.nn.Parameter,
                         compute: Callable[[], torch.Tensor],
                         to_param: Callable[[torch.Tensor], torch.Tensor] = lambda grad: grad
                         ) -> Optional[torch.Tensor]:
    """In a backward: ``compute()``, the gradient autograd hands the op's weight (``param``, or a view of it); or,
    while ``store`` is deferring, None, with ``accumulate(param, to_param(compute()))`` queued for W (``to_param``:
    the view's gradient in ``param``'s layout, e.g. the fp8 experts' transposed weights)."""
    if store is not None and store.put(lambda: store.accumulate(param, to_param(compute()))):
        return None
    return compute()


class _LinearWithDeferrableWeightGrad(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose weight gradient may be deferred into a ``WeightGradStore``."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias, ctx.weight = store, bias is not None, weight
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = grad_output.reshape(-1, grad_output.size(-1)).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] \
            else None
        grad_weight = weight_grad_or_defer(
            ctx.store, ctx.weight,
            lambda: grad_output.reshape(-1, grad_output.size(-1)).t().mm(x.reshape(-1, x.size(-1)))) \
            if ctx.needs_input_grad[1] else None
        return grad_input, grad_weight, grad_bias, None


class _DeferrableWeightGrad(torch.autograd.Function):
    """``fn(x, weight)`` whose weight gradient may be deferred: the forward keeps ``fn``'s own autograd graph
    (on detached leaves), and the backward asks it for the input gradient now and for the weight's now or at W."""

    @staticmethod
    def forward(ctx, x, weight, store, fn):
        with torch.enable_grad():
            x_leaf = x.detach().requires_grad_(ctx.needs_input_grad[0])
            weight_leaf = weight.detach().requires_grad_()
            out = fn(x_leaf, weight_leaf)
        ctx.graph = (out, x_leaf, weight_leaf)
        ctx.store, ctx.weight = store, weight
        return out.detach()

    @staticmethod
    def backward(ctx, grad_output):
        out, x_leaf, weight_leaf = ctx.graph
        del ctx.graph
        grad_input = torch.autograd.grad(out, x_leaf, grad_output, retain_graph=True)[0] \
            if ctx.needs_input_grad[0] else None
        grad_weight = weight_grad_or_defer(ctx.store, ctx.weight,
                                           lambda: torch.autograd.grad(out, weight_leaf, grad_output)[0]) \
            if ctx.needs_input_grad[1] else None
        return grad_input, grad_weight, None, None


def deferrable(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
               store: Optional[WeightGradStore]) -> torch.Tensor:
    """``fn(x, weight)``, or with a store (and gradients on) the same op whose weight gradient the store may
    defer.  The gradients are autograd's own of ``fn``, in two calls instead of one."""
    if store is None or not torch.is_grad_enabled():
        return fn(x, weight)
    return _DeferrableWeightGrad.apply(x, weight, store, fn)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           store: Optional[WeightGradStore], fp8: Optional[FP8LinearState] = None) -> torch.Tensor:
    """``F.linear``, or with a store the linear whose weight gradient the store may defer, or with an fp8 state
    the linear whose three GEMMs run in fp8 by its recipe (its weight gradient deferrable the same way)."""
    if fp8 is not None:  # a deferred W runs on the fp8 copies of X and dY its B pass made, not the 16-bit ones
        return fp8_linear(x, weight, bias, fp8,
                          None if store is None else functools.partial(weight_grad_or_defer, store, weight))
    if store is None:
        return torch.nn.functional.linear(x, weight, bias)
    return _LinearWithDeferrableWeightGrad.apply(x, weight, bias, store)


__all__ = ["WeightGradStore", "accumulate_into_grad", "deferrable", "linear", "weight_grad_or_defer"]
