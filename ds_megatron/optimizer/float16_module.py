"""Megatron's ``Float16Module`` as two hooks on the user's module, plus the loss-scale seam.

Why hooks: ``engine.backward(loss)`` does not scale the loss for a client
optimizer, and subclassing DeepSpeed's engine to change that would tie us to
its internals.  A forward hook on ``engine.module`` sees every output the
engine returns; it wraps each one in ``_ScaleOnBackward``, whose forward is an
exact identity in value (the caller logs the true loss, in fp32) and whose
backward multiplies the incoming gradient by the current loss scale.  Every
parameter gradient then arrives scaled by S, whatever loss the caller builds
from the outputs and however DeepSpeed divides it for gradient accumulation
(both are linear).  The pre-hook casts floating inputs to the model's dtype
and the forward hook returns fp16/bf16 outputs in fp32, as ``Float16Module``
does, so losses are reduced and logged in fp32.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from .grad_scaler import MegatronGradScaler

_FLOAT16 = (torch.float16, torch.bfloat16)


class _ScaleOnBackward(torch.autograd.Function):
    """Forward: the output (fp32 if it was fp16/bf16).  Backward: grad x loss scale, in the output's dtype."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, grad_scaler: Optional[MegatronGradScaler]):
        ctx.grad_scaler = grad_scaler
        ctx.dtype = output.dtype
        return output.float() if output.dtype in _FLOAT16 else output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.grad_scaler is not None:
            # The product is formed in fp32: an fp16 grad x 2^16 may overflow, which the step detects.
            grad = grad.float() * ctx.grad_scaler.scale.to(grad.device).reshape(())
        return grad.to(ctx.dtype), None


def _map_tensors(value: Any, fn) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def attach_float16_hooks(module: torch.nn.Module, params_dtype: torch.dtype,
                         grad_scaler: Optional[MegatronGradScaler], outputs_feed_the_loss: bool = True) -> List[Any]:
    """Install the input cast, output cast and loss-scale hooks; returns the handles (``.remove()`` undoes).

    ``outputs_feed_the_loss``: False for a pipeline stage before the last, whose outputs are the next
    stage's inputs: they stay in the model's dtype and get no scaling (the gradient that comes back from
    the last stage is scaled already), as Megatron's ``Float16Module`` casts only on the last stage.
    """

    def cast_inputs(_module, args, kwargs):
        def to_model_dtype(t: torch.Tensor) -> torch.Tensor:
            return t.to(params_dtype) if t.dtype == torch.float32 and params_dtype in _FLOAT16 else t
        return _map_tensors(args, to_model_dtype), _map_tensors(kwargs, to_model_dtype)

    def scale_outputs(_module, _args, output):
        def wrap(t: torch.Tensor) -> torch.Tensor:
            if not t.is_floating_point():
                return t
            if t.requires_grad and torch.is_grad_enabled():
                return _ScaleOnBackward.apply(t, grad_scaler)
            return t.float() if t.dtype in _FLOAT16 else t
        return _map_tensors(output, wrap)

    handles = [module.register_forward_pre_hook(cast_inputs, with_kwargs=True)]
    if outputs_feed_the_loss:
        handles.append(module.register_forward_hook(scale_outputs))
    return handles
