"""The fp8 linear layer's three GEMMs as one autograd Function: forward ``Y = X W^T``, data gradient
``dX = dY W`` and weight gradient ``dW = dY^T X``, each on operands quantized by the layer's recipe
(``recipe.FP8LinearState``) and accumulated in fp32; outputs in the input's dtype (bf16 in training).

X and W are E4M3, dY is E4M3 or (``fp8 "hybrid"``) E5M2.  Tensorwise and delayed scaling quantize each tensor
once and reuse its fp8 copy, transposed, in both GEMMs it feeds (only the fp8 copies are kept for backward, as
Transformer Engine does); with ``fp8_param_gather`` W arrives as fp8 bytes with its scale (``param``) and is
used as it is.  Blockwise tiles each operand along its GEMM's reduction dimension, so X and dY are
quantized once per GEMM (1x128 along features, then along tokens for the weight gradient, DeepSeek-V3's 128x1
tiles); W's 128x128 blocks serve both of its GEMMs.

The delayed recipe records the amaxes of the passes that train (a forward with gradients on, and its backward), not
those of an evaluation under ``no_grad``: the scales of a step then depend on the training steps alone.  A deferred
weight gradient (ZB-H1's W pass, ``weight_grad``) runs later on the fp8 copies of X and dY the B pass made.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..utils import collectives
from .quantize import amax, cast, quantize_128x128, quantize_1x128, scale_from_amax, scaled_gemm
from .param import FP8_PARAM_DTYPE
from .recipe import BLOCK, FP8LinearState


def _per_tensor(state: FP8LinearState, tensors: Tuple[torch.Tensor, ...], roles: Tuple[str, ...], record: bool):
    """Tensorwise or delayed: each tensor's (fp8 copy, scale_inv).  Tensorwise agrees on the amaxes over the
    state's amax group (one all-reduce for all of them), so a split tensor is scaled as the whole; delayed uses the
    state's scales and, when ``record``, folds the amaxes into the step's."""
    recipe = state.recipe
    amaxes = torch.stack([amax(t) for t in tensors])
    if recipe.recipe == "tensorwise":
        collectives.all_reduce(amaxes, state.amax_group, op=collectives.MAX)
        scales = [scale_from_amax(a, recipe.fp8_max(r), recipe.margin) for a, r in zip(amaxes, roles)]
    else:
        state.follow(amaxes.device)
        for a, r in zip(amaxes, roles):
            if record:
                state.record_amax(r, a)
        scales = [state.scale[r] for r in roles]
    return [(cast(t, s, recipe.dtype(r)), 1.0 / s) for t, s, r in zip(tensors, scales, roles)]


def _blockwise_tokens(state: FP8LinearState, t: torch.Tensor, role: str):
    """``t [tokens, features]`` tiled 1x128 along the tokens (the weight gradient's reduction dimension)."""
    if t.size(0) % BLOCK:
        raise ValueError(f"fp8_recipe \"blockwise\" tiles the weight gradient's {t.size(0)} tokens by {BLOCK}; "
                         f"use a seq_length x micro_batch_size that is a multiple of {BLOCK}")
    r = state.recipe
    return quantize_1x128(t.t(), r.dtype(role), r.fp8_max(role), r.margin)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, state: FP8LinearState, record: bool, weight_grad):
        r = state.recipe
        x2 = x.reshape(-1, x.size(-1))
        if r.recipe == "blockwise":
            qx, sx = quantize_1x128(x2, r.dtype("input"), r.fp8_max("input"), r.margin)
            qw, sw = quantize_128x128(weight, r.dtype("weight"), r.fp8_max("weight"), r.margin)
            saved_x = _blockwise_tokens(state, x2, "input") if ctx.needs_input_grad[1] else (None, None)
        elif weight.dtype == FP8_PARAM_DTYPE:  # fp8_param_gather: W comes quantized, with its scale
            ((qx, sx),), qw, sw = _per_tensor(state, (x2,), ("input",), record), weight.detach(), weight.fp8_scale_inv
            saved_x = (qx, sx)
        else:
            (qx, sx), (qw, sw) = _per_tensor(state, (x2, weight), ("input", "weight"), record)
            saved_x = (qx, sx)
        y = scaled_gemm(qx, sx, qw, sw, x.dtype)
        if bias is not None:
            y = y + bias
        ctx.state, ctx.has_bias, ctx.x_shape, ctx.dtypes = state, bias is not None, x.shape, (x.dtype, weight.dtype)
        ctx.weight_grad = weight_grad
        ctx.fp8_param = weight if weight.dtype == FP8_PARAM_DTYPE else None
        ctx.save_for_backward(saved_x[0], saved_x[1], qw, sw)
        return y.reshape(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad_output):
        state, r = ctx.state, ctx.state.recipe
        qx, sx, qw, sw = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        w_dtype = x_dtype if ctx.fp8_param is not None else w_dtype
        dy = grad_output.reshape(-1, grad_output.size(-1))
        grad_input = grad_weight = grad_bias = None
        if r.recipe == "blockwise":
            if ctx.needs_input_grad[0]:
                qdy, sdy = quantize_1x128(dy, r.dtype("grad_output"), r.fp8_max("grad_output"), r.margin)
                grad_input = scaled_gemm(qdy, sdy, qw.t(), sw.t(), x_dtype)
            if ctx.needs_input_grad[1]:
                qdyt, sdyt = _blockwise_tokens(state, dy, "grad_output")
                grad_weight = ctx.weight_grad(lambda: scaled_gemm(qdyt, sdyt, qx, sx, w_dtype))
        else:
            ((qdy, sdy),) = _per_tensor(state, (dy,), ("grad_output",), True)
            if ctx.needs_input_grad[0]:
                grad_input = scaled_gemm(qdy, sdy, qw.t(), sw, x_dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = ctx.weight_grad(lambda: scaled_gemm(qdy.t(), sdy, qx.t(), sx, w_dtype))
        if ctx.fp8_param is not None and grad_weight is not None:
            # An fp8 param's .grad would be fp8: the gradient goes into its buffer, and the buffer's hook is told
            # (by a replayed CUDA graph's caller where a graph holds this: cuda_graphs.capture).
            ctx.fp8_param.main_grad.add_(grad_weight)
            ctx.fp8_param.grad_added_to_main_grad = True
            grad_weight = None
        if grad_input is not None:
            grad_input = grad_input.reshape(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(0)
        return grad_input, grad_weight, grad_bias, None, None, None


def _now(compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    return compute()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], state: FP8LinearState,
               weight_grad: Optional[Callable[[Callable[[], torch.Tensor]], Optional[torch.Tensor]]] = None
               ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its three GEMMs in fp8 by ``state``'s recipe.  ``weight_grad`` is handed
    the weight-gradient GEMM (a closure over the fp8 copies) and returns the gradient, or None having deferred it
    (``tensor_parallel.weight_grad_store.weight_grad_or_defer``); by default it runs at once."""
    return _FP8Linear.apply(x, weight, bias, state, torch.is_grad_enabled(), weight_grad or _now)


__all__ = ["fp8_linear"]
