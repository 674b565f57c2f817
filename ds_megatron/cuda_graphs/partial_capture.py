"""MoE partial capture: stop an MoE layer after ``route`` or ``preprocess`` while capturing, resume there at replay.

A CUDA graph replays fixed shapes and cannot contain device-to-host syncs,
but an MoE layer's dispatch (all-to-all split sizes, per-expert token counts)
changes every step.  Megatron-LM therefore captures only the static front of
the layer and runs the rest eagerly, with two small mechanisms kept here:

* **Signal** (capture): ``MoECudaGraphPartialCaptureSignal`` is raised right
  after ``route`` (scope ``moe_router``) or ``preprocess`` (scope
  ``moe_preprocess``) while inside the captured region.  The MoE layer's
  forward catches it and returns ``get_early_return_outputs(...)``: the
  tensors the rest of the layer needs, which become the graph's outputs.
* **Tensor store** (replay): the layer's replay path puts those graph outputs
  into the MoE layer's ``MoECudaGraphTensorStore`` and calls the MoE layer
  again; the decorated ``route`` / ``preprocess`` / ``shared_experts_compute``
  read the store instead of computing, so dispatch, experts and combine run
  eagerly on the replayed tensors.

With ``moe_preprocess`` captured the dispatcher's per-step results
(``tokens_per_expert``, split sizes, ...) are computed inside the graph as
tensors; the dispatcher must defer its device-to-host copy of them to just
before the EP all-to-all (``cuda_sync_point = "before_ep_alltoall"``), after
the graph boundary (the dispatcher's ``cuda_sync_point``).  The tensor attributes it names in ``cudagraph_attrs``
are filtered at capture time (``valid_cudagraph_attrs``: those that exist and
are tensors) and restored onto it at replay.

The MoE layer implements ``PartialCaptureMoE`` (see there); nothing here
depends on how it routes or dispatches.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch

ROUTE = "route"
PREPROCESS = "preprocess"
SHARED_EXPERTS = "shared_experts_compute"
# Values of the dispatcher's ``cuda_sync_point`` (Megatron-LM's ``cuda_dtoh_point``).
DTOH_BEFORE_PERMUTATION = "before_permutation_1"  # Megatron's default sync point
DTOH_BEFORE_EP_ALLTOALL = "before_ep_alltoall"  # after the graph boundary when preprocess is captured

_state = threading.local()


def is_graph_capturing() -> bool:
    """True while running the part of a layer that a graph captures (warm-up and capture alike)."""
    return getattr(_state, "scope", None) is not None


def current_capture_scope() -> FrozenSet[str]:
    """The ``cuda_graph.scope`` of the region being captured (empty outside one)."""
    return getattr(_state, "scope", None) or frozenset()


@contextlib.contextmanager
def captured_region(scope: Iterable[str]):
    """Mark the code inside as the captured part of a layer with this scope (nests; restores on exit)."""
    previous = getattr(_state, "scope", None)
    _state.scope = frozenset(scope)
    try:
        yield
    finally:
        _state.scope = previous


def early_return_step(scope: Iterable[str]) -> Optional[str]:
    """Where the MoE layer stops inside the graph: "preprocess", "route" or None (no MoE part captured)."""
    scope = frozenset(scope)
    if "moe_preprocess" in scope:
        return PREPROCESS
    if "moe_router" in scope:
        return ROUTE
    return None


def cuda_dtoh_point_for_scope(scope: Iterable[str]) -> str:
    """The dispatcher's device-to-host sync point: after the graph when preprocess is captured."""
    return DTOH_BEFORE_EP_ALLTOALL if "moe_preprocess" in frozenset(scope) else DTOH_BEFORE_PERMUTATION


def _get_hier_attr(obj, name: str):
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _set_hier_attr(obj, name: str, value) -> None:
    *parents, last = name.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def valid_cudagraph_attrs(owner, device: Optional[torch.device] = None) -> List[str]:
    """The names in ``owner.cudagraph_attrs`` (dotted allowed) that exist now and are tensors (on ``device``).

    Decided once, at capture, and kept on the owner as ``valid_cudagraph_attrs``
    so the graph's outputs have the same layout at every replay.  ``device``
    filters out host placeholders (e.g. a constant zero aux loss on the CPU).
    """
    names = []
    for name in getattr(owner, "cudagraph_attrs", ()):
        value = _get_hier_attr(owner, name)
        if isinstance(value, torch.Tensor) and (device is None or value.device == device):
            names.append(name)
    owner.valid_cudagraph_attrs = names
    return names


@dataclass(frozen=True)
class EarlyReturnLayout:
    """How a partial graph's outputs are laid out: the step, the dispatcher attrs, a shared-expert output."""

    return_step: str
    attr_names: Tuple[str, ...]
    has_shared_expert_output: bool
    preprocess_returns_residual: bool = True
    layer_attr_names: Tuple[str, ...] = ()

    @property
    def num_outputs(self) -> int:
        return 3 + len(self.attr_names) + len(self.layer_attr_names) + int(self.has_shared_expert_output)


