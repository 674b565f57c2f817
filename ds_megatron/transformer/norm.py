"""The normalization of a layer (``model.normalization``): torch's LayerNorm, or RMSNorm.

RMSNorm is ``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.  A
16-bit input is normalized in float32 (as Megatron and transformers do) and
cast back; float32 and float64 inputs are normalized in their own precision.
Its backward keeps only the input and the per-token ``1 / rms`` (as fused
RMSNorm kernels and torch's LayerNorm do): written as plain autograd ops it
also kept the normalized input (and a 16-bit input's float32 copy), one more
``[s, b, h]`` per norm in float32, three 16-bit ones in bf16.
"""
from __future__ import annotations

import torch

from ..tensor_parallel import mark_sequence_parallel


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class _RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rstd).to(x.dtype)`` with ``rstd = 1 / sqrt(mean(x^2) + eps)`` in float32 or wider; the
    backward recomputes the normalized input from ``x`` and ``rstd`` and applies the same casts as autograd of the
    forward would.  ``zero_centered`` (Gemma): ``((x * rstd) * (1 + weight)).to(x.dtype)``, the product in float32
    or wider too."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, zero_centered: bool = False):
        xf = _float(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered = zero_centered
        if zero_centered:
            return ((xf * rstd) * (1 + weight.to(xf.dtype))).to(x.dtype)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xf = _float(x)
        if ctx.zero_centered:
            gf = grad.to(xf.dtype)
            grad_weight = (gf * (xf * rstd)).reshape(-1, weight.numel()).sum(0).to(weight.dtype)
            g = gf * (1 + weight.to(xf.dtype))  # d/d(normed); a new tensor
        else:
            grad_weight = (grad * (xf * rstd).to(x.dtype)).reshape(-1, weight.numel()).sum(0).to(weight.dtype)
            g = (grad * weight).to(x.dtype).to(xf.dtype)  # d/d(normed), through the cast back; a new tensor
        # normed = xf * rstd and rstd = (mean(xf^2) + eps)^-1/2:
        # dxf = rstd * g - xf * rstd^3 * mean(g * xf), worked in g's storage: this backward runs at the start of
        # the model's backward, beside every layer's activations, so two [s, b, h] temporaries at most, not five.
        coefficient = rstd.pow(3) * (g * xf).mean(-1, keepdim=True)
        grad_x = g.mul_(rstd).sub_(xf * coefficient)
        return grad_x.to(x.dtype), grad_weight, None, None


class RMSNorm(torch.nn.Module):
    """``zero_centered_gamma`` (Megatron's layernorm_zero_centered_gamma, Gemma's norms): the weight is applied as
    ``1 + weight`` and starts at 0."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, zero_centered_gamma: bool = False):
        super().__init__()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size) if zero_centered_gamma else torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.zero_centered_gamma)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}" + (", 1 + weight" if self.zero_centered_gamma else "")


def build_norm(config, hidden_size: int, sequence_parallel: bool = False) -> torch.nn.Module:
    """The norm ``config.normalization`` names; ``sequence_parallel``: its weights see only this rank's tokens."""
    if config.normalization == "RMSNorm":
        norm = RMSNorm(hidden_size, eps=config.norm_epsilon, zero_centered_gamma=config.layernorm_zero_centered_gamma)
    else:
        norm = torch.nn.LayerNorm(hidden_size, eps=config.norm_epsilon)
    if sequence_parallel:
        mark_sequence_parallel(norm)
    return norm
