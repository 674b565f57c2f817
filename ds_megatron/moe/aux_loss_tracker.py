"""``MoEAuxLossTracker``: the routing losses of every MoE layer, for logging.

Routers record each loss (detached) per layer on every forward; the training
loop reads ``averages()`` once per step (mean over the recorded forwards,
summed over layers, as Megatron's ``track_moe_metrics`` reports them) and
calls ``reset()``.  One tracker per model, handed to its routers: no module
globals.  The losses reach the total loss through the model, not through here.
A layer recomputed in backward (``tensor_parallel.checkpoint``, or a checkpoint
the user wrapped it in: torch's or DeepSpeed's, reentrant or not) routes again;
records made during that rerun are ignored, so each forward counts once (a
reentrant checkpoint's forward records them under no_grad).

Everything stays on the device: ``record`` adds tensors (a ``float()`` there
would wait for the GPU in every MoE layer of every forward, and is illegal
inside a CUDA graph capture); the loop brings the values to the host once per
log interval, as Megatron reduces its tracker once per step.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from ..tensor_parallel.random import is_recomputing


class MoEAuxLossTracker:
    def __init__(self):
        # (loss name, layer number) -> (sum of the recorded values as a device tensor, number of records)
        self._sums: Dict[Tuple[str, int], Tuple[torch.Tensor, int]] = {}

    def record(self, name: str, layer_number: int, value: torch.Tensor) -> None:
        if is_recomputing():  # the forward being rerun recorded this value already
            return
        total, count = self._sums.get((name, layer_number), (None, 0))
        value = value.detach()
        self._sums[(name, layer_number)] = (value if total is None else total + value, count + 1)

    def per_layer(self) -> Dict[str, Dict[int, torch.Tensor]]:
        """{loss name: {layer number: mean over the recorded forwards}} (0-dim device tensors)."""
        out: Dict[str, Dict[int, torch.Tensor]] = {}
        for (name, layer), (total, count) in self._sums.items():
            out.setdefault(name, {})[layer] = total / count
        return out

    def averages(self) -> Dict[str, torch.Tensor]:
        """{loss name: sum over layers of the per-layer mean}: what the training log shows (device tensors)."""
        return {name: torch.stack(list(layers.values())).sum() for name, layers in self.per_layer().items()}

    def reset(self) -> None:
        self._sums.clear()