class MoECudaGraphPartialCaptureSignal(Exception):
    """Raised inside an MoE layer during capture to return early with the tensors the rest of the layer needs.

    ``return_step`` is "route" (kwargs ``probs``, ``routing_map``) or
    "preprocess" (kwargs ``hidden_states``, ``probs`` and ``residual``, None
    when ``preprocess`` returns only the permuted states and probs).
    """

    def __init__(self, moe_layer, return_step: str, **kwargs):
        super().__init__(f"partial CUDA graph capture returns after {return_step}")
        self.moe_layer = moe_layer
        self.return_step = return_step
        self.kwargs = kwargs

    def get_early_return_outputs(self, hidden_states: torch.Tensor,
                                 shared_expert_output: Optional[torch.Tensor]) -> List[torch.Tensor]:
        """The graph's outputs: [hidden_states, probs, routing_map | residual, *dispatcher attrs, *layer attrs,
        shared output?].

        ``hidden_states`` is the MoE layer's input: returned after "route", and
        the residual after "preprocess" when preprocess returned none (the two
        are the same tensor in Megatron-LM's MoELayer).
        """
        if self.return_step == ROUTE:
            outputs = [hidden_states, self.kwargs["probs"], self.kwargs["routing_map"]]
            attr_names: Sequence[str] = ()
        else:
            residual = self.kwargs["residual"]
            outputs = [self.kwargs["hidden_states"], self.kwargs["probs"],
                       hidden_states if residual is None else residual]
            dispatcher = self.moe_layer.token_dispatcher
            attr_names = valid_cudagraph_attrs(dispatcher)
            outputs.extend(_get_hier_attr(dispatcher, n) for n in attr_names)
        # The MoE layer's own per-step tensors (e.g. "router.aux_loss", added to the loss outside the
        # layer): graph outputs too, or replay would leave the capture's tensor, cut from autograd.
        layer_attr_names = valid_cudagraph_attrs(self.moe_layer, device=hidden_states.device)
        outputs.extend(_get_hier_attr(self.moe_layer, n) for n in layer_attr_names)
        if shared_expert_output is not None:
            outputs.append(shared_expert_output)
        self.layout = EarlyReturnLayout(self.return_step, tuple(attr_names), shared_expert_output is not None,
                                        preprocess_returns_residual=self.kwargs.get("residual") is not None,
                                        layer_attr_names=tuple(layer_attr_names))
        self.moe_layer.cudagraph_early_return_layout = self.layout
        return outputs


class MoECudaGraphTensorStore:
    """The replayed tensors an MoE layer reads instead of recomputing route / preprocess / shared experts."""

    _FIELDS = ("hidden_states", "probs", "routing_map", "residual", "shared_expert_output")

    def __init__(self):
        self.return_step: Optional[str] = None
        self.preprocess_returns_residual = True
        self.clear()

    def is_empty(self) -> bool:
        return self.return_step is None

    def set(self, return_step: str, preprocess_returns_residual: bool = True, **tensors) -> None:
        unknown = set(tensors) - set(self._FIELDS)
        if unknown:
            raise TypeError(f"MoECudaGraphTensorStore.set got unknown fields {sorted(unknown)}; known: {self._FIELDS}")
        self.return_step = return_step
        self.preprocess_returns_residual = preprocess_returns_residual
        for name, value in tensors.items():
            setattr(self, name, value)

    def clear(self) -> None:
        self.return_step = None
        for name in self._FIELDS:
            setattr(self, name, None)


class PartialCaptureMoE(torch.nn.Module):
    """Base class of an MoE layer whose front part can be captured (Megatron-LM's ``MoELayer`` shape).

    An explicit interface (subclass it), not a structural check, which would
    depend on the Python version.  A subclass provides:

    * ``cudagraph_tensor_store``: a ``MoECudaGraphTensorStore``;
    * ``token_dispatcher`` with ``cudagraph_attrs`` (names of tensor attributes
      that ``preprocess`` sets, dotted for nested ones) and ``cuda_sync_point``
      (where it copies split sizes to the host; set here from the scope).  If
      it caches host copies of those attributes it defines
      ``restore_cudagraph_attrs(attrs: dict)``, called at replay instead of
      ``setattr``, to set them and drop the stale host copy;
    * optionally ``cudagraph_attrs`` on the layer itself: tensor attributes its
      captured steps set and code outside the layer reads (``"router.aux_loss"``);
    * ``route``, ``preprocess`` (returning ``(hidden, probs)`` or
      ``(hidden, probs, residual)``) and ``shared_experts_compute`` decorated
      with ``maybe_skip_or_early_return_by_cudagraph``;
    * a ``forward(hidden_states)`` that calls shared_experts_compute, route and
      preprocess inside ``try`` and, on ``MoECudaGraphPartialCaptureSignal`` as
      ``e``, returns ``e.get_early_return_outputs(hidden_states, shared_expert_output)``.
    """

    cudagraph_tensor_store: MoECudaGraphTensorStore
    token_dispatcher: Any

    def route(self, hidden_states: torch.Tensor):
        raise NotImplementedError

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        raise NotImplementedError

    def shared_experts_compute(self, hidden_states: torch.Tensor):
        raise NotImplementedError


