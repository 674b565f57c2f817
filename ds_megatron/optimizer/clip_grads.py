"""The true global gradient norm across model-parallel ranks, and clipping by it.

Each TP rank holds a shard of the split parameters and a full copy of the
replicated ones.  The global L2 norm counts every shard once and every
replicated parameter once (on TP rank 0 only), then sums the squares over the
model-parallel group.  A parameter shared by two modules (the tied
embedding) appears once in ``model.parameters()`` and is counted once; under
pipeline parallelism the last stage's copy of the tied embedding is a
parameter of its own, marked ``shared``, and is not counted (Megatron's
``param_is_not_shared``): the first stage's copy, with the same summed
gradient, is.

Every pass over the gradients is one multi-tensor op (``torch._foreach_norm``,
``torch._foreach_mul_``), as in megatron-core's multi-tensor path: one
dispatch per step instead of one per parameter.  The squares of the
per-tensor norms are summed in float64, so a finite fp32 gradient never
overflows the sum.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from ..parallel_state import ParallelGroup
from ..tensor_parallel.params import grad_of, is_expert_param, param_is_not_tensor_parallel_duplicate
from ..utils.collectives import MAX, all_reduce

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def grads_for_norm(params: Iterable[torch.nn.Parameter], tp_rank: int,
                   expert: Optional[bool] = None) -> List[torch.Tensor]:
    """The gradients that contribute to the norm on this rank (no TP duplicates, no repeats).

    ``expert``: None for every param, True for expert params only, False for the others."""
    seen, out = set(), []
    for p in params:
        g = grad_of(p)
        if g is None or id(p) in seen:
            continue
        seen.add(id(p))
        if getattr(p, "shared", False):
            continue
        if expert is not None and is_expert_param(p) != expert:
            continue
        if param_is_not_tensor_parallel_duplicate(p, tp_rank):
            out.append(g)
    return out


def per_tensor_norms(grads: Sequence[torch.Tensor], norm_type: float = 2.0) -> List[torch.Tensor]:
    """Each gradient's norm, from multi-tensor passes; 16-bit gradients are normed in fp32."""
    wide = [g.detach() for g in grads if g.dtype not in _LOW_PRECISION]
    narrow = [g.detach() for g in grads if g.dtype in _LOW_PRECISION]
    norms = list(torch._foreach_norm(wide, norm_type)) if wide else []
    if narrow:
        norms += torch._foreach_norm(narrow, norm_type, dtype=torch.float32)
    return norms


