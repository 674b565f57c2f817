"""``MoEAuxLossAutoScaler``: routing losses that reach the gradients without being added to the final loss.

Under pipeline parallelism a MoE layer on an early stage cannot add its
routing loss to the loss, which only the last stage computes.  Megatron
attaches the loss to the layer's output instead: the output passes through
unchanged, and in backward the loss receives the gradient it would have had
as a term of the final loss (the loss scale divided by the micro-batches of
the step, as DeepSpeed's ``engine.backward`` divides the loss).  The scale is
read in backward, so a dynamic loss scale is the one of that step.
"""
from __future__ import annotations

from typing import Callable

import torch


class MoEAuxLossAutoScaler(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, grad_scale: Callable[[], torch.Tensor]):
        ctx.save_for_backward(aux_loss)
        ctx.grad_scale = grad_scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = ctx.grad_scale()
        scale = scale.to(device=aux_loss.device, dtype=aux_loss.dtype) if torch.is_tensor(scale) else scale
        return grad_output, torch.ones_like(aux_loss) * scale, None
