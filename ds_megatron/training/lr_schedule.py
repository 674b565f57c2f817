"""Megatron's learning-rate schedule: linear warmup, then cosine (or linear) decay to ``min_lr``."""
from __future__ import annotations

import math

import torch


def lr_at(step: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: int, style: str = "cosine") -> float:
    """The learning rate for optimizer step ``step`` (0-based)."""
    if warmup_iters > 0 and step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    if style == "constant":
        return lr
    span = max(decay_iters - warmup_iters, 1)
    progress = min(max(step - warmup_iters, 0) / span, 1.0)
    if style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
    return min_lr + coeff * (lr - min_lr)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, lr: float, min_lr: float, warmup_iters: int,
                       decay_iters: int, style: str = "cosine") -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over ``lr_at``; its state (last_epoch) is checkpointed by DeepSpeed."""
    for group in optimizer.param_groups:
        group["lr"] = lr
        group["initial_lr"] = lr
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, lr, min_lr, warmup_iters, decay_iters, style) / lr)
