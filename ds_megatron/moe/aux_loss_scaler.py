"""Routing losses that reach the gradients without being added to the final loss: ``MoEAuxLossAutoScaler``.

Under pipeline parallelism a MoE layer on an early stage cannot add its
routing loss to the loss, which only the last stage computes.  Megatron
attaches the loss to the layer's output instead: the output passes through
unchanged, and in backward the loss receives the gradient it would have had
as a term of the final loss (the loss scale divided by the micro-batches of
the step, as DeepSpeed's ``engine.backward`` divides the loss).  The scale is
read in backward, so a dynamic loss scale is the one of that step.

A layer wrapped by hand in a reentrant activation checkpoint (DeepSpeed's
``checkpointing.checkpoint``, torch's ``use_reentrant=True``) routes under
no_grad in the forward: its routing losses carry no gradient, wherever they
are added.  The checkpoint reruns the layer with grad in backward and
backpropagates only the layer's outputs, so ``reentrant_rerun_hook`` (on
the MoE layer) attaches that rerun's losses to the MoE layer's output.  The
weight is the owner's: a pipeline stage's scale, or for a model that adds the
losses to its loss, what that term received in this backward
(``RoutingLossGradient``).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..tensor_parallel.random import is_reentrant_rerun


class MoEAuxLossAutoScaler(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, grad_scale: Callable[[], torch.Tensor]):
        # Saves no tensor: inside a non-reentrant checkpoint the rerun matches saved tensors by their order,
        # whether or not it passes here again.
        ctx.aux_like = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        ctx.grad_scale = grad_scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shape, dtype, device = ctx.aux_like
        scale = ctx.grad_scale()
        scale = scale.to(device=device, dtype=dtype) if torch.is_tensor(scale) else scale
        return grad_output, torch.ones(shape, dtype=dtype, device=device) * scale, None


def reentrant_rerun_hook(weight: Callable[[], Optional[torch.Tensor]]):
    """A forward hook for an MoE layer: in a reentrant checkpoint's rerun its routing losses reach the gradients
    through its output, weighted by ``weight()`` (None: the loss being backpropagated holds no routing losses)."""

    def hook(moe_layer, _inputs, output):
        if not (moe_layer.training and is_reentrant_rerun()):
            return output
        aux = sum(moe_layer.aux_losses.values(), 0.0)
        scale = weight() if torch.is_tensor(aux) and aux.requires_grad else None
        return output if scale is None else MoEAuxLossAutoScaler.apply(output, aux, lambda: scale)
    return hook


class _ReceivedGradient(torch.autograd.Function):
    """Identity on the routing-loss term of a loss; in backward, hands the gradient it receives to ``record``."""

    @staticmethod
    def forward(ctx, total: torch.Tensor, anchor: Optional[torch.Tensor], record: Callable[[torch.Tensor], None]):
        ctx.record = record
        return total.view_as(total)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.record(grad)
        return grad if ctx.needs_input_grad[0] else None, None, None


class RoutingLossGradient:
    """What the routing-loss term of a model's loss receives in the backward being run (``weight()``), for
    ``reentrant_rerun_hook``.  The term's node is the loss's last, so the backward passes it before any layer's
    rerun; the gradient is kept with its backward (graph task), so a backward of a loss without the term finds
    none."""

    def __init__(self):
        self._received: Tuple[int, Optional[torch.Tensor]] = (-1, None)

    def term(self, total):
        """``total`` (the routing losses summed; 0 without any), as the term to add to the loss."""
        if not (torch.is_tensor(total) and torch.is_grad_enabled()):
            return total
        # Losses without a gradient (a reentrant checkpoint's forward): a leaf of the node puts it in the graph.
        anchor = None if total.requires_grad else torch.zeros((), device=total.device, requires_grad=True)
        return _ReceivedGradient.apply(total, anchor, self._record)

    def _record(self, grad: torch.Tensor) -> None:
        self._received = (torch._C._current_graph_task_id(), grad.detach())

    def weight(self) -> Optional[torch.Tensor]:
        task, grad = self._received
        return grad if task != -1 and task == torch._C._current_graph_task_id() else None
