"""Token dispatchers: move routed tokens to the ranks that hold their experts, and back.

Both dispatchers split the work into Megatron's six steps, each a method, so
a partial CUDA-graph capture can stop after ``dispatch_preprocess``::

    hidden, probs = d.dispatch_preprocess(hidden, routing_map, probs)   # counts, permutation 1
    hidden, probs = d.token_dispatch(hidden, probs)                     # communication
    x, tokens_per_expert, probs = d.dispatch_postprocess(hidden, probs) # group by local expert
    y = experts(x, tokens_per_expert, probs, counts=d.tokens_per_expert)  # host ints, device tensor
    y = d.combine_preprocess(y)
    y = d.token_combine(y)                                              # communication back
    out = d.combine_postprocess(y)                                      # un-permute, sum over k

* ``MoEAlltoAllTokenDispatcher``: tokens go by all-to-all over the EP group,
  then are all-gathered over the expert-tensor-parallel (ETP) group (each ETP
  rank holds a slice of every local expert's weights); the way back is the
  ETP reduce-scatter (summing the partial outputs) and the reverse all-to-all.
* ``MoEAllGatherTokenDispatcher``: every rank all-gathers all tokens of the
  etp-ep group and keeps those for its local experts; the way back is a
  reduce-scatter.  More traffic, no count exchange: good for small EP.

The routing weights (``probs``) travel with the tokens and are applied by the
experts (before their second GEMM), so un-permuting is a plain scatter-add.

The device-to-host sync point: split sizes must be host integers for the
collectives, and reading them waits for the device.  ``dispatch_preprocess``
only computes device tensors (its ``preprocess_state()``; a partial CUDA graph
that captured it hands them back with ``restore_preprocess_state``); they are copied
to the host at ``cuda_sync_point`` (the only host sync of the alltoall dispatcher;
the allgather dispatcher has one too, reading its per-expert counts): ``"before_permutation_1"`` (at the end of
``dispatch_preprocess``) or ``"before_ep_alltoall"`` (at the start of
``token_dispatch``, the default: everything up to the all-to-all can then be
captured in a graph).  Without token dropping (or with padding) the first
permutation has a static shape and does not sync by itself.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..parallel_state import ParallelGroup
from ..tensor_parallel.mappings import gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region
from .comm import all_gather_counts, all_gather_v, all_to_all, reduce_scatter_v
from .router import get_capacity

SYNC_POINTS = ("before_permutation_1", "before_ep_alltoall")


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
            num_out_tokens: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group token copies by expert: ``(permuted_tokens, permuted_probs, sorted_indices)``.

    Expert-major, tokens in order within an expert.  ``sorted_indices[i]`` is
    the source row of output row i (Megatron's reversed permutation mapping).
    ``num_out_tokens``, when known ahead (no dropping: T*k; padding: E*capacity),
    keeps every shape static (no device-to-host sync).
    """
    num_tokens = routing_map.size(0)
    flat = routing_map.t().reshape(-1)
    if num_out_tokens is None:
        selected = flat.nonzero().squeeze(1)
    else:
        selected = torch.argsort((~flat).to(torch.uint8), stable=True)[:num_out_tokens]
    sorted_indices = selected % num_tokens
    return tokens.index_select(0, sorted_indices), probs.t().reshape(-1).index_select(0, selected), sorted_indices


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum each token's expert outputs back into its row: the inverse of ``permute``."""
    out = permuted_tokens.new_zeros((num_tokens,) + tuple(permuted_tokens.shape[1:]))
    return out.index_add(0, sorted_indices, permuted_tokens)


def sort_chunks_by_idxs(x: torch.Tensor, split_sizes: Sequence[int], sorted_idxs: Sequence[int]) -> torch.Tensor:
    """Split ``x`` along dim 0 into ``split_sizes`` chunks and concatenate them in ``sorted_idxs`` order."""
    chunks = torch.split(x, list(split_sizes), dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs], dim=0)


