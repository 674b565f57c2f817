"""Mixture of experts with expert parallelism and MoE folding.

| module | concept |
| --- | --- |
| ``router`` | ``TopKRouter``: top-k scores (group-limited, expert bias), capacity dropping/padding, load-balancing and z losses; ``update_expert_bias`` |
| ``aux_loss_tracker`` | ``MoEAuxLossTracker``: the routing losses per layer, for the training log (kept on the device) |
| ``comm`` | differentiable all-to-all and uneven all-gather / reduce-scatter (built on gloo's all-to-all) |
| ``token_dispatcher`` | ``MoEAlltoAllTokenDispatcher`` (EP all-to-all + ETP gather), ``MoEAllGatherTokenDispatcher``, permute/unpermute |
| ``experts`` | ``SequentialMLP`` and ``GroupedMLP``: the local experts, ETP-split, EP/ETP-independent init |
| ``moe_layer`` | ``BaseMoELayer`` (the step interface) and ``MoELayer``: route / preprocess / dispatch / experts / combine |

Every module takes its groups explicitly, as ``ParallelGroup``s (a group of one: no parallelism).
"""
from .aux_loss_tracker import MoEAuxLossTracker
from .experts import GroupedMLP, SequentialMLP
from .moe_layer import BaseMoELayer, MoELayer
from .router import TopKRouter, expert_bias_routers, update_expert_bias
from .token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher, MoETokenDispatcher

__all__ = ["MoEAuxLossTracker", "GroupedMLP", "SequentialMLP", "BaseMoELayer", "MoELayer", "TopKRouter",
           "expert_bias_routers", "update_expert_bias",
           "MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher", "MoETokenDispatcher"]
