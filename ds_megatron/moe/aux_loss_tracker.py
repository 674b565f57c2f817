"""``MoEAuxLossTracker``: the routing losses of every MoE layer, for logging.

Routers record each loss (detached) per layer on every forward; the training
loop reads ``averages()`` once per step (mean over the recorded forwards,
summed over layers, as Megatron's ``track_moe_metrics`` reports them) and
calls ``reset()``.  One tracker per model, handed to its routers: no module
globals.  The losses reach the total loss through the model, not through here.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict

import torch


class MoEAuxLossTracker:
    def __init__(self):
        self._sums: Dict[str, Dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self._counts: Dict[str, Dict[int, int]] = defaultdict(lambda: defaultdict(int))

    def record(self, name: str, layer_number: int, value: torch.Tensor) -> None:
        self._sums[name][layer_number] += float(value)
        self._counts[name][layer_number] += 1

    def per_layer(self) -> Dict[str, Dict[int, float]]:
        """{loss name: {layer number: mean over the recorded forwards}}."""
        return {name: {layer: s / self._counts[name][layer] for layer, s in layers.items()}
                for name, layers in self._sums.items()}

    def averages(self) -> Dict[str, float]:
        """{loss name: sum over layers of the per-layer mean}: what the training log shows."""
        return {name: sum(layers.values()) for name, layers in self.per_layer().items()}

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()
