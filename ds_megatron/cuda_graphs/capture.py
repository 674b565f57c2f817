"""Per-layer partial CUDA graphs: collect graphable layers, capture their static part, replay by micro-batch.

Megatron-LM's ``TECudaGraphHelper`` in one small form for layers that
subclass ``ds_megatron.transformer.GraphableLayer`` (a forward split into
attention / pre-MLP / post-MLP, Megatron's ``GraphableMegatronModule``):

1. **Collect** the layers whose scope has something to capture: every layer
   for "attn" or a whole-layer scope, MoE layers (``layer.mlp`` is a
   ``BaseMoELayer``) for "moe_router" / "moe_preprocess".
2. **Static inputs**: one ``[s, b, h]`` buffer per layer input as seen in the
   eager warm-up steps; with a pipeline order, only as many buffers as the
   buffer-reuse plan needs (``schedule.plan_cuda_graphs``), shared across
   micro-batches.
3. **Capture** through a ``Capturer`` (TE's ``make_graphed_callables`` with
   ``_order`` and ``_reuse_graph_input_output_buffers``, torch's, or eager for
   tests) the ``CapturedPart`` of each layer: attention, and for MoE layers
   the pre-MLP norm plus route (and preprocess), stopping at the
   partial-capture signal.  The parts' fp8 state (the delayed recipe's, and
   ``fp8_param_gather``'s weights' ``main_grad``) is put back after it: what
   the capturer's warm-up passes recorded is not the step's.
4. **Assign** one graph callable per micro-batch to each layer (one in all
   without PP) and **replay** by ``current_microbatch`` modulo their number;
   the layer's remaining part runs eagerly on the graph's outputs (for MoE
   layers through the tensor store).
5. **Manual hooks**: replay does not call the captured submodules, so their
   forward pre-hooks (for example a distributed optimizer's param all-gather
   wait) would be skipped.  They are found at capture (after the eager
   warm-up steps), kept out of the capture, and called before each replay.
   Likewise the flag a captured fp8 weight's backward sets for its gradient
   buffer (``fp8_param_gather``) is set by the replay's caller.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config.cuda_graph import CudaGraphConfig
from ..errors import ConfigError
from ..fp8.param import is_fp8_param
from ..moe.moe_layer import BaseMoELayer
from ..tensor_parallel.layers import fp8_states
from ..transformer.layer import GraphableLayer
from .backends import Capturer
from .partial_capture import EarlyReturnLayout, early_return_step, moe_front, moe_rest, prepare_moe_for_scope
from .schedule import CudaGraphPlan, plan_cuda_graphs

logger = logging.getLogger("ds_megatron.cuda_graphs")


def capture_stream() -> "torch.cuda.Stream":
    """The side stream ``torch.cuda.graph`` captures on when given none (torch's and TE's
    ``make_graphed_callables`` both capture there); created as torch creates it."""
    if getattr(torch.cuda.graph, "default_capture_stream", None) is None:
        torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    return torch.cuda.graph.default_capture_stream


def is_moe_layer(layer) -> bool:
    return isinstance(getattr(layer, "mlp", None), BaseMoELayer)


def layer_is_graphable(layer, scope: Sequence[str]) -> bool:
    """Megatron's ``_layer_is_graphable``: the scope captures something of this layer."""
    if not isinstance(layer, GraphableLayer):
        return False
    if not scope or "attn" in scope:
        return True
    return early_return_step(scope) is not None and is_moe_layer(layer)


@dataclass(frozen=True)
class InputSpec:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "InputSpec":
        return cls(tuple(t.shape), t.dtype, t.device)

    def static_buffer(self) -> torch.Tensor:
        # Zeros, not empty: warm-up runs the router on them and NaN garbage would reach top-k.
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device, requires_grad=True)


