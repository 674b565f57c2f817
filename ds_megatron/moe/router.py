"""``TopKRouter``: which experts each token goes to, with what weight, and the routing losses.

For tokens ``x [T, h]`` the router computes ``logits = x W^T`` (``W [E, h]``,
replicated, drawn from the default RNG so it is the same for every parallel
layout) and returns Megatron's pair:

* ``probs [T, E]``: the weight of each chosen expert (0 elsewhere);
* ``routing_map [T, E]`` (bool): which experts each token is sent to.

Scores: ``softmax`` after top-k (Megatron's default: softmax over the k chosen
logits), ``softmax`` before top-k (``pre_softmax``), or ``sigmoid`` (chosen
scores renormalized to sum to 1 when k > 1).  Ties are broken towards the
lower expert index (a stable sort, not ``torch.topk``, whose order for equal
values is unspecified), so every rank and every run routes identically.

Capacity (``capacity_factor``): each expert keeps at most
``ceil(T * k / E * capacity_factor)`` tokens; the rest are dropped (their
weight for that expert becomes 0).  Policy ``"probs"`` keeps the highest
weights, ``"position"`` the earliest tokens; ties go to the earlier token.
``pad_to_capacity`` fills every expert to exactly its capacity with
zero-weight tokens (fixed shapes for the dispatch).

Losses (added to the model's loss and recorded in an ``MoEAuxLossTracker``):

* load balancing (Switch/GShard), over the whole sequence::

      aux = coeff * E / (k * N^2) * sum_e (sum_t score_te) * tokens_e

  with ``N`` the sequence's token count, ``score`` the softmax (or normalized
  sigmoid) over all experts, ``tokens_e`` the tokens routed to expert e.
  Under sequence parallelism each TP rank routes its own slice of the
  sequence: ``tokens_e`` is summed over ``tp_cp`` and ``N`` counts
  every slice, as Megatron does, so the sum over TP ranks of the local terms
  is the loss of the whole sequence;
* z-loss: ``coeff * mean_t logsumexp(logits_t)^2`` over the whole sequence.

Each local term's gradient is the gradient of that rank's share; the value
returned is the whole-sequence loss on every TP rank (``_whole_sequence``),
so the logged loss is the same everywhere.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from ..parallel_state import ParallelGroup
from ..tensor_parallel.init import InitMethod, init_method_normal
from ..utils.collectives import all_reduce
from .aux_loss_tracker import MoEAuxLossTracker

SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    # 16-bit logits are normalized in fp32 (as Megatron does); fp32/fp64 in their own precision.
    if logits.dtype in (torch.float16, torch.bfloat16):
        return torch.softmax(logits.float(), dim=-1).to(logits.dtype)
    return torch.softmax(logits, dim=-1)


def stable_topk(scores: torch.Tensor, k: int, dim: int = -1) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk`` with ties broken towards the lower index (deterministic)."""
    values, indices = torch.sort(scores, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert may keep: ``ceil(num_tokens / num_experts * capacity_factor)``.

    ``num_tokens`` counts token-expert assignments (tokens x topk), as Megatron does."""
    return int(math.ceil(num_tokens / num_experts * capacity_factor))


def capacity_mask(routing_probs: torch.Tensor, routing_map: torch.Tensor, capacity: int,
                  drop_policy: str = "probs") -> torch.Tensor:
    """[T, E] bool: the ``capacity`` tokens each expert keeps (routed tokens first).

    "probs" ranks an expert's tokens by weight, "position" by token index; the
    stable sort breaks ties towards the earlier token.  When fewer than
    ``capacity`` tokens are routed to an expert the remaining slots go to
    unrouted (zero-weight) tokens, which only matters with padding.
    """
    key = routing_probs if drop_policy == "probs" else routing_map.to(routing_probs.dtype)
    # Routed tokens always rank above unrouted ones, whatever their weight.
    key = key + routing_map.to(key.dtype) * (1.0 + key.abs().max().detach())
    order = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]
    mask = torch.zeros_like(routing_map)
    return mask.scatter(0, order, True)


def switch_load_balancing_loss_func(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int,
                                    topk: int, num_experts: int, coeff: float) -> torch.Tensor:
    """Megatron's Switch/GShard auxiliary loss of this rank's ``scores [T_local, E]``.

    ``tokens_per_expert`` and ``total_num_tokens`` are over the whole sequence."""
    aggregated = scores.sum(dim=0)
    return torch.sum(aggregated * tokens_per_expert.to(scores.dtype)) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens))


def z_loss_func(logits: torch.Tensor, total_num_tokens: int, coeff: float) -> torch.Tensor:
    """This rank's share of ``coeff * mean(logsumexp(logits)^2)`` over ``total_num_tokens`` tokens."""
    return torch.square(torch.logsumexp(logits, dim=-1)).sum() * (coeff / total_num_tokens)


class _WholeSequenceValue(torch.autograd.Function):
    """Forward: the sum of ``local`` over ``group`` (the whole-sequence loss); backward: identity.

    Each rank's backward then yields the gradient of its own share; the
    router weight's gradient is summed over the group afterwards (it is marked
    ``sequence_parallel``), which gives the gradient of the whole loss once.
    """

    @staticmethod
    def forward(ctx, local, group):
        total = local.detach().clone()
        all_reduce(total, group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _whole_sequence(local: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    if group.size == 1:
        return local
    return _WholeSequenceValue.apply(local, group)


class TopKRouter(torch.nn.Module):
    """Top-k router with capacity, aux loss and z-loss; ``forward(x [T, h]) -> (probs, routing_map)``.

    ``tp_cp``: the group the sequence is split over when this rank routes only
    its slice of it (sequence parallelism); a group of one when it routes the
    whole sequence.  After ``forward``, ``self.aux_losses`` holds the routing
    losses of the last call by name (differentiable scalars, whole-sequence
    values, already recorded in the tracker) and ``self.aux_loss`` their sum
    (0 when off).
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int, *, score_function: str = "softmax",
                 pre_softmax: bool = False, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 capacity_factor: Optional[float] = None, drop_policy: str = "probs", pad_to_capacity: bool = False,
                 tp_cp: Optional[ParallelGroup] = None, sequence_parallel: bool = False,
                 init_method: Optional[InitMethod] = None,
                 layer_number: int = 0, aux_loss_tracker: Optional[MoEAuxLossTracker] = None,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"moe_router_topk={topk} must be in [1, num_experts={num_experts}]")
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"moe_router_score_function={score_function!r} is unknown; use one of {SCORE_FUNCTIONS}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"moe_token_drop_policy={drop_policy!r} is unknown; use one of {DROP_POLICIES}")
        if pad_to_capacity and capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_capacity_factor; set it or turn padding off")
        self.num_experts, self.topk = num_experts, topk
        self.score_function, self.pre_softmax = score_function, pre_softmax
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.capacity_factor, self.drop_policy, self.pad_to_capacity = capacity_factor, drop_policy, pad_to_capacity
        self.tp_cp = tp_cp if tp_cp is not None else ParallelGroup.single("tp-cp")
        self.layer_number = layer_number
        self.aux_loss_tracker = aux_loss_tracker
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype))
        master = torch.empty(num_experts, hidden_size, dtype=torch.float32)
        (init_method or init_method_normal(0.02))(master)
        with torch.no_grad():
            self.weight.copy_(master)
        # Under sequence parallelism this rank sees only its tokens: the gradient is a partial
        # sum that the model adds up over TP (see GPTModel's sequence-parallel grad hook).
        self.weight.sequence_parallel = sequence_parallel
        self.aux_losses: Dict[str, torch.Tensor] = {}
        self.aux_loss: torch.Tensor = torch.zeros(())

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype))

    def _total_tokens(self, num_local: int) -> int:
        return num_local * self.tp_cp.size

    def routing(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(probs, routing_map) from ``logits [T, E]``; records the routing losses in ``self.aux_loss``."""
        num_tokens, E, k = logits.size(0), self.num_experts, self.topk
        total_tokens = self._total_tokens(num_tokens)
        losses: Dict[str, torch.Tensor] = {}
        if self.z_loss_coeff > 0 and self.training:
            losses["z_loss"] = _whole_sequence(z_loss_func(logits, total_tokens, self.z_loss_coeff), self.tp_cp)

        if self.score_function == "softmax":
            if self.pre_softmax:
                scores = _softmax(logits)
                top_probs, top_indices = stable_topk(scores, k)
            else:
                top_logits, top_indices = stable_topk(logits, k)
                top_probs = _softmax(top_logits)
            scores_for_aux = _softmax(logits)
        else:
            scores = torch.sigmoid(logits)
            top_probs, top_indices = stable_topk(scores, k)
            if k > 1:
                top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
            scores_for_aux = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)

        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
        routing_probs = torch.zeros_like(logits).scatter(1, top_indices, top_probs)

        if self.aux_loss_coeff > 0 and self.training:
            tokens_per_expert = routing_map.sum(dim=0)
            all_reduce(tokens_per_expert, self.tp_cp)
            losses["load_balancing_loss"] = _whole_sequence(switch_load_balancing_loss_func(
                scores_for_aux, tokens_per_expert, total_tokens, k, E, self.aux_loss_coeff), self.tp_cp)
        self.set_aux_losses(losses, logits)

        if self.capacity_factor is not None:
            capacity = get_capacity(num_tokens * k, E, self.capacity_factor)
            keep = capacity_mask(routing_probs.detach(), routing_map, capacity, self.drop_policy)
            routing_map = keep if self.pad_to_capacity else routing_map & keep
            routing_probs = routing_probs * routing_map.to(routing_probs.dtype)
        return routing_probs, routing_map

    def set_aux_losses(self, losses: Dict[str, torch.Tensor], like: torch.Tensor) -> None:
        """Keep this forward's routing losses (and their sum) and record them in the tracker.

        ``routing`` calls it; a replayed CUDA graph, which computed the losses without calling
        ``routing``, calls it with the graph's outputs."""
        self.aux_losses = dict(losses)
        self.aux_loss = sum(losses.values(), torch.zeros((), dtype=like.dtype, device=like.device))
        if self.aux_loss_tracker is not None:
            for name, value in losses.items():
                self.aux_loss_tracker.record(name, self.layer_number, value)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x [T, h]`` (or ``[s, b, h]``, flattened) -> ``(probs [T, E], routing_map [T, E])``."""
        x = x.reshape(-1, x.size(-1))
        return self.routing(self.gating(x))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, topk={self.topk}, score_function={self.score_function}, "
                f"pre_softmax={self.pre_softmax}, capacity_factor={self.capacity_factor}")
