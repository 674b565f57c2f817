"""``MoELayer``: the mixture-of-experts MLP of a transformer layer, split into Megatron's steps.

``forward`` is exactly::

    shared = self.shared_experts_compute(hidden)                 # optional, dense TP MLP
    probs, routing_map = self.route(hidden)                      # router (+ routing losses)
    hidden, probs = self.preprocess(hidden, probs, routing_map)  # counts, permutation, sync point
    hidden, probs = self.dispatch(hidden, probs)                 # EP all-to-all / all-gather
    output = self.routed_experts_compute(hidden, probs)          # local experts
    return self.combine(output, shared)                          # communication back, un-permute, + shared

These steps are the layer's public interface (``BaseMoELayer``): a partial
CUDA graph (``ds_megatron.cuda_graphs``) runs the first ones inside the
graph and the rest eagerly by calling them; the layer itself knows nothing
about graphs.

Groups (MoE folding): the attention around this layer runs on the dense
groups (tp, dp), the routed experts on the expert groups (etp, ep, edp) of
the same ranks.  Expert parallelism needs every rank to route distinct
tokens: under sequence parallelism each TP rank already holds its own slice
of the sequence; without it the TP ranks hold the same tokens, so the layer
routes them all (identically on every TP rank), keeps this rank's slice for
the experts and all-gathers the result (Megatron instead requires sequence
parallelism with MoE and TP).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ..parallel_state import ParallelState
from ..tensor_parallel.init import InitMethod, init_method_normal
from ..tensor_parallel.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from ..tensor_parallel.utils import divide
from ..tensor_parallel import mark_sequence_parallel
from ..transformer.mlp import ParallelMLP
from ..transformer.packed_seq_params import PackedSeqParams
from .aux_loss_tracker import MoEAuxLossTracker
from .experts import experts_class
from .router import RoutedTokens, TopKRouter
from .token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher, MoETokenDispatcher

DISPATCHER_TYPES = ("alltoall", "allgather")


class BaseMoELayer(torch.nn.Module):
    """The step interface of an MoE layer (Megatron's ``MoELayer`` split), see the module docstring.

    A subclass sets ``token_dispatcher`` (a ``MoETokenDispatcher``: its
    ``preprocess_state()`` / ``restore_preprocess_state()`` and ``cuda_sync_point``)
    and implements the steps.  After ``route`` the layer's ``aux_losses`` hold
    that forward's routing losses by name (recorded for logging);
    ``restore_route`` is route's counterpart for losses computed elsewhere (a
    replayed graph).  Subclassing is the declaration capture code checks.
    """

    token_dispatcher: MoETokenDispatcher

    def shared_experts_compute(self, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def route(self, hidden_states: torch.Tensor,
              packed_seq_params: Optional[PackedSeqParams] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def restore_route(self, aux_losses: Dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    @property
    def aux_losses(self) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                   routing_map: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def combine(self, output: torch.Tensor, shared_expert_output: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        shared_expert_output = self.shared_experts_compute(hidden_states)
        if packed_seq_params is None:
            probs, routing_map = self.route(hidden_states)
        else:
            probs, routing_map = self.route(hidden_states, packed_seq_params)
        hidden, probs = self.preprocess(hidden_states, probs, routing_map)
        hidden, probs = self.dispatch(hidden, probs)
        output = self.routed_experts_compute(hidden, probs)
        return self.combine(output, shared_expert_output)


class SharedExpertMLP(ParallelMLP):
    """The dense expert every token goes through (a TP MLP); with ``moe_shared_expert_gate`` its output is scaled
    by ``sigmoid(x . gate_weight)`` per token (Qwen2-MoE), ``gate_weight [1, h]`` replicated over TP."""

    def __init__(self, config, tp, *, init_method, output_init_method, sequence_parallel: bool):
        super().__init__(config.hidden_size, config.moe_shared_expert_intermediate_size, tp=tp,
                         init_method=init_method, output_init_method=output_init_method,
                         sequence_parallel=sequence_parallel, gated_linear_unit=config.gated_linear_unit,
                         activation=config.activation, bias=config.add_bias_linear,
                         clamp=config.activation_func_clamp_value, offset=config.glu_linear_offset)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(torch.empty(1, config.hidden_size))
            (init_method or init_method_normal(0.02))(self.gate_weight.data)
            if sequence_parallel:  # each rank gates its own tokens: the gradient is a partial sum over TP
                mark_sequence_parallel([self.gate_weight])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(hidden, self.gate_weight))
        return out


class MoELayer(BaseMoELayer):
    """``forward(hidden [s, b, h]) -> [s, b, h]``; ``aux_loss`` is the last forward's routing loss.

    ``config``: a ``GPTConfig`` (its ``num_experts``, ``moe_*`` fields, ``hidden_size``,
    ``sequence_parallel``); ``parallel_state``: the job's ``ParallelState``
    (``ParallelState.single()`` for one rank, the default).
    """

    def __init__(self, config, parallel_state: Optional[ParallelState] = None, *, layer_number: int = 0,
                 init_method: Optional[InitMethod] = None, output_init_method: Optional[InitMethod] = None,
                 aux_loss_tracker: Optional[MoEAuxLossTracker] = None):
        super().__init__()
        if config.moe_token_dispatcher_type not in DISPATCHER_TYPES:
            raise ValueError(f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r} is unknown; "
                             f"use one of {DISPATCHER_TYPES}")
        state = parallel_state if parallel_state is not None else ParallelState.single()
        self.config = config
        self.layer_number = layer_number
        self.tp = state.tp
        self.sequence_parallel = bool(config.sequence_parallel) and self.tp.size > 1
        # Without sequence parallelism every TP rank holds the same tokens: route them all, then
        # give each TP rank its slice for the experts (distinct tokens across the EP group).
        self.scatter_tokens = self.tp.size > 1 and not self.sequence_parallel

        # The router sees its part of each sequence: split over tp (sequence parallelism) and cp.  Dense
        # gradients are averaged over dp-cp, so its losses' gradients are scaled by cp (as the LM loss's are).
        seq_group = (state["tp-cp"] if self.sequence_parallel else state.cp)
        self.router = TopKRouter(
            config.hidden_size, config.num_experts, config.moe_router_topk,
            score_function=config.moe_router_score_function, pre_softmax=config.moe_router_pre_softmax,
            aux_loss_coeff=config.moe_aux_loss_coeff, z_loss_coeff=config.moe_z_loss_coeff,
            capacity_factor=config.moe_capacity_factor, drop_policy=config.moe_token_drop_policy,
            pad_to_capacity=config.moe_pad_expert_input_to_capacity,
            tp_cp=seq_group, sequence_parallel=self.sequence_parallel,
            init_method=init_method, layer_number=layer_number, aux_loss_tracker=aux_loss_tracker,
            load_balancing_type=config.moe_router_load_balancing_type,
            enable_expert_bias=config.moe_router_enable_expert_bias,
            bias_update_rate=config.moe_router_bias_update_rate, num_groups=config.moe_router_num_groups,
            group_topk=config.moe_router_group_topk, topk_scaling_factor=config.moe_router_topk_scaling_factor,
            router_dtype=config.moe_router_dtype, dp=state.dp, grad_scale=state.cp.size,
            bias=config.moe_add_bias_linear)
        experts_cls = experts_class(config.moe_grouped_gemm)
        self.experts = experts_cls(config.num_experts, config.hidden_size, config.moe_ffn_hidden_size,
                                   ep=state.ep, etp=state.etp, init_method=init_method,
                                   output_init_method=output_init_method,
                                   gated_linear_unit=config.gated_linear_unit, activation=config.activation,
                                   bias=config.moe_add_bias_linear, clamp=config.activation_func_clamp_value,
                                   offset=config.glu_linear_offset)
        dispatch_kwargs = dict(ep=state.ep, etp=state.etp, router_topk=config.moe_router_topk,
                               capacity_factor=config.moe_capacity_factor,
                               pad_to_capacity=config.moe_pad_expert_input_to_capacity)
        if config.moe_token_dispatcher_type == "alltoall":
            self.token_dispatcher = MoEAlltoAllTokenDispatcher(config.num_experts, **dispatch_kwargs)
        else:
            self.token_dispatcher = MoEAllGatherTokenDispatcher(config.num_experts, etp_ep=state.etp_ep,
                                                                **dispatch_kwargs)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpertMLP(config, self.tp, init_method=init_method,
                                                  output_init_method=output_init_method,
                                                  sequence_parallel=self.sequence_parallel)

    @property
    def aux_loss(self) -> torch.Tensor:
        """The sum of the last forward's routing losses (a differentiable scalar, 0 when off)."""
        return self.router.aux_loss

    @property
    def aux_losses(self) -> Dict[str, torch.Tensor]:
        return self.router.aux_losses

    # -- Megatron's steps ------------------------------------------------------------------------------
    def shared_experts_compute(self, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        return None if self.shared_experts is None else self.shared_experts(hidden_states)

    def route(self, hidden_states: torch.Tensor,
              packed_seq_params: Optional[PackedSeqParams] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        if packed_seq_params is None:
            return self.router(hidden_states)
        # Padding leaves the routing losses; the documents are the sequences of the sequence-wise loss.
        padding, segments = packed_seq_params.router_tokens(self.tp if self.sequence_parallel else None)
        return self.router(hidden_states, RoutedTokens(~padding, segments, packed_seq_params.segment_real_tokens))

    def restore_route(self, aux_losses: Dict[str, torch.Tensor]) -> None:
        self.router.set_aux_losses(aux_losses, next(iter(aux_losses.values()), self.router.weight))

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                   routing_map: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden_states.size(-1))
        if self.scatter_tokens:
            n = divide(tokens.size(0), self.tp.size, what="tokens per micro-batch (seq x batch)")
            start = self.tp.rank * n
            tokens = scatter_to_sequence_parallel_region(tokens, self.tp)
            probs = scatter_to_sequence_parallel_region(probs, self.tp)
            routing_map = routing_map[start:start + n]
        return self.token_dispatcher.dispatch_preprocess(tokens, routing_map, probs)

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.token_dispatcher.token_dispatch(hidden_states, probs)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        dispatched, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(
            hidden_states, probs)
        # The dispatcher's device copy of the counts spares the experts a host-to-device copy.
        expert_output = self.experts(dispatched, tokens_per_expert, permuted_probs,
                                     counts=self.token_dispatcher.tokens_per_expert)
        return self.token_dispatcher.combine_preprocess(expert_output)

    def combine(self, output: torch.Tensor, shared_expert_output: Optional[torch.Tensor]) -> torch.Tensor:
        output = self.token_dispatcher.combine_postprocess(self.token_dispatcher.token_combine(output))
        if self.scatter_tokens:
            # Downstream is replicated over TP: each rank keeps its slice of the gradient.
            output = gather_from_sequence_parallel_region(output, self.tp, tensor_parallel_output_grad=False)
        output = output.reshape(self.hidden_shape)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output