def sum_of_squares(grads: Sequence[torch.Tensor], device=None) -> torch.Tensor:
    """Sum over ``grads`` of their squared L2 norms, a float64 scalar tensor (one multi-tensor pass)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(per_tensor_norms(grads)).double().pow(2).sum()


def grad_norm_and_found_inf(squares: Sequence[torch.Tensor], reductions: Sequence[Tuple[ParallelGroup, Sequence[int]]],
                            flag: Optional[torch.Tensor] = None, check: bool = True) -> Tuple[bool, float]:
    """(some rank found inf/nan, the true global L2 norm): one float64 scalar all-reduce per group, which also
    agrees on the inf/nan check.

    ``squares[j]``: this rank's sum of squared gradients of partition j (float64 scalars); ``reductions``: each
    distinct group in order and the partitions whose squares are summed over it (a partition in none is this
    rank's alone); ``flag``: a float64 scalar, non-finite when this rank found inf/nan outside the squares (the
    unscale pass's flag as inf, or 0 * the squares of the TP duplicates, which no partition counts); ``check``:
    False for the norm alone.

    The flag travels inside the squared norm: a rank that found inf/nan makes the sum over its group
    non-finite, and a non-finite sum is carried into the next group's sum as ``0 * sum`` (nan) while a finite
    one adds 0.  Every rank of a group thus reads the same answer from one scalar, as a MAX of the flags over
    the same groups, in the same order, would give.
    """
    device = squares[0].device if squares else (flag.device if flag is not None else None)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    carry = flag if (check and flag is not None) else zero
    reduced = {j for _, members in reductions for j in members}
    total = sum((squares[j] for j in range(len(squares)) if j not in reduced), zero)
    if not reductions:
        total = total + carry
    for group, members in reductions:
        value = sum((squares[j] for j in members), carry)
        all_reduce(value, group)
        total = total + value
        carry = value * 0.0
    total = float(total)
    if check and not math.isfinite(total):
        return True, float("nan")
    return False, math.sqrt(total)


# MoE: expert params are summed over the expert-model-parallel group, the rest over model parallel
def get_grad_norm_with_experts(params: Iterable[torch.nn.Parameter], tp_rank: int, model_parallel_group: ParallelGroup,
                               expert_model_parallel_group: ParallelGroup, norm_type: float = 2.0) -> float:
    """The global norm when some params are experts.

    Dense params are counted as ``grads_for_norm`` does and their squares summed
    over the model-parallel group (tp-pp).  Every expert param is a distinct shard
    on the etp-ep grid (marked tensor-parallel), so each is counted on its rank
    and summed over the expert-model-parallel group (etp-ep-pp) instead: under
    MoE folding that group spans ranks of different data-parallel replicas, which
    the dense group never does.  Replicas of an expert (expert-data-parallel)
    are never summed.
    """
    params = list(params)
    dense = grads_for_norm(params, tp_rank, expert=False)
    experts = grads_for_norm(params, tp_rank, expert=True)
    if norm_type == float("inf"):
        return max(get_grad_norm_fp32(dense, model_parallel_group, norm_type),
                   get_grad_norm_fp32(experts, expert_model_parallel_group, norm_type))
    dense_sq = get_grad_norm_fp32(dense, model_parallel_group, norm_type) ** norm_type
    expert_sq = get_grad_norm_fp32(experts, expert_model_parallel_group, norm_type) ** norm_type
    return (dense_sq + expert_sq) ** (1.0 / norm_type)


def get_grad_norm_fp32(grads: List[torch.Tensor], model_parallel_group: Optional[ParallelGroup] = None,
                       norm_type: float = 2.0) -> float:
    """Norm of ``grads`` from every model-parallel rank; inf-norm or p-norm, computed in fp32 or wider."""
    device = grads[0].device if grads else torch.device("cpu")
    if norm_type == float("inf"):
        norms = per_tensor_norms(grads, norm_type)
        total = torch.stack(norms).float().max() if norms else torch.zeros((), device=device)
        if model_parallel_group is not None:
            all_reduce(total, model_parallel_group, op=MAX)
        return float(total)
    if norm_type == 2.0:
        total = sum_of_squares(grads, device)
    else:
        norms = per_tensor_norms(grads, norm_type)
        total = torch.stack(norms).double().pow(norm_type).sum() if norms else \
            torch.zeros((), dtype=torch.float64, device=device)
    if model_parallel_group is not None:
        all_reduce(total, model_parallel_group)
    return float(total) ** (1.0 / norm_type)


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """What the gradients are multiplied by (Megatron's ``max_norm / (total_norm + 1e-6)``); >= 1 means no clipping."""
    return max_norm / (total_norm + 1.0e-6)


def clip_grads_by_total_norm(grads: Sequence[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place by ``max_norm / total_norm`` when that is below 1 (one multi-tensor op)."""
    clip_coeff = clip_coefficient(max_norm, total_norm)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(list(grads), clip_coeff)


def clip_grad_by_total_norm_fp32(params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: float) -> None:
    """Scale every gradient by ``max_norm / total_norm`` when that is below 1."""
    clip_grads_by_total_norm([g.detach() for p in params for g in (grad_of(p),) if g is not None],
                             max_norm, total_norm)


def count_zeros_fp32(params: Iterable[torch.nn.Parameter], model_parallel_group: Optional[ParallelGroup] = None,
                     tp_rank: int = 0) -> int:
    """Number of zero gradient entries over the model, counting TP duplicates and shared params once."""
    grads = grads_for_norm(params, tp_rank)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += g.numel() - torch.count_nonzero(g)
    if model_parallel_group is not None:
        all_reduce(total, model_parallel_group)
    return int(total)
