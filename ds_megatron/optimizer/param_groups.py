"""Megatron's weight-decay rule as optimizer param groups: biases and LayerNorm weights are not decayed."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch


def get_param_groups(model: torch.nn.Module, weight_decay: Optional[float] = None) -> List[Dict[str, Any]]:
    """``[{decayed params, weight_decay}, {biases and norm weights, weight_decay 0}]``, empty groups dropped.

    Every 1-D parameter is a bias or a normalization weight in these models;
    decaying them pulls LayerNorm gains towards zero, which Megatron avoids.
    ``weight_decay`` None leaves the decayed group at the optimizer's own default.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    decayed = {"params": decay} if weight_decay is None else {"params": decay, "weight_decay": weight_decay}
    groups = [decayed, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
