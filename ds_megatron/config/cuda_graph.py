"""``megatron.cuda_graph``: Megatron-LM's ``cuda_graph_impl`` / ``cuda_graph_scope`` / warm-up (pure, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from ..errors import ConfigError
from .parsing import SECTION

CUDA_GRAPH_IMPLS = ("transformer_engine", "local", "none")
CUDA_GRAPH_SCOPES = ("attn", "moe_router", "moe_preprocess")


@dataclass
class CudaGraphConfig:
    """``megatron.cuda_graph``: Megatron-LM's ``cuda_graph_impl`` / ``cuda_graph_scope`` / warm-up.

    ``impl``: "transformer_engine" (TE's ``make_graphed_callables``, per-layer
    partial capture; falls back to ``torch.cuda.make_graphed_callables`` when TE
    is missing), "local" (whole layers through torch's API), "none".
    ``scope``: the parts of each layer to capture; empty means the whole layer.
    "attn" is the input LayerNorm + attention + residual; "moe_router" adds the
    pre-MLP LayerNorm and the router of MoE layers; "moe_preprocess" also the
    dispatcher's preprocess (permutation, split sizes).  Dispatch, experts and
    combine always run eagerly under a partial scope.
    ``warmup_steps``: eager steps before capture (at least 1: the forward
    pre-hooks that replay would skip are collected after the first one).
    ``required``: fail at start instead of training eagerly when graphs cannot be used.
    """

    impl: str = "none"
    scope: List[str] = field(default_factory=list)
    warmup_steps: int = 3
    required: bool = False

    def __post_init__(self):
        where = f"{SECTION}.cuda_graph"
        if self.impl not in CUDA_GRAPH_IMPLS:
            raise ConfigError(f"{where}.impl={self.impl!r} is unknown; use one of {', '.join(map(repr, CUDA_GRAPH_IMPLS))}")
        for i, s in enumerate(self.scope):
            if s not in CUDA_GRAPH_SCOPES:
                raise ConfigError(f"{where}.scope[{i}]={s!r} is unknown; use any of "
                                  f"{', '.join(map(repr, CUDA_GRAPH_SCOPES))} (an empty list captures whole layers)")
        if len(set(self.scope)) != len(self.scope):
            raise ConfigError(f"{where}.scope={self.scope!r} lists an entry twice; list each part once")
        if "moe_preprocess" in self.scope and "moe_router" not in self.scope:
            raise ConfigError(f"{where}.scope has \"moe_preprocess\" without \"moe_router\"; preprocess consumes the "
                              "router's outputs inside the same graph: add \"moe_router\" to the scope")
        if self.scope and self.impl == "local":
            raise ConfigError(f"{where}.scope={self.scope!r} with impl \"local\", which captures whole layers only; "
                              "use impl \"transformer_engine\" for partial capture or drop the scope")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise ConfigError(f"{where}.warmup_steps must be an integer >= 1 (the hooks that replay skips are collected "
                              f"after the first step), got {self.warmup_steps!r}")

    @property
    def enabled(self) -> bool:
        return self.impl != "none"

    @property
    def whole_layer(self) -> bool:
        return not self.scope

    def check_moe_settings(self, model) -> None:
        """Refuse MoE settings of ``model`` (a ``GPTConfig``, or None for a user's model, checked when its
        layers are collected) whose shapes change from step to step inside the captured part.

        Dynamic-shape settings (a graph replays fixed shapes): with
        ``moe_preprocess`` captured, token dropping without padding
        (``moe_capacity_factor`` set, ``moe_pad_expert_input_to_capacity``
        false) makes the number of permuted tokens depend on the routing.
        Without dropping it is ``tokens x topk`` (static), and with drop-and-pad
        ``capacity x experts`` (static).  Capturing whole MoE layers (empty scope)
        also puts dispatch and experts in the graph: refused, since the dispatch
        reads its token counts on the host (even where drop-and-pad makes them
        static).
        """
        if model is None or not self.enabled:
            return
        where = f"{SECTION}.model"
        num_experts, moe_capacity_factor = model.num_experts, model.moe_capacity_factor
        moe_pad_expert_input_to_capacity = model.moe_pad_expert_input_to_capacity
        moe_scopes = [s for s in self.scope if s.startswith("moe_")]
        if not num_experts:
            if moe_scopes:
                raise ConfigError(f"{SECTION}.cuda_graph.scope has {moe_scopes[0]!r} but {where}.num_experts is "
                                  "not set (no MoE layers); drop the moe_* scopes or configure MoE layers")
            return
        if model.recompute_granularity == "full" or "moe" in (model.recompute_modules or ()):
            # A rerun of a captured layer would replay the graph and hand its losses back (restore_route) again.
            raise ConfigError(f"{SECTION}.cuda_graph.impl={self.impl!r} with {where}.recompute_granularity="
                              f"{model.recompute_granularity!r} recomputing the MoE layers: recomputing captured MoE "
                              "layers is not built; set cuda_graph.impl \"none\" or recompute only other modules")
        drop_and_pad = moe_capacity_factor is not None and moe_pad_expert_input_to_capacity
        drops_unpadded = moe_capacity_factor is not None and not moe_pad_expert_input_to_capacity
        if "moe_preprocess" in self.scope and drops_unpadded:
            raise ConfigError(f"{SECTION}.cuda_graph.scope has \"moe_preprocess\" but {where}.moe_capacity_factor="
                              f"{moe_capacity_factor} drops tokens without padding, so the permuted token count "
                              f"changes every step; set {where}.moe_pad_expert_input_to_capacity true, drop the capacity "
                              "factor, or capture only up to \"moe_router\"")
        if self.whole_layer and not drop_and_pad:
            raise ConfigError(f"{SECTION}.cuda_graph captures whole layers (empty scope, impl {self.impl!r}) but the "
                              f"MoE layers' expert shapes are dynamic ({where}.moe_capacity_factor="
                              f"{moe_capacity_factor}, moe_pad_expert_input_to_capacity="
                              f"{moe_pad_expert_input_to_capacity}); use impl \"transformer_engine\" with scope "
                              "[\"attn\", \"moe_router\", \"moe_preprocess\"], or pad to capacity")
        if self.whole_layer:
            # Static shapes are not enough: the dispatch reads its split sizes on the host (the one sync of the
            # all-to-all dispatcher, Megatron's cuda_sync_point; the all-gather one reads its token counts) and the
            # grouped GEMM its offsets, which a capture refuses with a CUDA error midway through the first step.
            raise ConfigError(f"{SECTION}.cuda_graph captures whole layers (empty scope, impl {self.impl!r}) and "
                              f"{where}.num_experts={num_experts}: the MoE dispatch reads its token counts on the "
                              "host, which a captured graph cannot; use impl \"transformer_engine\" with scope "
                              "[\"attn\", \"moe_router\", \"moe_preprocess\"]")