class CapturedPart(torch.nn.Module):
    """The part of one layer a graph captures, as the module handed to the capturer.

    It owns the layer as a submodule, so its parameters (the graph's input
    surface) are the layer's.  Its input is the layer's input, or the
    post-attention hidden states when attention is outside the scope (then it
    runs eagerly in front of the graph).  Outputs, as a tuple: the
    post-attention hidden states when attention is captured, then the MoE
    early-return outputs when an MoE step is.
    """

    def __init__(self, layer: torch.nn.Module, eager_forward: Callable, scope: Sequence[str]):
        super().__init__()
        self.layer = layer
        self._eager_forward = eager_forward
        self.scope = tuple(scope)
        self.whole_layer = not scope
        self.captures_attention = self.whole_layer or "attn" in scope
        self.moe_step = early_return_step(scope) if (not self.whole_layer and is_moe_layer(layer)) else None
        self.layout: Optional[EarlyReturnLayout] = None

    def forward(self, hidden: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if self.whole_layer:
            return (self._eager_forward(hidden),)
        outputs: List[torch.Tensor] = []
        if self.captures_attention:
            hidden = self.layer.forward_attention(hidden)
            outputs.append(hidden)
        if self.moe_step is not None:
            front, self.layout = moe_front(self.layer.mlp, self.layer.pre_mlp(hidden), self.moe_step)
            outputs.extend(front)
        return tuple(outputs)


class LayerGraphRunner:
    """One layer's graphs: installed as the layer's ``forward``; eager until graphs are assigned, then replays."""

    def __init__(self, layer: torch.nn.Module, scope: Sequence[str]):
        self.layer = layer
        self.eager_forward = layer.forward
        self.part = CapturedPart(layer, self.eager_forward, scope)
        self.cuda_graphs: List[Callable] = []
        self.cuda_graph_manual_hooks: List[Tuple[Callable, tuple]] = []
        self.fp8_weights: List[torch.nn.Parameter] = []  # fp8_param_gather's weights the graphs use
        self.current_microbatch = 0
        self.input_spec: Optional[InputSpec] = None
        self.stale = False  # an input no longer matches the captured shapes
        layer.forward = self.forward  # instance attribute: nn.Module.__call__ finds it first

    def uninstall(self) -> None:
        if self.layer.__dict__.get("forward") == self.forward:
            del self.layer.forward

    def _replayable(self, args, kwargs) -> bool:
        return (bool(self.cuda_graphs) and not args and not kwargs and self.layer.training
                and torch.is_grad_enabled())

    def forward(self, hidden: torch.Tensor, *args, **kwargs):
        args, kwargs = _without_packed_seq_params(args, kwargs)
        if not (isinstance(hidden, torch.Tensor) and hidden.is_cuda and torch.is_grad_enabled()):
            return self._forward(hidden, *args, **kwargs)
        # On a GPU the layer runs (eagerly, then replayed) on the stream graphs are captured on.
        # Autograd creates a parameter's AccumulateGrad node at its first use, keeps it while any
        # graph reaching it is alive, and remembers the stream it was made on.  The caller's last
        # loss keeps the previous step's graph alive (``loss = engine(batch)`` holds the old one
        # until the forward returns), so at capture the parameters still have those nodes; were
        # they of the default stream, the captured backward would make the default stream wait on
        # the capture stream, which invalidates the capture.  Made on the capture stream from the
        # first step on, they match it (and later steps need no cross-stream wait per parameter).
        stream, caller = capture_stream(), torch.cuda.current_stream()
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            out = self._forward(hidden, *args, **kwargs)
        caller.wait_stream(stream)
        if isinstance(out, torch.Tensor):
            out.record_stream(caller)  # used on the caller's stream: not reusable before that work is done
        return out

    def _forward(self, hidden, *args, **kwargs):
        if not self._replayable(args, kwargs):
            if not args and not kwargs and isinstance(hidden, torch.Tensor) and self.layer.training:
                self.input_spec = InputSpec.of(hidden)
            return self.eager_forward(hidden, *args, **kwargs)
        if InputSpec.of(hidden) != self.input_spec:
            # Replaying a graph captured for other shapes would be wrong: run eagerly and let
            # the engine hook recapture.
            self.stale = True
            return self.eager_forward(hidden)
        return self.replay(hidden)

    def replay(self, hidden: torch.Tensor) -> torch.Tensor:
        """Megatron's ``_te_cuda_graph_replay``: manual hooks, graph of this micro-batch, eager remainder."""
        for hook, hook_args in self.cuda_graph_manual_hooks:
            hook(*hook_args)
        part = self.part
        layer = self.layer
        if not part.whole_layer and not part.captures_attention:
            hidden = layer.forward_attention(hidden)  # outside the scope: eager, in front of the graph
        graph = self.cuda_graphs[self.current_microbatch % len(self.cuda_graphs)]
        outputs = graph(hidden)
        if self.fp8_weights:
            outputs = _MainGradAdded.apply(self.fp8_weights, *outputs)
        if part.whole_layer:
            return outputs[0]
        pos = 0
        if part.captures_attention:
            hidden, pos = outputs[0], 1
        if part.moe_step is None:
            return layer.post_mlp(hidden, layer.mlp(layer.pre_mlp(hidden)))
        # The MoE layer is not called as a module here (its steps are): its own pre-hooks run by hand.
        for hook, hook_args in _forward_pre_hooks(layer.mlp):
            hook(*hook_args)
        return layer.post_mlp(hidden, moe_rest(layer.mlp, outputs[pos:], part.layout))

    def drop_graphs(self) -> None:
        self.cuda_graphs = []
        self.cuda_graph_manual_hooks = []
        self.fp8_weights = []
        self.stale = False


def _without_packed_seq_params(args, kwargs):
    """A layer's call without its ``packed_seq_params`` when that is None (a batch of one document per row); a
    packed micro-batch is refused: its attention runs one kernel per document, with boundaries read on the host,
    which a graph captured once cannot replay."""
    if "packed_seq_params" in kwargs:
        kwargs = dict(kwargs)
        packed = kwargs.pop("packed_seq_params")
    else:
        packed, args = (args[0], args[1:]) if args else (None, args)
    if packed is not None:
        raise ValueError("CUDA graphs replay the shapes they captured, but this micro-batch packs several documents "
                         "per row (position_ids / cu_seqlens / padding_mask), whose attention depends on the "
                         "boundaries: set megatron.cuda_graph.impl to \"none\" to train on packed sequences")
    return args, kwargs


def _forward_pre_hooks(module: torch.nn.Module) -> List[Tuple[Callable, tuple]]:
    hooks = []
    for hook_id, hook in module._forward_pre_hooks.items():
        # Replay has no inputs to give: hooks get empty args, and their return values are ignored.
        args = (module, (), {}) if hook_id in module._forward_pre_hooks_with_kwargs else (module, ())
        hooks.append((hook, args))
    return hooks


class _FP8StateKept:
    """What fp8 keeps across steps in the captured parts, put back after the capture: the delayed recipe's state,
    and ``fp8_param_gather``'s weights' ``main_grad`` and readiness flag.  The capturer's warm-up runs each part
    forward and backward on the static buffers with made-up output gradients (torch's and Transformer Engine's
    ``make_graphed_callables``: uninitialized ones): the passes fold their amaxes into the step's and add their fp8
    weight gradients to ``main_grad``; the step must hold its own micro-batches' only.  Put back in place: the
    graphs read and write these storages."""

    def __init__(self, parts: Sequence[torch.nn.Module], fp8_weights: Sequence[torch.nn.Parameter]):
        tensors = {id(t): t for part in parts for state in fp8_states(part) for t in state.state_tensors()}
        tensors.update({id(p.main_grad): p.main_grad for p in fp8_weights if hasattr(p, "main_grad")})
        self._saved = [(t, t.clone()) for t in tensors.values()]
        self._flags = [(p, getattr(p, "grad_added_to_main_grad", False)) for p in fp8_weights]

    @torch.no_grad()
    def restore(self) -> None:
        if any(t.is_cuda for t, _ in self._saved):
            torch.cuda.synchronize()  # the warm-up ran on the capturer's own stream
        for tensor, value in self._saved:
            tensor.copy_(value)
        for param, flag in self._flags:
            param.grad_added_to_main_grad = flag


class _MainGradAdded(torch.autograd.Function):
    """On a replayed graph's outputs: the captured backward adds each fp8 weight's gradient (``fp8_param_gather``)
    to its ``main_grad``, but the Python that tells the gradient buffer so (``grad_added_to_main_grad``, read by its
    hook once the weight's gradient is in) does not run in a replay; this backward runs just before the graph's and
    says it."""

    @staticmethod
    def forward(ctx, fp8_weights, *outputs):
        ctx.fp8_weights = fp8_weights
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        for param in ctx.fp8_weights:
            param.grad_added_to_main_grad = True
        return (None, *grads)


class _ModulesCalled:
    """Records which modules' ``__call__`` ran (a global forward pre-hook), to find the captured submodules."""

    def __enter__(self):
        self.modules: List[torch.nn.Module] = []
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, _args: self.modules.append(m))
        return self

    def __exit__(self, *exc):
        self._handle.remove()


