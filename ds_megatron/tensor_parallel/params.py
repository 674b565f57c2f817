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
  over the TP group.
* ``tp_replica_slot``: ``(slot, num_slots)`` for a parameter of which each of
  several consecutive TP ranks holds a copy (a KV group's projection when TP
  exceeds the KV groups): each copy's gradient is partial, summed over the TP
  ranks of the same slot.  Both kinds are "TP-partial": summed once per step
  in one all-reduce over TP (``allreduce_tp_partial_grads``, what Megatron's
  ``finalize_model_grads`` does for the first kind), or, for a loop that
  reduces nothing itself, every micro-batch inside backward
  (``register_tp_partial_grad_hooks``).
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


def mark_tp_replica(param: torch.nn.Parameter, slot: int, num_slots: int) -> None:
    """``param`` is one TP rank's copy of the ``slot``-th of ``num_slots`` weights, each held by several
    consecutive TP ranks; its gradient is summed over the ranks holding the same slot."""
    param.tp_replica_slot = (slot, num_slots)


def _tp_partial_kind(param: torch.Tensor):
    """``(slot, num_slots)`` for a TP-partial parameter (a sequence-parallel one is ``(0, 1)``), else None."""
    if getattr(param, "sequence_parallel", False):
        return (0, 1)
    return getattr(param, "tp_replica_slot", None)


def tp_partial_params(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The parameters whose gradients are partial sums over TP (sequence-parallel ones and TP replicas)."""
    return [p for p in module.parameters() if _tp_partial_kind(p) is not None]


def _pack_slots(grads: List[torch.Tensor], kinds):
    """One buffer with ``num_slots`` regions per gradient: the gradient in its own slot's region, zeros in the
    others (summed over TP, each slot then holds the sum of its ranks' gradients); and each gradient's start."""
    sizes = [g.numel() * n for g, (_, n) in zip(grads, kinds)]
    flat = grads[0].new_zeros(sum(sizes))
    starts, offset = [], 0
    for g, (slot, _), size in zip(grads, kinds, sizes):
        start = offset + slot * g.numel()
        flat[start:start + g.numel()].copy_(g.reshape(-1))
        starts.append(start)
        offset += size
    return flat, starts


def _reduce_slots(grads: List[torch.Tensor], kinds, tp: ParallelGroup) -> None:
    """Sum each gradient over the TP ranks of its slot, in place, with one all-reduce over ``tp``."""
    flat, starts = _pack_slots(grads, kinds)
    all_reduce(flat, tp)
    for g, start in zip(grads, starts):
        g.copy_(flat[start:start + g.numel()].view_as(g))


def allreduce_tp_partial_grads(params: Union[torch.nn.Module, Iterable[torch.nn.Parameter]],
                               tp: ParallelGroup) -> int:
    """Sum over ``tp`` the gradients (``grad_of``) of the TP-partial ``params`` (or a module's): the
    sequence-parallel ones over the whole group, each TP replica over the ranks of its slot.

    Call after backward and before the optimizer step (once per step: the accumulated gradients are summed).
    One all-reduce per dtype.  Returns the number of gradients reduced.
    """
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    pairs = [(g, _tp_partial_kind(p)) for p in params if _tp_partial_kind(p) is not None
             for g in (grad_of(p),) if g is not None]
    if tp.size == 1 or not pairs:
        return len(pairs)
    by_dtype = {}
    for g, kind in pairs:
        by_dtype.setdefault((g.dtype, g.device), []).append((g, kind))
    for bucket in by_dtype.values():
        _reduce_slots([g for g, _ in bucket], [k for _, k in bucket], tp)
    return len(pairs)


def register_tp_partial_grad_hooks(module: torch.nn.Module, tp: ParallelGroup) -> list:
    """Sum over ``tp``, inside backward, each micro-batch's gradient of the TP-partial params.

    For loops that reduce nothing across tensor parallelism themselves
    (DeepSpeed's own optimizer path): a tensor hook reduces the gradient
    before it is accumulated, so any loop sees full gradients.  Every TP rank
    runs the same backward graph, so the hooks' all-reduces are issued in the
    same order.  Returns the hook handles.
    """

    def hook_for(kind):
        def hook(grad):
            flat, (start,) = _pack_slots([grad], [kind])
            all_reduce(flat, tp)
            return flat[start:start + grad.numel()].view_as(grad)
        return hook

    if tp.size == 1:
        return []
    return [p.register_hook(hook_for(_tp_partial_kind(p))) for p in tp_partial_params(module)]
