"""What a parameter's attributes mean (Megatron's names), and the gradient sync they imply.

Set by the layers that create the parameters, read by the gradient reducers,
the optimizer (norms, zero counts) and checkpointing:

* ``tensor_model_parallel``: True when the parameter is a slice of a larger
  weight (each TP rank holds a different part); False when it is replicated.
* ``partition_dim``: the dimension it was split along (-1 when replicated).
* ``partition_stride``: always 1 here (contiguous slices).
* ``sequence_parallel``: True for a replicated parameter that, under sequence
  parallelism, only sees this rank's slice of the sequence (LayerNorm weights,
  RowParallelLinear's bias): its gradient is a partial sum and must be summed
  over the TP group (``allreduce_sequence_parallel_grads``, Megatron's explicit
  call in ``finalize_model_grads``; or, for a loop that reduces nothing itself,
  ``register_sequence_parallel_grad_hooks`` inside backward).
* expert marks (``mark_expert_param``): DeepSpeed's ``allreduce=False`` and
  ``group_name``, and ``is_expert``; an expert's gradient is averaged over its
  expert-data-parallel group, not the data-parallel one.
* ``main_grad``: where a gradient buffer accumulates the gradient (``grad_of``).

Gradient-norm and zero counting use ``param_is_not_tensor_parallel_duplicate``
so replicated parameters are counted once per TP group.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Union

import torch

from ..parallel_state import ParallelGroup
from ..utils.collectives import all_reduce

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


def expert_group_name(ep_size: int) -> str:
    """The ``group_name`` DeepSpeed files expert groups of EP size ``ep_size`` under (its naming, kept here)."""
    return f"ep_size_{ep_size}"


def mark_expert_param(param: torch.nn.Parameter, ep_size: int, partition_dim: int) -> None:
    """An MoE expert's weight: reduced over expert data parallel, a distinct shard on the etp-ep grid."""
    param.allreduce = False  # DeepSpeed's mark: not reduced over data parallel
    param.group_name = expert_group_name(ep_size)
    param.is_expert = True
    # Every expert param is a distinct shard on the etp-ep grid: count it once per rank in norms.
    set_tensor_model_parallel_attributes(param, True, partition_dim)


def is_expert_param(param: torch.Tensor) -> bool:
    """An MoE expert param: ours (``is_expert``) or DeepSpeed's (``allreduce=False``)."""
    return getattr(param, "allreduce", True) is False or bool(getattr(param, "is_expert", False))


def grad_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient a step reads: the buffer's ``main_grad`` when a gradient buffer owns it, else ``.grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def sequence_parallel_params(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(params: Union[torch.nn.Module, Iterable[torch.nn.Parameter]],
                                      tp: ParallelGroup) -> int:
    """Sum over ``tp`` the gradients (``grad_of``) of ``params`` (or a module's) marked ``sequence_parallel``.

    Call after backward and before the optimizer step.  Gradients are
    flattened per dtype into one buffer so each dtype costs one all-reduce.
    Returns the number of gradients reduced.
    """
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    grads = [g for p in params if getattr(p, "sequence_parallel", False) for g in (grad_of(p),) if g is not None]
    if tp.size == 1 or not grads:
        return len(grads)
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for bucket in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        all_reduce(flat, tp)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)


def register_sequence_parallel_grad_hooks(module: torch.nn.Module, tp: ParallelGroup) -> list:
    """Sum over ``tp``, inside backward, each micro-batch's gradient of the params marked ``sequence_parallel``.

    For loops that reduce nothing across tensor parallelism themselves
    (DeepSpeed's own optimizer path): a tensor hook reduces the gradient
    before it is accumulated, so any loop sees full gradients.  Every TP rank
    runs the same backward graph, so the hooks' all-reduces are issued in the
    same order.  Returns the hook handles.
    """

    def hook(grad):
        grad = grad.clone()
        all_reduce(grad, tp)
        return grad

    if tp.size == 1:
        return []
    return [p.register_hook(hook) for p in sequence_parallel_params(module)]