class CudaGraphHelper:
    """Megatron-LM's ``TECudaGraphHelper`` for the graphable layers of one model (one pipeline rank).

    ``layers``: the model's transformer layers, chunk after chunk when
    ``num_layers_per_chunk`` (virtual pipeline) is given.  Pipeline arguments
    default to no PP: one graph pair per layer for all micro-batches.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], config: CudaGraphConfig, capturer: Capturer, *,
                 num_microbatches: int = 1, num_layers_per_chunk: Optional[Sequence[int]] = None,
                 pipeline_parallel_size: int = 1, pipeline_parallel_rank: int = 0,
                 microbatch_group_size_per_vp_stage: Optional[int] = None, num_warmup_iters: int = 3):
        self.config = config
        self.capturer = capturer
        self.num_warmup_iters = num_warmup_iters
        self.scope = tuple(config.scope)
        graphable = [layer for layer in layers if layer_is_graphable(layer, self.scope)]
        if not graphable:
            raise ConfigError(f"megatron.cuda_graph.scope={list(self.scope)!r} captures nothing in this model "
                              f"({len(layers)} layers; moe_* scopes need MoE layers whose mlp implements "
                              "BaseMoELayer); fix the scope or set impl to \"none\"")
        if early_return_step(self.scope) and not any(is_moe_layer(layer) for layer in graphable):
            raise ConfigError(f"megatron.cuda_graph.scope={list(self.scope)!r} names MoE steps but no layer has an "
                              "MoE mlp; drop the moe_* scopes or build the model with MoE layers")
        for layer in graphable:
            _check_graph_safe_rng(layer, self.scope)
        chunks = list(num_layers_per_chunk) if num_layers_per_chunk is not None else [len(graphable)]
        if sum(chunks) != len(graphable):
            raise ValueError(f"num_layers_per_chunk={chunks} sums to {sum(chunks)} but {len(graphable)} layers are "
                             "graphable; count graphable layers per local model chunk")
        self.plan: CudaGraphPlan = plan_cuda_graphs(
            chunks, num_microbatches, pipeline_parallel_size=pipeline_parallel_size,
            pipeline_parallel_rank=pipeline_parallel_rank,
            microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage)
        self.runners = [LayerGraphRunner(layer, self.scope) for layer in graphable]
        for runner in self.runners:
            if runner.part.moe_step is not None:
                prepare_moe_for_scope(runner.layer.mlp, self.scope)

    @property
    def captured(self) -> bool:
        return bool(self.runners[0].cuda_graphs)

    @property
    def stale(self) -> bool:
        return any(r.stale for r in self.runners)

    def set_current_microbatch(self, index: int) -> None:
        for runner in self.runners:
            runner.current_microbatch = index

    def _sample_args(self) -> List[Tuple[torch.Tensor, ...]]:
        """Static inputs in the capturer's index order, shared as the buffer-reuse plan says."""
        missing = [i for i, r in enumerate(self.runners) if r.input_spec is None]
        if missing:
            raise RuntimeError(f"graphable layers {missing} have not run eagerly in training mode yet; run at least "
                               "one training step (megatron.cuda_graph.warmup_steps >= 1) before capturing")
        plan = self.plan
        if plan.order is None:
            return [(r.input_spec.static_buffer(),) for r in self.runners]
        layer_of_index = []
        start = 0
        for n in plan.num_layers_per_chunk:
            for _ in range(plan.num_microbatches):
                layer_of_index.extend(range(start, start + n))
            start += n
        buffers: Dict[int, torch.Tensor] = {}
        sample_args = []
        for idx, layer in enumerate(layer_of_index):
            buf = plan.sample_buffer[idx]
            if buf not in buffers:
                buffers[buf] = self.runners[layer].input_spec.static_buffer()
            sample_args.append((buffers[buf],))
        return sample_args

    def create_cudagraphs(self) -> None:
        """Capture every graphable layer and assign the graphs (Megatron's ``create_cudagraphs``)."""
        sample_args = self._sample_args()
        parts = tuple(r.part for r in self.runners)
        hooked = self._find_manual_hooks(sample_args)
        stashed = [(m, dict(m._forward_pre_hooks)) for m in hooked]
        for module, _ in stashed:
            # Run once eagerly (outside the graph), then keep them out of the capture.
            for hook, hook_args in _forward_pre_hooks(module):
                hook(*hook_args)
            module._forward_pre_hooks.clear()
        kept = _FP8StateKept(parts, [p for r in self.runners for p in r.fp8_weights])
        try:
            graphs = self.capturer(parts, sample_args, order=self.plan.order,
                                   num_layers_per_chunk=self.plan.num_layers_per_chunk,
                                   num_warmup_iters=self.num_warmup_iters, reuse_buffers=self.plan.order is not None)
        finally:
            kept.restore()
            for module, hooks in stashed:
                module._forward_pre_hooks.update(hooks)
        self._assign(graphs)
        logger.info("captured CUDA graphs for %d layers (%s, scope %s): %d graphs, %d static input buffers",
                    len(self.runners), self.capturer.name, list(self.scope) or "whole layer", self.plan.num_graphs,
                    self.plan.num_static_input_buffers)

    def _find_manual_hooks(self, sample_args) -> List[torch.nn.Module]:
        """Submodules the graphs stand in for (their ``__call__`` is skipped at replay) that have pre-hooks."""
        hooked: List[torch.nn.Module] = []
        for i, runner in enumerate(self.runners):
            replayed_eagerly = {id(runner.layer), id(runner.part)}
            probe = sample_args[i if self.plan.order is None else self._first_index(i)][0].detach()
            with torch.no_grad(), _ModulesCalled() as called:
                runner.part(probe)
            seen = set()
            modules = [m for m in called.modules if id(m) not in replayed_eagerly and not (id(m) in seen or seen.add(id(m)))]
            runner.cuda_graph_manual_hooks = [h for m in modules for h in _forward_pre_hooks(m)]
            runner.fp8_weights = [p for m in modules for p in m.parameters(recurse=False) if is_fp8_param(p)]
            hooked.extend(m for m in modules if m._forward_pre_hooks)
        return hooked

    def _first_index(self, layer: int) -> int:
        start = 0
        for n in self.plan.num_layers_per_chunk:
            if layer < start + n:
                return start * self.plan.num_microbatches + (layer - start)
            start += n
        raise IndexError(layer)

    def _assign(self, graphs: Sequence[Callable]) -> None:
        plan = self.plan
        if plan.order is None:
            for runner, graph in zip(self.runners, graphs):
                runner.cuda_graphs = [graph]
            return
        start = 0
        for n in plan.num_layers_per_chunk:
            for l_no in range(n):
                self.runners[start + l_no].cuda_graphs = [
                    graphs[start * plan.num_microbatches + mb * n + l_no] for mb in range(plan.num_microbatches)]
            start += n

    def reset(self) -> None:
        """Drop the graphs (layers run eagerly until the next ``create_cudagraphs``)."""
        for runner in self.runners:
            runner.drop_graphs()

    def remove(self) -> None:
        """Give the layers their own forward back."""
        self.reset()
        for runner in self.runners:
            runner.uninstall()


