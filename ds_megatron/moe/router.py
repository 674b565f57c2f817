"""``TopKRouter``: which experts each token goes to, with what weight, and the routing losses.

For tokens ``x [T, h]`` the router computes ``logits = x W^T`` (``W [E, h]``,
replicated, drawn from the default RNG so it is the same for every parallel
layout) and returns Megatron's pair:

* ``probs [T, E]``: the weight of each chosen expert (0 elsewhere), in the activations' dtype;
* ``routing_map [T, E]`` (bool): which experts each token is sent to.

``router_dtype`` (Megatron's ``moe_router_dtype``: None, fp32 or fp64): the logits,
scores and routing losses are computed in that dtype; the probs go back to the
activations' dtype for the experts.

Scores: ``softmax`` after top-k (Megatron's default: softmax over the k chosen
logits), ``softmax`` before top-k (``pre_softmax``), or ``sigmoid`` (chosen
scores renormalized to sum to 1 when k > 1).  ``topk_scaling_factor``
multiplies the chosen weights afterwards (Megatron's order).  Ties are broken
towards the lower expert index (a stable sort, not ``torch.topk``, whose order
for equal values is unspecified), so every rank and every run routes identically.

DeepSeek-V3 routing (Megatron-core's names):

* group-limited top-k (``num_groups`` G, ``group_topk``): the experts form G
  contiguous groups; a group's score is the sum of its best ``topk // group_topk``
  selection scores; the ``group_topk`` best groups stay and the top-k is taken
  among their experts (the others masked to -inf);
* expert bias (``enable_expert_bias``, aux-loss-free balancing): the selection
  (groups and top-k) uses ``scores + expert_bias``, the weights the scores
  alone.  ``expert_bias [E]`` is an fp32 buffer (in the state dict, kept fp32
  when the model is cast); training forwards add their routed tokens to
  ``local_tokens_per_expert`` (not checkpointed) and ``update_expert_bias``
  (called once per optimizer step by ``finalize_model_grads``) sums them over
  the ranks routing for these experts and moves the bias by
  ``rate * sign(mean - count)``.

Capacity (``capacity_factor``): each expert keeps at most
``ceil(T * k / E * capacity_factor)`` tokens; the rest are dropped (their
weight for that expert becomes 0).  Policy ``"probs"`` keeps the highest
weights, ``"position"`` the earliest tokens; ties go to the earlier token.
``pad_to_capacity`` fills every expert to exactly its capacity with
zero-weight tokens (fixed shapes for the dispatch).

Losses (added to the model's loss and recorded in an ``MoEAuxLossTracker``).
``score`` is the softmax (or normalized sigmoid) over all experts, and the
counts come from the top-k of these scores (no bias, no groups, no dropping:
Megatron's ``compute_routing_scores_for_aux_loss``):

* ``load_balancing_type "aux_loss"`` (Switch/GShard), over the micro-batch::

      aux = coeff * E / (k * N^2) * sum_e (sum_t score_te) * tokens_e

  with ``N`` the tokens of the micro-batch (every sequence part), ``tokens_e``
  the tokens routed to expert e;
* ``"seq_aux_loss"`` (DeepSeek-V3's sequence-wise loss), per sequence b of the
  micro-batch (tokens laid out ``[s, b]``)::

      seq_aux = coeff * mean_b sum_e (E / (k * S) * tokens_be) * (1 / S * sum_{t in b} score_te)

  with ``S`` the sequence length (every part);
* ``"global_aux_loss"``: ``aux`` with ``tokens_e`` and ``N`` over the global
  micro-batch (also summed over data parallelism); each micro-batch on its own
  (Megatron also averages the counts over the step's micro-batches so far; we
  do not);
* ``"none"``: no balancing loss (a coefficient with it is refused by the config);
* z-loss: ``coeff * mean_t logsumexp(logits_t)^2`` over the micro-batch.

Packed micro-batches (``PackedSeqParams``): padding tokens are routed but left out of every loss (and of the
expert bias's counts), ``N`` counting the real tokens only, as megatron-core's ``padding_mask``; the
sequence-wise loss takes each document as a sequence (``S`` its real tokens, the mean over the documents).

Sequence parts (``seq_group``): under sequence parallelism each TP rank routes
its slice of the sequence, under context parallelism each CP rank its chunks;
the counts are summed over that group and ``N`` / ``S`` count every part, as
Megatron does, so the sum over the group of the local terms is the loss of the
whole sequence.  Each local term's gradient is ``grad_scale`` (the CP size, and
x DP for the global loss) times the gradient of that rank's share: dense
gradients are averaged over dp-cp, as the LM loss compensates with ``x cp``, so
the reduced gradient is the gradient of the whole loss.  The value returned is
the whole loss on every rank of the group (``_whole_sequence``), so the logged
loss is the same everywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..parallel_state import ParallelGroup
from ..tensor_parallel.init import InitMethod, init_method_normal
from ..tensor_parallel.random import is_recomputing, is_reentrant_rerun
from ..utils.collectives import all_reduce
from .aux_loss_tracker import MoEAuxLossTracker

SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    # 16-bit logits are normalized in fp32 (as Megatron does); fp32/fp64 in their own precision.
    if logits.dtype in (torch.float16, torch.bfloat16):
        return torch.softmax(logits.float(), dim=-1).to(logits.dtype)
    return torch.softmax(logits, dim=-1)


def stable_topk(scores: torch.Tensor, k: int, dim: int = -1) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk`` with ties broken towards the lower index (deterministic)."""
    values, indices = torch.sort(scores, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


def group_limited_topk(scores: torch.Tensor, k: int, num_groups: int,
                       group_topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron's group-limited ("node-limited") top-k of ``scores [T, E]``: keep the ``group_topk`` groups (of
    ``E / num_groups`` contiguous experts) whose best ``k // group_topk`` scores sum highest, then the top-k of their
    experts.  Ties go to the lower group / expert index."""
    num_tokens, num_experts = scores.shape
    grouped = scores.reshape(num_tokens, num_groups, num_experts // num_groups)
    group_scores = stable_topk(grouped, k // group_topk)[0].sum(dim=-1)
    kept = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device)
    kept = kept.scatter(1, stable_topk(group_scores, group_topk)[1], True)
    allowed = kept.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return stable_topk(scores.masked_fill(~allowed, float("-inf")), k)


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


def sequence_load_balancing_loss_func(scores: torch.Tensor, routing_map: torch.Tensor, batch_size: int,
                                      seq_group: "ParallelGroup", topk: int, coeff: float) -> torch.Tensor:
    """This rank's share of DeepSeek-V3's sequence-wise loss (see the module docstring).

    ``scores`` / ``routing_map`` ``[T_local, E]`` are this rank's tokens in ``[s_local, b]`` order; the sequences'
    other parts are on the ranks of ``seq_group`` (their counts are summed here)."""
    num_experts = scores.size(-1)
    scores = scores.reshape(-1, batch_size, num_experts)
    counts = routing_map.reshape(-1, batch_size, num_experts).sum(dim=0).to(torch.float32)  # [b, E]
    all_reduce(counts, seq_group)
    seq_length = scores.size(0) * seq_group.size
    f = counts.to(scores.dtype) * (num_experts / (topk * seq_length))
    p_share = scores.sum(dim=0) / seq_length  # [b, E]
    return (f * p_share).sum(dim=-1).mean() * coeff


def document_load_balancing_loss_func(scores: torch.Tensor, routing_map: torch.Tensor, segments: torch.Tensor,
                                      segment_tokens: torch.Tensor, seq_group: "ParallelGroup", topk: int,
                                      coeff: float) -> torch.Tensor:
    """This rank's share of the sequence-wise loss with each packed document as a sequence: ``scores`` /
    ``routing_map [T_local, E]`` of this rank's real tokens (padding rows zero), ``segments [T_local]`` their
    documents, ``segment_tokens [D]`` each document's real tokens (0: a padding segment, left out of the mean)."""
    num_experts = scores.size(-1)
    counts = torch.zeros(segment_tokens.numel(), num_experts, dtype=torch.float32, device=scores.device)
    counts.index_add_(0, segments, routing_map.to(torch.float32))
    all_reduce(counts, seq_group)
    real = segment_tokens > 0
    length = segment_tokens.clamp(min=1).to(scores.dtype).unsqueeze(-1)
    f = counts.to(scores.dtype) * num_experts / (topk * length)
    p_share = torch.zeros(segment_tokens.numel(), num_experts, dtype=scores.dtype, device=scores.device)
    p_share = p_share.index_add(0, segments, scores) / length
    return (f * p_share).sum(dim=-1)[real].mean() * coeff


def z_loss_func(logits: torch.Tensor, total_num_tokens, coeff: float,
                valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's share of ``coeff * mean(logsumexp(logits)^2)`` over ``total_num_tokens`` tokens (``valid``: the
    real ones of a packed micro-batch)."""
    squares = torch.square(torch.logsumexp(logits, dim=-1))
    if valid is not None:
        squares = squares * valid.to(squares.dtype)
    return squares.sum() * (coeff / total_num_tokens)


class _WholeSequenceValue(torch.autograd.Function):
    """Forward: the sum of ``local`` over ``groups`` (the whole loss); backward: ``grad_scale`` x the gradient.

    Each rank's backward yields ``grad_scale`` x the gradient of its own share; summed over TP (the router is
    marked ``sequence_parallel`` under SP) and averaged over dp-cp by the gradient buffers, that is the gradient
    of the whole loss once.
    """

    @staticmethod
    def forward(ctx, local, groups, grad_scale):
        total = local.detach().clone()
        for group in groups:
            all_reduce(total, group)
        ctx.grad_scale = grad_scale
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.grad_scale, None, None


def _whole_sequence(local: torch.Tensor, groups: Sequence[ParallelGroup], grad_scale: float = 1.0) -> torch.Tensor:
    groups = [g for g in groups if g.size > 1]
    if not groups and grad_scale == 1.0:
        return local
    return _WholeSequenceValue.apply(local, groups, grad_scale)


@dataclass(frozen=True)
class RoutedTokens:
    """What a router needs to know of its tokens in a packed micro-batch (``MoELayer.route`` makes it from
    ``PackedSeqParams.router_tokens``): ``valid [T]`` (not padding), ``segments [T]`` their documents,
    ``segment_tokens [D]`` each document's real tokens over the whole micro-batch."""

    valid: torch.Tensor
    segments: torch.Tensor
    segment_tokens: torch.Tensor


