"""Weight initialization that does not depend on the tensor-parallel size.

Every tensor-parallel layer builds its FULL master weight on the CPU from the
torch CPU generator, exactly as a single-rank model would, and keeps only this
rank's slice.  So after the same ``torch.manual_seed`` a model built with
TP=1, 2 or 4 has identical full weights, which is what makes TP=N runs
comparable with the single-rank run.  (This is Megatron's CPU initialization
path; it costs one full-size temporary per layer at build time.)
"""
from __future__ import annotations

import math
from typing import Callable

import torch

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def init_method_normal(std: float) -> InitMethod:
    """``N(0, std)`` initializer."""
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)
    return init_


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """``N(0, std / sqrt(2 * num_layers))``: the paper's scaling of weights feeding a residual add."""
    if num_layers <= 0:
        raise ValueError(f"num_layers={num_layers} must be positive for scaled_init_method_normal")
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def initialize_affine_weight_cpu(weight: torch.Tensor, full_shape, partition_dim: int, rank: int, world_size: int,
                                 init_method: InitMethod) -> torch.Tensor:
    """Fill ``weight`` (this rank's slice) from a freshly initialized full master weight.

    The master is drawn in float32 whatever ``weight.dtype`` is, so the same
    seed gives the same values for every params dtype; it is then cast and
    split evenly along ``partition_dim`` (stride 1), and slice ``rank`` is
    copied into ``weight``.  Returns the full master (float32) for tests and
    checkpoint conversion.
    """
    master = torch.empty(tuple(full_shape), dtype=torch.float32)
    init_method(master)
    chunk = master.size(partition_dim) // world_size
    if chunk * world_size != master.size(partition_dim) or tuple(weight.shape) != tuple(
            master.narrow(partition_dim, 0, chunk).shape):
        raise ValueError(f"weight slice of shape {tuple(weight.shape)} does not match 1/{world_size} of the full "
                         f"shape {tuple(full_shape)} along dim {partition_dim}")
    with torch.no_grad():
        weight.copy_(master.narrow(partition_dim, rank * chunk, chunk).to(weight.dtype))
    return master
