"""MoE partial capture: the static front of an MoE layer inside the graph, the rest eagerly after it.

A CUDA graph replays fixed shapes and cannot contain device-to-host syncs,
but an MoE layer's dispatch (all-to-all split sizes, per-expert token counts)
changes every step.  So, as in Megatron-LM, only the front of the layer is
captured: shared experts and ``route`` (scope ``moe_router``), and also
``preprocess`` (scope ``moe_preprocess``: counts and the first permutation).
The graph's outputs are what the rest of the layer needs; at replay the rest
(``dispatch``, experts, ``combine``) runs eagerly on them.

How this differs from megatron-core, on purpose: Megatron's ``MoELayer``
carries the graph machinery itself (a tensor store attribute, step decorators,
and an exception that stops its forward mid-way while capturing).  Here the
MoE layer only exposes its steps (``moe.moe_layer.BaseMoELayer``), and this
module composes them: ``moe_front`` runs the captured steps and lays their
results out as graph outputs, ``moe_rest`` hands them back (``restore_route``,
the dispatcher's ``restore_preprocess_state``) and runs the remaining steps.
All graph-only state (the output layout) lives with the graph runner.

With ``moe_preprocess`` captured the dispatcher's per-step counts are
computed inside the graph as tensors; its one device-to-host copy of them is
moved to just before the EP all-to-all (``cuda_sync_point =
"before_ep_alltoall"``), after the graph boundary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from ..moe.moe_layer import BaseMoELayer

ROUTE = "route"
PREPROCESS = "preprocess"
# Values of the dispatcher's ``cuda_sync_point`` (Megatron-LM's ``cuda_dtoh_point``).
DTOH_BEFORE_PERMUTATION = "before_permutation_1"  # Megatron's default sync point
DTOH_BEFORE_EP_ALLTOALL = "before_ep_alltoall"  # after the graph boundary when preprocess is captured


def early_return_step(scope: Iterable[str]) -> Optional[str]:
    """Where the MoE layer's captured front ends: "preprocess", "route" or None (no MoE part captured)."""
    scope = frozenset(scope)
    if "moe_preprocess" in scope:
        return PREPROCESS
    if "moe_router" in scope:
        return ROUTE
    return None


def prepare_moe_for_scope(moe_layer: BaseMoELayer, scope: Iterable[str]) -> None:
    """Point the dispatcher's device-to-host sync after the graph boundary when preprocess is captured.

    Otherwise the dispatcher keeps its own choice: preprocess runs eagerly then.
    """
    if "moe_preprocess" in frozenset(scope):
        moe_layer.token_dispatcher.cuda_sync_point = DTOH_BEFORE_EP_ALLTOALL


@dataclass(frozen=True)
class EarlyReturnLayout:
    """How a partial graph's MoE outputs are laid out, decided at capture:

    ``[hidden, probs, routing_map]`` after route, ``[permuted hidden, permuted probs]`` after preprocess;
    then the dispatcher's preprocess state (``state_names``), the routing losses
    (``loss_names``), and the shared experts' output when there is one.
    """

    return_step: str
    state_names: Tuple[str, ...]
    loss_names: Tuple[str, ...]
    has_shared_expert_output: bool

    @property
    def num_leading(self) -> int:
        return 3 if self.return_step == ROUTE else 2

    @property
    def num_outputs(self) -> int:
        return (self.num_leading + len(self.state_names) + len(self.loss_names)
                + int(self.has_shared_expert_output))


def moe_front(moe: BaseMoELayer, hidden: torch.Tensor, return_step: str
              ) -> Tuple[List[torch.Tensor], EarlyReturnLayout]:
    """The captured steps of ``moe`` on ``hidden``: (the graph's outputs, their layout)."""
    shared = moe.shared_experts_compute(hidden)
    probs, routing_map = moe.route(hidden)
    losses = dict(moe.aux_losses)
    if return_step == ROUTE:
        outputs, state = [hidden, probs, routing_map], {}
    else:
        permuted, permuted_probs = moe.preprocess(hidden, probs, routing_map)
        outputs = [permuted, permuted_probs]
        state = {k: v for k, v in moe.token_dispatcher.preprocess_state().items() if isinstance(v, torch.Tensor)}
    outputs += [*state.values(), *losses.values()]
    if shared is not None:
        outputs.append(shared)
    return outputs, EarlyReturnLayout(return_step, tuple(state), tuple(losses), shared is not None)


def moe_rest(moe: BaseMoELayer, outputs: Sequence[torch.Tensor], layout: EarlyReturnLayout) -> torch.Tensor:
    """The replay side: hand a partial graph's outputs back to ``moe`` and run its remaining steps eagerly."""
    if len(outputs) != layout.num_outputs:
        raise RuntimeError(f"the partial CUDA graph returned {len(outputs)} tensors but its capture laid out "
                           f"{layout.num_outputs}; recapture (the MoE layer's configuration changed)")
    pos = layout.num_leading
    state = dict(zip(layout.state_names, outputs[pos:pos + len(layout.state_names)]))
    pos += len(layout.state_names)
    losses = dict(zip(layout.loss_names, outputs[pos:pos + len(layout.loss_names)]))
    shared = outputs[-1] if layout.has_shared_expert_output else None
    moe.restore_route(losses)
    if layout.return_step == ROUTE:
        hidden, probs = moe.preprocess(*outputs[:3])
    else:
        moe.token_dispatcher.restore_preprocess_state(state)
        hidden, probs = outputs[0], outputs[1]
    hidden, probs = moe.dispatch(hidden, probs)
    return moe.combine(moe.routed_experts_compute(hidden, probs), shared)


__all__ = ["DTOH_BEFORE_EP_ALLTOALL", "DTOH_BEFORE_PERMUTATION", "EarlyReturnLayout", "PREPROCESS", "ROUTE",
           "early_return_step", "moe_front", "moe_rest", "prepare_moe_for_scope"]
