"""Mixture of experts with expert parallelism and MoE folding.

| module | concept |
| --- | --- |
| ``router`` | ``TopKRouter``: top-k scores, capacity dropping/padding, load-balancing and z losses |
| ``aux_loss_tracker`` | ``MoEAuxLossTracker``: the routing losses per layer, for the training log |
| ``comm`` | differentiable all-to-all and uneven all-gather / reduce-scatter (built on gloo's all-to-all) |
| ``token_dispatcher`` | ``MoEAlltoAllTokenDispatcher`` (EP all-to-all + ETP gather), ``MoEAllGatherTokenDispatcher``, permute/unpermute |
| ``experts`` | ``SequentialMLP`` and ``GroupedMLP``: the local experts, ETP-split, EP/ETP-independent init |
| ``moe_layer`` | ``MoELayer``: route / preprocess / dispatch / routed_experts_compute / combine / shared_experts_compute |
| ``deepspeed_integration`` | handing our expert groups to DeepSpeed; expert checkpoints by expert rank |

Every module takes its process groups explicitly; ``None`` means a group of one.
"""
from .aux_loss_tracker import MoEAuxLossTracker
from .experts import GroupedMLP, SequentialMLP
from .moe_layer import MoELayer
from .router import TopKRouter
from .token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

__all__ = ["MoEAuxLossTracker", "GroupedMLP", "SequentialMLP", "MoELayer", "TopKRouter",
           "MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher"]
