"""What a parameter's tensor-parallel attributes mean, and the gradient sync they imply.

Attributes (Megatron's names), set on every parameter of the TP layers:

* ``tensor_model_parallel``: True when the parameter is a slice of a larger
  weight (each TP rank holds a different part); False when it is replicated.
* ``partition_dim``: the dimension it was split along (-1 when replicated).
* ``partition_stride``: always 1 here (contiguous slices).
* ``sequence_parallel``: True for a replicated parameter that, under sequence
  parallelism, only sees this rank's slice of the sequence (LayerNorm weights,
  RowParallelLinear's bias): its gradient is a partial sum and must be summed
  over the TP group: inside backward with ``register_sequence_parallel_grad_hooks``
  (what GPTModel does, so any training loop sees full gradients), or after
  backward with ``allreduce_sequence_parallel_grads`` (Megatron's explicit call).

Gradient-norm and zero counting use ``param_is_not_tensor_parallel_duplicate``
so replicated parameters are counted once per TP group.
"""
from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist

from .mappings import group_size

_TP_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """Mark ``param`` as split along ``dim`` (``is_parallel``) or replicated."""
    if stride != 1:
        raise ValueError(f"partition_stride={stride} is not supported; only contiguous slices (stride 1) are")
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(param: torch.Tensor) -> None:
    """Give ``param`` the replicated defaults for any TP attribute it lacks."""
    for name, value in _TP_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(param, name):
            setattr(param, name, value)


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True for a TP-split parameter, or for a replicated one on TP rank 0 (count it once)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def mark_sequence_parallel(params: Union[torch.nn.Module, Iterable[torch.nn.Parameter]]) -> None:
    """Set ``sequence_parallel=True`` on the given parameters (or all of a module's)."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    for p in params:
        p.sequence_parallel = True


def _grad_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    # Megatron's DDP accumulates into ``main_grad``; plain torch into ``grad``.
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def allreduce_sequence_parallel_grads(module: torch.nn.Module, tp_group: Optional[dist.ProcessGroup]) -> int:
    """Sum over ``tp_group`` the gradients of ``module``'s parameters marked ``sequence_parallel``.

    Call after backward and before the optimizer step (and before any data-
    parallel reduction sees the grads).  Gradients are flattened per dtype into
    one buffer so each dtype costs one all-reduce.  Returns the number of
    gradients reduced.
    """
    grads = [g for p in module.parameters() if getattr(p, "sequence_parallel", False)
             for g in (_grad_of(p),) if g is not None]
    if group_size(tp_group) == 1 or not grads:
        return len(grads)
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for bucket in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=tp_group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)


def register_sequence_parallel_grad_hooks(module: torch.nn.Module, tp_group: dist.ProcessGroup) -> int:
    """Sum over ``tp_group``, inside backward, the gradients of params marked ``sequence_parallel``.

    A tensor hook reduces each micro-batch's gradient before it is accumulated
    into ``.grad`` (or a grad buffer's ``main_grad``), so gradient accumulation
    and any loop see the full gradient.  Every TP rank runs the same backward
    graph, so the hooks' all-reduces are issued in the same order.  Returns the
    number of params hooked.
    """
    if tp_group is None:
        raise ValueError("tp_group is None, which torch.distributed reads as the whole world; "
                         "pass the tensor-parallel group (hooks are only needed when TP > 1)")

    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=tp_group)
        return grad

    params = [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]
    for p in params:
        p.register_hook(hook)
    return len(params)