def _check_graph_safe_rng(layer, scope: Sequence[str]) -> None:
    """Refuse dropout that forks our model-parallel RNG tracker inside a captured region.

    The tracker swaps the CUDA RNG state with ``set_rng_state``, which a graph
    cannot record; dropout on the default generator is fine (capture registers it).
    """
    attention = getattr(layer, "self_attention", None)
    if (not scope or "attn" in scope) and attention is not None and getattr(attention, "rng_tracker", None) is not None \
            and getattr(attention, "attention_dropout", 0.0) > 0:
        raise ConfigError(f"megatron.cuda_graph captures attention but model.attention_dropout="
                          f"{attention.attention_dropout} runs under the model-parallel RNG tracker, which CUDA graphs "
                          "cannot record; set attention_dropout to 0 or megatron.cuda_graph.impl to \"none\"")
    if getattr(layer, "sequence_parallel", False) and getattr(layer, "rng_tracker", None) is not None \
            and getattr(layer, "hidden_dropout", 0.0) > 0:
        raise ConfigError(f"megatron.cuda_graph with sequence_parallel: model.hidden_dropout={layer.hidden_dropout} "
                          "runs under the model-parallel RNG tracker, which CUDA graphs cannot record; set "
                          "hidden_dropout to 0 or megatron.cuda_graph.impl to \"none\"")


__all__ = ["CapturedPart", "CudaGraphHelper", "GraphableLayer", "InputSpec", "LayerGraphRunner", "is_moe_layer",
           "layer_is_graphable"]