class TopKRouter(torch.nn.Module):
    """Top-k router with capacity, routing losses and DeepSeek-V3's rules; ``forward(x) -> (probs, routing_map)``.

    ``x``: ``[s, b, h]`` (or ``[T, h]``; ``seq_aux_loss`` needs the ``[s, b, h]`` form to find the sequences).
    ``tp_cp`` (``seq_group``): the group the sequence is split over when this rank routes only its part of it
    (sequence parallelism: ``tp`` or ``tp-cp``; context parallelism alone: ``cp``); a group of one when it
    routes the whole sequence.  ``dp``: the data-parallel group (the global aux loss and the expert bias sum
    their counts over it).  ``grad_scale``: the factor dense gradients are divided by beyond DP (the CP
    size, see the module docstring).  After ``forward``, ``self.aux_losses`` holds the routing losses of the
    last call by name (differentiable scalars, whole-sequence values, already recorded in the tracker) and
    ``self.aux_loss`` their sum (0 when off).  The balancing loss is recorded as ``load_balancing_loss``
    whatever its type.
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int, *, score_function: str = "softmax",
                 pre_softmax: bool = False, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 capacity_factor: Optional[float] = None, drop_policy: str = "probs", pad_to_capacity: bool = False,
                 tp_cp: Optional[ParallelGroup] = None, sequence_parallel: bool = False,
                 init_method: Optional[InitMethod] = None,
                 layer_number: int = 0, aux_loss_tracker: Optional[MoEAuxLossTracker] = None,
                 params_dtype: torch.dtype = torch.float32, load_balancing_type: str = "aux_loss",
                 enable_expert_bias: bool = False, bias_update_rate: float = 1e-3,
                 num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                 topk_scaling_factor: Optional[float] = None, router_dtype: Optional[str] = None,
                 dp: Optional[ParallelGroup] = None, grad_scale: float = 1.0, bias: bool = False):
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"moe_router_topk={topk} must be in [1, num_experts={num_experts}]")
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"moe_router_score_function={score_function!r} is unknown; use one of {SCORE_FUNCTIONS}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"moe_token_drop_policy={drop_policy!r} is unknown; use one of {DROP_POLICIES}")
        if pad_to_capacity and capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_capacity_factor; set it or turn padding off")
        if load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ValueError(f"moe_router_load_balancing_type={load_balancing_type!r} is unknown; use one of "
                             f"{LOAD_BALANCING_TYPES}")
        if router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"moe_router_dtype={router_dtype!r} is unknown; use null, \"fp32\" or \"fp64\"")
        if enable_expert_bias and score_function != "sigmoid":
            raise ValueError("moe_router_enable_expert_bias needs moe_router_score_function \"sigmoid\" (as Megatron)")
        if (num_groups is None) != (group_topk is None):
            raise ValueError("moe_router_num_groups and moe_router_group_topk go together: set both or neither")
        if num_groups is not None and (num_experts % num_groups or not 1 <= group_topk <= num_groups
                                       or not group_topk <= topk <= group_topk * (num_experts // num_groups)):
            raise ValueError(f"moe_router_num_groups={num_groups} / moe_router_group_topk={group_topk} do not fit "
                             f"num_experts={num_experts}, topk={topk}")
        self.num_experts, self.topk = num_experts, topk
        self.score_function, self.pre_softmax = score_function, pre_softmax
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.load_balancing_type = load_balancing_type
        self.capacity_factor, self.drop_policy, self.pad_to_capacity = capacity_factor, drop_policy, pad_to_capacity
        self.num_groups, self.group_topk = num_groups, group_topk
        self.topk_scaling_factor = topk_scaling_factor
        self.router_dtype = ROUTER_DTYPES[router_dtype]
        self.tp_cp = tp_cp if tp_cp is not None else ParallelGroup.single("tp-cp")
        self.dp = dp if dp is not None else ParallelGroup.single("dp")
        self.grad_scale = float(grad_scale)
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
        # gpt-oss's logits bias (a parameter, unlike the expert bias buffer below); starts at zero
        self.bias = torch.nn.Parameter(torch.zeros(num_experts, dtype=params_dtype)) if bias else None
        if bias:
            self.bias.sequence_parallel = sequence_parallel
        self.enable_expert_bias, self.bias_update_rate = enable_expert_bias, float(bias_update_rate)
        if enable_expert_bias:
            # Buffers, not parameters: no optimizer sees them.  The bias is checkpointed; the counts are per step.
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32),
                                 persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None
        self.aux_losses: Dict[str, torch.Tensor] = {}
        self.aux_loss: torch.Tensor = torch.zeros(())

    def _apply(self, fn, *args, **kwargs):
        # .half() / .bfloat16() / .double() cast buffers too: the bias and counts stay fp32 (Megatron's
        # _maintain_float32_expert_bias), so 1e-3 steps are not rounded away and every rank adds the same.
        super()._apply(fn, *args, **kwargs)
        for name in ("expert_bias", "local_tokens_per_expert"):
            t = getattr(self, name)
            if t is not None and t.dtype != torch.float32:
                t.data = t.data.to(torch.float32)
        return self

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.router_dtype or x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)

    def _total_tokens(self, num_local: int) -> int:
        return num_local * self.tp_cp.size

    def _select(self, selection: torch.Tensor) -> torch.Tensor:
        """The chosen experts' indices ``[T, k]`` by ``selection`` scores (group-limited when configured)."""
        if self.num_groups is not None:
            return group_limited_topk(selection, self.topk, self.num_groups, self.group_topk)[1]
        return stable_topk(selection, self.topk)[1]

    def routing(self, logits: torch.Tensor, batch_size: Optional[int] = None,
                tokens: Optional["RoutedTokens"] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(probs, routing_map) from ``logits [T, E]`` (``T = s x b`` in [s, b] order); records the routing losses.
        ``tokens``: which of them are padding, and their documents (a packed micro-batch)."""
        num_tokens, E, k = logits.size(0), self.num_experts, self.topk
        total_tokens = self._total_tokens(num_tokens)
        valid = None if tokens is None else tokens.valid
        # The sequence-wise and the global balancing losses count their tokens themselves.
        counts_real = self.z_loss_coeff > 0 or (self.aux_loss_coeff > 0 and self.load_balancing_type == "aux_loss")
        if valid is not None and counts_real and self.training:
            # The whole sequence's real tokens (a tensor: no host sync), in the losses' precision (at least fp32).
            real = valid.sum().to(torch.promote_types(logits.dtype, torch.float32))
            all_reduce(real, self.tp_cp)
            total_tokens = real.clamp(min=1)
        training = self.training and torch.is_grad_enabled()
        losses: Dict[str, torch.Tensor] = {}
        if self.z_loss_coeff > 0 and self.training:
            losses["z_loss"] = _whole_sequence(z_loss_func(logits, total_tokens, self.z_loss_coeff, valid),
                                               [self.tp_cp], self.grad_scale)

        bias = None if self.expert_bias is None else self.expert_bias.to(logits.device)
        if self.score_function == "softmax":
            if self.pre_softmax:
                scores = _softmax(logits)
                top_indices = self._select(scores)
                top_probs = scores.gather(1, top_indices)
            else:
                top_indices = self._select(logits)
                top_probs = _softmax(logits.gather(1, top_indices))
            scores_for_aux = _softmax(logits)
        else:
            scores = torch.sigmoid(logits)
            # The bias picks the experts; the weights are the scores without it.
            top_indices = self._select(scores if bias is None else scores + bias)
            top_probs = scores.gather(1, top_indices)
            if k > 1:
                top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
            scores_for_aux = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        if self.topk_scaling_factor is not None:
            top_probs = top_probs * self.topk_scaling_factor

        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
        routing_probs = torch.zeros_like(logits).scatter(1, top_indices, top_probs)

        if self.aux_loss_coeff > 0 and self.training and self.load_balancing_type != "none":
            losses["load_balancing_loss"] = self._balancing_loss(scores_for_aux, total_tokens, batch_size, tokens)
        if not is_recomputing() or is_reentrant_rerun():
            # A rerun in backward (recomputation, a non-reentrant checkpoint) computes the forward's losses again
            # but never backpropagates them: keeping its would hold its [tokens, experts] tensors until the next
            # forward.  A reentrant rerun's are the ones its hook attaches to the layer's output.
            self.set_aux_losses(losses, logits)

        real_map = routing_map
        if self.capacity_factor is not None:
            capacity = get_capacity(num_tokens * k, E, self.capacity_factor)
            keep = capacity_mask(routing_probs.detach(), routing_map, capacity, self.drop_policy)
            real_map = routing_map & keep
            routing_map = keep if self.pad_to_capacity else real_map
            routing_probs = routing_probs * routing_map.to(routing_probs.dtype)
        if self.enable_expert_bias and training and (not is_recomputing() or is_reentrant_rerun()):
            # The tokens the experts really get (capacity padding slots and padding tokens are not load), counted
            # in the one pass with grad and a graph: the forward, whose non-reentrant rerun does not count them
            # again, or a reentrant checkpoint's rerun, whose forward ran under no_grad.
            with torch.no_grad():
                load = real_map if valid is None else real_map & valid.unsqueeze(-1)
                self.local_tokens_per_expert += load.sum(dim=0).to(torch.float32)
        return routing_probs, routing_map

    def _balancing_loss(self, scores: torch.Tensor, total_tokens, batch_size: Optional[int],
                        tokens: Optional["RoutedTokens"]) -> torch.Tensor:
        k, E, coeff = self.topk, self.num_experts, self.aux_loss_coeff
        # Counts by Megatron's rule: the top-k of the unbiased scores over all experts.
        loss_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, stable_topk(scores, k)[1], True)
        if tokens is not None:  # padding tokens count nowhere
            scores = scores * tokens.valid.unsqueeze(-1).to(scores.dtype)
            loss_map = loss_map & tokens.valid.unsqueeze(-1)
        if self.load_balancing_type == "seq_aux_loss" and tokens is not None:
            local = document_load_balancing_loss_func(scores, loss_map, tokens.segments, tokens.segment_tokens,
                                                      self.tp_cp, k, coeff)
            return _whole_sequence(local, [self.tp_cp], self.grad_scale)
        if self.load_balancing_type == "seq_aux_loss":
            if batch_size is None:
                raise ValueError("moe_router_load_balancing_type \"seq_aux_loss\" needs the router input as "
                                 "[s, b, h] to find the sequences")
            local = sequence_load_balancing_loss_func(scores, loss_map, batch_size, self.tp_cp, k, coeff)
            return _whole_sequence(local, [self.tp_cp], self.grad_scale)
        groups = [self.tp_cp] + ([self.dp] if self.load_balancing_type == "global_aux_loss" else [])
        tokens_per_expert = loss_map.sum(dim=0)
        if tokens is not None and len(groups) > 1:  # the real tokens of the global micro-batch
            dtype = torch.promote_types(scores.dtype, torch.float32)
            counted = torch.cat((tokens_per_expert.to(dtype), tokens.valid.sum().to(dtype)[None]))
            for group in groups:
                all_reduce(counted, group)
            tokens_per_expert, total = counted[:-1], counted[-1].clamp(min=1)
        else:
            for group in groups:
                all_reduce(tokens_per_expert, group)
            total = total_tokens * math.prod(g.size for g in groups[1:])
        # The global loss is summed over dp too, whose mean the gradient buffers take: x dp keeps its gradient.
        grad_scale = self.grad_scale * math.prod(g.size for g in groups[1:])
        local = switch_load_balancing_loss_func(scores, tokens_per_expert, total, k, E, coeff)
        return _whole_sequence(local, groups, grad_scale)

    def set_aux_losses(self, losses: Dict[str, torch.Tensor], like: torch.Tensor) -> None:
        """Keep this forward's routing losses (and their sum) and record them in the tracker.

        ``routing`` calls it; a replayed CUDA graph, which computed the losses without calling
        ``routing``, calls it with the graph's outputs."""
        self.aux_losses = dict(losses)
        self.aux_loss = sum(losses.values(), torch.zeros((), dtype=like.dtype, device=like.device))
        if self.aux_loss_tracker is not None:
            for name, value in losses.items():
                self.aux_loss_tracker.record(name, self.layer_number, value)

    def forward(self, x: torch.Tensor, tokens: Optional["RoutedTokens"] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x [s, b, h]`` (or ``[T, h]``) -> ``(probs [T, E], routing_map [T, E])``, probs in ``x``'s dtype.
        ``tokens``: the padding and documents of ``x``'s tokens in a packed micro-batch."""
        batch_size = x.size(1) if x.dim() == 3 else None
        x2 = x.reshape(-1, x.size(-1))
        probs, routing_map = self.routing(self.gating(x2), batch_size, tokens)
        if self.aux_losses and self.router_dtype not in (None, x.dtype):
            # The model adds these to its loss: in the activations' dtype, not promoted to the router's.
            self.aux_losses = {name: value.to(x.dtype) for name, value in self.aux_losses.items()}
            self.aux_loss = self.aux_loss.to(x.dtype)
        return probs.to(x.dtype), routing_map

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, topk={self.topk}, score_function={self.score_function}, "
                f"pre_softmax={self.pre_softmax}, capacity_factor={self.capacity_factor}, "
                f"load_balancing_type={self.load_balancing_type}, expert_bias={self.enable_expert_bias}, "
                f"groups={self.num_groups}/{self.group_topk}")


def update_expert_bias(routers: Iterable[TopKRouter]) -> None:
    """One optimizer step's aux-loss-free update of every router with an expert bias (collective over the
    routers' sequence and data-parallel groups; every rank of them calls it once per step).

    The counts of the step's training forwards are summed over the ranks that route for the same experts
    (the sequence group, then dp: two all-reduces for all layers), and in fp32
    ``expert_bias += rate * sign(mean(counts) - counts)``; the counts restart from zero.
    """
    routers: List[TopKRouter] = [r for r in routers if r.enable_expert_bias]
    if not routers:
        return
    with torch.no_grad():
        counts = torch.stack([r.local_tokens_per_expert for r in routers])  # [layers, E], fp32
        all_reduce(counts, routers[0].tp_cp)
        all_reduce(counts, routers[0].dp)
        step = torch.sign(counts.mean(dim=-1, keepdim=True) - counts)
        for r, s in zip(routers, step):
            r.expert_bias.add_(s * r.bias_update_rate)
            r.local_tokens_per_expert.zero_()


def expert_bias_routers(modules: Iterable[torch.nn.Module]) -> List[TopKRouter]:
    """The routers with an expert bias inside ``modules`` (in module order, the same on every rank)."""
    return [m for module in modules for m in module.modules()
            if isinstance(m, TopKRouter) and m.enable_expert_bias]
