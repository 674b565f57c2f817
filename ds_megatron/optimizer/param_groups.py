"""Megatron's weight-decay rule as optimizer param groups: biases and LayerNorm weights are not decayed."""
from __future__ import annotations

from typing import Any, Dict, List

import torch


def get_param_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """``[{decayed params, weight_decay}, {biases and norm weights, weight_decay 0}]``, empty groups dropped.

    Every 1-D parameter is a bias or a normalization weight in these models;
    decaying them pulls LayerNorm gains towards zero, which Megatron avoids.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
