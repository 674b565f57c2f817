"""CUDA graphs inside DeepSpeed's loop: a forward pre-hook on ``engine.module`` that captures, then replays.

DeepSpeed seams: ``engine.module`` (``register_forward_pre_hook``),
``engine.global_steps``, ``engine.micro_steps``, ``engine.gradient_accumulation_steps()``,
``engine.device`` (graphs need the engine on a CUDA device) and, for the
pipeline engine, ``engine.num_stages`` / ``engine.stage_id``.

``ds_megatron.initialize`` calls ``attach_cuda_graphs(engine, config.cuda_graph)``.
The loop stays ``loss = engine(batch); engine.backward(loss); engine.step()``:

* the first ``warmup_steps`` optimizer steps run eagerly (lazy initialization,
  the layers' input shapes, and the forward pre-hooks that replay must call
  by hand are all in place after them);
* at the first micro-batch of the next step the hook captures every graphable
  layer (``CudaGraphHelper.create_cudagraphs``), before that forward runs;
* every later training forward tells the layers the micro-batch index
  (``engine.micro_steps`` modulo the accumulation steps) and they replay;
* if the model's inputs change shape (or a layer sees another shape), the
  graphs are dropped, never replayed on wrong shapes, and recaptured after
  ``warmup_steps`` more steps at the new shape.

With DeepSpeed's ``PipelineEngine`` (``engine.num_stages > 1``) each stage
captures its own layers for every in-flight micro-batch, in the order its
1F1B schedule runs them (``convert_schedule_table_to_order`` for one model
chunk with ``pp - stage - 1`` warm-up forwards, which is exactly the order of
DeepSpeed's ``TrainSchedule``); the micro-batch index is the number of
training forwards since the step began (the pipeline engine does not advance
``engine.micro_steps`` per micro-batch).

With our pipeline runtime (``pipeline_schedule`` "interleaved_1f1b", a ``GPTModelChunks`` on
DeepSpeed's plain engine) the runtime drives the graphs instead of a forward hook
(``PipelineRuntimeCudaGraphs``): the layers are handed over chunk after chunk with each chunk's
count, so the capture order is ``convert_schedule_table_to_order`` for this rank's v chunks, the
order the runtime then executes; capture happens at the start of ``train_batch`` once
``warmup_steps`` steps have run, and before each training forward the runtime names the chunk and
micro-batch, whose graphs that chunk's layers replay.

Where graphs cannot run (the engine is not on a CUDA device) one log line says so and why, and
training proceeds eagerly; with ``required: true`` the job stops at start instead.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from ..config.cuda_graph import CudaGraphConfig
from ..cuda_graphs import Capturer, CudaGraphHelper, default_capturer
from ..cuda_graphs.capture import layer_is_graphable
from ..errors import ConfigError

logger = logging.getLogger("ds_megatron.cuda_graphs")


def _input_signature(args, kwargs) -> Tuple[Any, ...]:
    flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__ for t in flat)


class CudaGraphEngineHook:
    """Ties one ``CudaGraphHelper`` to one DeepSpeed engine (see the module docstring)."""

    def __init__(self, engine, helper: CudaGraphHelper, config: CudaGraphConfig):
        self.engine = engine
        self.helper = helper
        self.config = config
        self._warmup_start_step = engine.global_steps
        self._signature: Optional[Tuple[Any, ...]] = None
        self.num_captures = 0
        self.pipeline = getattr(engine, "num_stages", 1) > 1
        self._forwards_in_step: Tuple[int, int] = (engine.global_steps, 0)  # (step, training forwards in it)
        self._handle = engine.module.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def _microbatch_index(self) -> int:
        if self.pipeline:
            step, count = self._forwards_in_step
            if step != self.engine.global_steps:
                step, count = self.engine.global_steps, 0
            self._forwards_in_step = (step, count + 1)
            return count
        return self.engine.micro_steps % self.engine.gradient_accumulation_steps()

    def _before_forward(self, module, args, kwargs) -> None:
        if not module.training or not torch.is_grad_enabled():
            return  # evaluation runs eagerly; the graphs were captured in training mode
        signature = _input_signature(args, kwargs)
        if self.helper.captured and (signature != self._signature or self.helper.stale):
            logger.info("model inputs changed shape; CUDA graphs dropped, recapturing after %d eager steps",
                        self.config.warmup_steps)
            self.helper.reset()
            self._warmup_start_step = self.engine.global_steps
        self._signature = signature
        microbatch = self._microbatch_index()
        if (not self.helper.captured and microbatch == 0
                and self.engine.global_steps - self._warmup_start_step >= self.config.warmup_steps):
            self.helper.create_cudagraphs()
            self.num_captures += 1
        self.helper.set_current_microbatch(microbatch)

    def detach(self) -> None:
        """Stop capturing/replaying and give the layers their eager forward back."""
        self._handle.remove()
        self.helper.remove()


class PipelineRuntimeCudaGraphs:
    """Ties one ``CudaGraphHelper`` to our pipeline runtime (see the module docstring): the runtime calls
    ``begin_step`` at each ``train_batch`` and ``before_forward(chunk, microbatch)`` before each training forward."""

    def __init__(self, engine, runtime, helper: CudaGraphHelper, config: CudaGraphConfig, chunk_of_runner):
        self.engine, self.runtime, self.helper, self.config = engine, runtime, helper, config
        self._warmup_start_step = engine.global_steps
        self.num_captures = 0
        self._runners_of_chunk = {}
        for runner, chunk in zip(helper.runners, chunk_of_runner):
            self._runners_of_chunk.setdefault(chunk, []).append(runner)

    def begin_step(self) -> None:
        if self.helper.captured and self.helper.stale:
            logger.info("a layer's input changed shape; CUDA graphs dropped, recapturing after %d eager steps",
                        self.config.warmup_steps)
            self.helper.reset()
            self._warmup_start_step = self.engine.global_steps
        if not self.helper.captured and self.engine.global_steps - self._warmup_start_step >= self.config.warmup_steps:
            self.helper.create_cudagraphs()
            self.num_captures += 1

    def before_forward(self, chunk: int, microbatch: int) -> None:
        for runner in self._runners_of_chunk.get(chunk, ()):
            runner.current_microbatch = microbatch

    def detach(self) -> None:
        self.runtime.cuda_graphs = None
        self.helper.remove()


def attach_cuda_graphs(engine, config: CudaGraphConfig, capturer: Optional[Capturer] = None,
                       num_warmup_iters: int = 3):
    """Hook CUDA graphs into ``engine``'s forward, or say in one line why not (None).

    ``capturer``: injected by tests (``EagerCapturer``); by default chosen for
    ``config.impl`` on this machine (TE, else torch; none without CUDA).
    """
    if not config.enabled:
        return None
    if capturer is None:
        capturer, why = default_capturer(config.impl, engine.device)
        if capturer is None:
            if config.required:
                raise ConfigError(f"megatron.cuda_graph.required is true but CUDA graphs cannot run here: {why}; "
                                  "run on a CUDA machine or set required to false")
            if not dist.is_initialized() or dist.get_rank() == 0:  # one line for the job, not one per rank
                logger.warning("CUDA graphs are off: megatron.cuda_graph.impl=%r needs CUDA but %s; training runs "
                               "eagerly", config.impl, why)
            return None
        logger.info("CUDA graphs: %s", why)
    runtime = getattr(getattr(engine, "megatron", None), "pipeline_runtime", None)
    if runtime is not None:
        return _attach_to_runtime(engine, runtime, config, capturer, num_warmup_iters)
    layers = list(engine.module.modules())
    stages = getattr(engine, "num_stages", 1)
    helper = CudaGraphHelper(layers, config, capturer, num_microbatches=engine.gradient_accumulation_steps(),
                             pipeline_parallel_size=stages,
                             pipeline_parallel_rank=engine.stage_id if stages > 1 else 0,
                             num_warmup_iters=num_warmup_iters)
    return CudaGraphEngineHook(engine, helper, config)


def _attach_to_runtime(engine, runtime, config: CudaGraphConfig, capturer: Capturer,
                       num_warmup_iters: int) -> PipelineRuntimeCudaGraphs:
    scope = tuple(config.scope)
    layers, chunk_of_layer, per_chunk = [], [], []
    for c, chunk in enumerate(runtime.model.chunks):
        graphable = [m for m in chunk.modules() if layer_is_graphable(m, scope)]
        layers += graphable
        chunk_of_layer += [c] * len(graphable)
        per_chunk.append(len(graphable))
    state = runtime.state
    helper = CudaGraphHelper(layers, config, capturer, num_microbatches=engine.gradient_accumulation_steps(),
                             num_layers_per_chunk=per_chunk, pipeline_parallel_size=state.pp.size,
                             pipeline_parallel_rank=state.pp.rank,
                             microbatch_group_size_per_vp_stage=runtime.schedule.group_size,
                             num_warmup_iters=num_warmup_iters)
    graphs = PipelineRuntimeCudaGraphs(engine, runtime, helper, config, chunk_of_layer)
    runtime.cuda_graphs = graphs
    return graphs


__all__ = ["CudaGraphEngineHook", "PipelineRuntimeCudaGraphs", "attach_cuda_graphs"]