def maybe_skip_or_early_return_by_cudagraph(step_condition: str) -> Callable:
    """Decorate ``route`` / ``preprocess`` / ``shared_experts_compute`` of a ``PartialCaptureMoE``.

    Outside graphs (not capturing, empty store) the method runs as written.
    Inside the captured region it runs and, at the scope's last step, raises
    the signal carrying its results.  At replay (store filled) it returns the
    stored tensors instead of computing: route and preprocess are skipped when
    the graph covered them, shared experts when the graph computed them.
    """
    if step_condition not in (ROUTE, PREPROCESS, SHARED_EXPERTS):
        raise ValueError(f"step_condition={step_condition!r} is unknown; use {ROUTE!r}, {PREPROCESS!r} or "
                         f"{SHARED_EXPERTS!r}")

    def decorator(func):
        @functools.wraps(func)
        def wrapped(moe_layer, *args, **kwargs):
            store = moe_layer.cudagraph_tensor_store
            capturing = is_graph_capturing()
            if not capturing and store.is_empty():
                return func(moe_layer, *args, **kwargs)
            if capturing:
                result = func(moe_layer, *args, **kwargs)
                stop = early_return_step(current_capture_scope())
                if step_condition == ROUTE and stop == ROUTE:
                    probs, routing_map = result
                    raise MoECudaGraphPartialCaptureSignal(moe_layer, ROUTE, probs=probs, routing_map=routing_map)
                if step_condition == PREPROCESS and stop == PREPROCESS:
                    hidden_states, probs, residual = result if len(result) == 3 else (*result, None)
                    raise MoECudaGraphPartialCaptureSignal(moe_layer, PREPROCESS, hidden_states=hidden_states,
                                                           probs=probs, residual=residual)
                return result
            # Replay: the graph already produced what this step would compute.
            if step_condition == ROUTE:
                return store.probs, store.routing_map
            if step_condition == PREPROCESS:
                if store.return_step == PREPROCESS:
                    if store.preprocess_returns_residual:
                        return store.hidden_states, store.probs, store.residual
                    return store.hidden_states, store.probs
                return func(moe_layer, *args, **kwargs)
            if store.shared_expert_output is not None:
                return store.shared_expert_output
            return func(moe_layer, *args, **kwargs)

        return wrapped

    return decorator


def prepare_moe_for_scope(moe_layer, scope: Iterable[str]) -> None:
    """Point the dispatcher's device-to-host sync after the graph boundary when preprocess is captured.

    Otherwise the dispatcher keeps its own choice: preprocess runs eagerly then.
    """
    if "moe_preprocess" in frozenset(scope):
        moe_layer.token_dispatcher.cuda_sync_point = DTOH_BEFORE_EP_ALLTOALL


def fill_store_from_graph_outputs(moe_layer, layout: EarlyReturnLayout, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Replay side: put a partial graph's outputs into the store and onto the dispatcher.

    Returns the tensor to call the MoE layer with (its input after "route", the
    residual after "preprocess", which is the same tensor in eager mode).
    """
    if len(outputs) != layout.num_outputs:
        raise RuntimeError(f"the partial CUDA graph returned {len(outputs)} tensors but its capture laid out "
                           f"{layout.num_outputs}; recapture (the MoE layer's configuration changed)")
    first, probs, third = outputs[:3]
    dispatcher = moe_layer.token_dispatcher
    attrs = {name: outputs[3 + i] for i, name in enumerate(layout.attr_names)}
    start = 3 + len(layout.attr_names)
    for i, name in enumerate(layout.layer_attr_names):
        _set_hier_attr(moe_layer, name, outputs[start + i])
    restore = getattr(dispatcher, "restore_cudagraph_attrs", None)
    if restore is not None:
        restore(attrs)
    else:
        for name, value in attrs.items():
            _set_hier_attr(dispatcher, name, value)
    shared = outputs[-1] if layout.has_shared_expert_output else None
    if layout.return_step == ROUTE:
        moe_layer.cudagraph_tensor_store.set(ROUTE, hidden_states=first, probs=probs, routing_map=third,
                                             shared_expert_output=shared)
        return first
    moe_layer.cudagraph_tensor_store.set(PREPROCESS, layout.preprocess_returns_residual, hidden_states=first,
                                         probs=probs, residual=third, shared_expert_output=shared)
    return third


__all__ = ["DTOH_BEFORE_EP_ALLTOALL", "DTOH_BEFORE_PERMUTATION", "EarlyReturnLayout", "MoECudaGraphPartialCaptureSignal",
           "MoECudaGraphTensorStore", "PREPROCESS", "PartialCaptureMoE", "ROUTE", "SHARED_EXPERTS", "captured_region",
           "cuda_dtoh_point_for_scope", "current_capture_scope", "early_return_step", "fill_store_from_graph_outputs",
           "is_graph_capturing", "maybe_skip_or_early_return_by_cudagraph", "prepare_moe_for_scope",
           "valid_cudagraph_attrs"]
