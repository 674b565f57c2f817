"""The normalization of a layer (``model.normalization``): torch's LayerNorm, or RMSNorm.

RMSNorm is ``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.  A
16-bit input is normalized in float32 (as Megatron and transformers do) and
cast back; float32 and float64 inputs are normalized in their own precision.
"""
from __future__ import annotations

import torch

from ..tensor_parallel import mark_sequence_parallel


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"


def build_norm(config, hidden_size: int, sequence_parallel: bool = False) -> torch.nn.Module:
    """The norm ``config.normalization`` names; ``sequence_parallel``: its weights see only this rank's tokens."""
    if config.normalization == "RMSNorm":
        norm = RMSNorm(hidden_size, eps=config.norm_epsilon)
    else:
        norm = torch.nn.LayerNorm(hidden_size, eps=config.norm_epsilon)
    if sequence_parallel:
        mark_sequence_parallel(norm)
    return norm