class MoETokenDispatcher:
    """What both dispatchers share: the expert layout, the groups, and the preprocess state.

    ``PREPROCESS_STATE`` names the device tensors ``dispatch_preprocess`` sets and
    the later steps read (dotted for nested ones).
    """

    PREPROCESS_STATE: Sequence[str] = ()

    def __init__(self, num_experts: int, *, ep: ParallelGroup, etp: ParallelGroup, router_topk: int = 1,
                 capacity_factor: Optional[float] = None, pad_to_capacity: bool = False):
        self.num_experts = num_experts
        self.router_topk, self.capacity_factor, self.pad_to_capacity = router_topk, capacity_factor, pad_to_capacity
        self.ep, self.etp = ep, etp
        self.ep_size, self.ep_rank = ep.size, ep.rank
        self.etp_size, self.etp_rank = etp.size, etp.rank
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by expert_model_parallel_size="
                             f"{self.ep_size}; choose an EP size that divides the number of experts")
        self.num_local_experts = num_experts // self.ep_size
        self.local_expert_indices = list(range(self.ep_rank * self.num_local_experts,
                                               (self.ep_rank + 1) * self.num_local_experts))

    def num_out_tokens(self, routing_map: torch.Tensor) -> Optional[int]:
        """Token copies ``routing_map`` selects, when that is known without reading it (None otherwise)."""
        num_tokens = routing_map.size(0)
        if self.capacity_factor is None:
            return num_tokens * self.router_topk
        if self.pad_to_capacity:
            return self.num_experts * get_capacity(num_tokens * self.router_topk, self.num_experts,
                                                   self.capacity_factor)
        return None  # dropping without padding: data-dependent

    def preprocess_state(self) -> Dict[str, torch.Tensor]:
        """The device tensors the last ``dispatch_preprocess`` set (``PREPROCESS_STATE``)."""
        return {name: getattr(self, name) for name in self.PREPROCESS_STATE}

    def restore_preprocess_state(self, state: Dict[str, torch.Tensor]) -> None:
        """Take tensors ``dispatch_preprocess`` would have set (a replayed graph computed them)."""
        for name, value in state.items():
            setattr(self, name, value)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """All-to-all over EP plus all-gather / reduce-scatter over ETP (see the module docstring)."""

    PREPROCESS_STATE = ("routing_map", "tokens_per_expert", "input_splits", "output_splits", "output_splits_tp",
                        "num_global_tokens_per_local_expert", "reversed_local_input_permutation_mapping")

    def __init__(self, num_experts: int, *, cuda_sync_point: str = "before_ep_alltoall", **kwargs):
        super().__init__(num_experts, **kwargs)
        if cuda_sync_point not in SYNC_POINTS:
            raise ValueError(f"cuda_sync_point={cuda_sync_point!r} is unknown; use one of {SYNC_POINTS}")
        self.cuda_sync_point = cuda_sync_point
        L, ep, etp = self.num_local_experts, self.ep_size, self.etp_size
        # Received chunks arrive ordered (etp rank, ep rank, local expert); experts want
        # (local expert, etp rank, ep rank), and the way back needs the inverse.
        order = torch.arange(etp * ep * L).view(etp * ep, L)
        self.sort_input_by_local_experts = order.t().reshape(-1).tolist()
        self.restore_output_by_local_experts = torch.arange(etp * ep * L).view(L, etp * ep).t().reshape(-1).tolist()
        self._host = None

    # -- step 1: counts and the first permutation (no communication of tokens) ----------------------
    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Count tokens per expert and exchange the counts; returns ``tokens_per_expert`` (device, [L])."""
        L, ep = self.num_local_experts, self.ep_size
        num_local_tokens_per_expert = routing_map.sum(dim=0)  # [E]
        self.input_splits = num_local_tokens_per_expert.view(ep, L).sum(dim=1)  # [EP] rows to each EP rank
        # [ETP, EP, E]: counts of every rank of the etp-ep grid, ETP-major.
        per_ep = all_gather_counts(num_local_tokens_per_expert, self.ep)
        global_counts = all_gather_counts(per_ep, self.etp)
        local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)
        self.num_global_tokens_per_local_expert = global_counts[:, :, local].contiguous()  # [ETP, EP, L]
        self.output_splits = self.num_global_tokens_per_local_expert[self.etp_rank].sum(dim=-1)  # [EP]
        self.output_splits_tp = self.num_global_tokens_per_local_expert.sum(dim=(1, 2))  # [ETP]
        self.tokens_per_expert = self.num_global_tokens_per_local_expert.sum(dim=(0, 1))  # [L]
        self._host = None
        return self.tokens_per_expert

    def restore_preprocess_state(self, state: Dict[str, torch.Tensor]) -> None:
        super().restore_preprocess_state(state)
        self._host = None  # the host copy belongs to the previous micro-batch: sync again

    def _maybe_dtoh_and_synchronize(self, point: str) -> None:
        """The one device-to-host copy of the split sizes, at ``cuda_sync_point``."""
        if point != self.cuda_sync_point or self._host is not None:
            return
        counts = torch.cat([self.input_splits, self.output_splits, self.output_splits_tp, self.tokens_per_expert,
                            self.num_global_tokens_per_local_expert.reshape(-1)]).tolist()
        ep, etp, L = self.ep_size, self.etp_size, self.num_local_experts
        sizes = [ep, ep, etp, L, etp * ep * L]
        out, start = [], 0
        for n in sizes:
            out.append(counts[start:start + n])
            start += n
        self._host = dict(zip(("input_splits", "output_splits", "output_splits_tp", "tokens_per_expert",
                               "num_global_tokens_per_local_expert"), out))

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_states.size(-1))
        self.routing_map = routing_map
        self.preprocess(routing_map)
        self._maybe_dtoh_and_synchronize("before_permutation_1")
        permuted, permuted_probs, self.reversed_local_input_permutation_mapping = permute(
            hidden_states, routing_map, probs, self.num_out_tokens(routing_map))
        return permuted, permuted_probs

    # -- step 2: communication ------------------------------------------------------------------------
    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self._maybe_dtoh_and_synchronize("before_ep_alltoall")
        h = self._host
        hidden_states = all_to_all(hidden_states, h["output_splits"], h["input_splits"], self.ep)
        probs = all_to_all(probs, h["output_splits"], h["input_splits"], self.ep)
        hidden_states = all_gather_v(hidden_states, h["output_splits_tp"], self.etp)
        probs = all_gather_v(probs, h["output_splits_tp"], self.etp)
        return hidden_states, probs

    # -- step 3: group the received tokens by local expert -------------------------------------------
    def dispatch_postprocess(self, hidden_states: torch.Tensor,
                             probs: torch.Tensor) -> Tuple[torch.Tensor, List[int], torch.Tensor]:
        h = self._host
        if self.num_local_experts > 1:
            sizes = h["num_global_tokens_per_local_expert"]
            hidden_states = sort_chunks_by_idxs(hidden_states, sizes, self.sort_input_by_local_experts)
            probs = sort_chunks_by_idxs(probs, sizes, self.sort_input_by_local_experts)
        return hidden_states, h["tokens_per_expert"], probs

    # -- the way back ----------------------------------------------------------------------------------
    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.num_local_experts > 1:
            sizes = self._host["num_global_tokens_per_local_expert"]
            sorted_sizes = [sizes[i] for i in self.sort_input_by_local_experts]
            hidden_states = sort_chunks_by_idxs(hidden_states, sorted_sizes, self.restore_output_by_local_experts)
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = self._host
        hidden_states = reduce_scatter_v(hidden_states, h["output_splits_tp"], self.etp)
        return all_to_all(hidden_states, h["input_splits"], h["output_splits"], self.ep)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = unpermute(hidden_states, self.reversed_local_input_permutation_mapping, self.routing_map.size(0))
        return out.view(self.hidden_shape)


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gather every token over the etp-ep group; each rank keeps its experts' tokens."""

    PREPROCESS_STATE = ("routing_map",)

    def __init__(self, num_experts: int, *, etp_ep: ParallelGroup, **kwargs):
        super().__init__(num_experts, **kwargs)
        if etp_ep.size != self.ep_size * self.etp_size:
            raise ValueError(f"etp_ep has {etp_ep.size} ranks but EP x ETP = {self.ep_size} x {self.etp_size}; "
                             "pass parallel_state.etp_ep")
        self.etp_ep = etp_ep

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        return hidden_states.reshape(-1, hidden_states.size(-1)), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        group = self.etp_ep
        # Backward reduce-scatters: a token's gradient is the sum over the ranks whose experts used it.
        hidden_states = gather_from_sequence_parallel_region(hidden_states, group, tensor_parallel_output_grad=True)
        probs = gather_from_sequence_parallel_region(probs, group, tensor_parallel_output_grad=True)
        if group.size > 1:
            routing_map = all_gather_counts(self.routing_map.to(torch.uint8), group)
            self.global_routing_map = routing_map.reshape(-1, self.num_experts).bool()
        else:
            self.global_routing_map = self.routing_map
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor,
                             probs: torch.Tensor) -> Tuple[torch.Tensor, List[int], torch.Tensor]:
        local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)
        local_map = self.global_routing_map[:, local]
        self.tokens_per_expert = local_map.sum(dim=0)  # device copy, for the grouped GEMM's offsets
        tokens_per_expert = self.tokens_per_expert.tolist()  # the host sync of this dispatcher
        permuted, permuted_probs, self.reversed_local_input_permutation_mapping = permute(
            hidden_states, local_map, probs[:, local], sum(tokens_per_expert))
        self.num_global_tokens = hidden_states.size(0)
        return permuted, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return unpermute(hidden_states, self.reversed_local_input_permutation_mapping, self.num_global_tokens)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_to_sequence_parallel_region(hidden_states, self.etp_ep)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.view(self.hidden_shape)
