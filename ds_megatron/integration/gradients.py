"""Who reduces gradients inside a DeepSpeed engine: exactly one component per path.

* Megatron path (``optimizer_impl`` "megatron"): the model's
  ``DistributedDataParallel`` buffers.  DeepSpeed's own reduction is switched off
  (``seams.set_deepspeed_reduces_gradients``: the flag DeepSpeed's pipeline
  engine turns off for the same reason).  A forward pre-hook on ``engine.module``
  (``register_forward_pre_hook``, a torch seam) starts each micro-batch: after an
  optimizer step it zeroes the buffers (one op per buffer; "after a step" is
  told by our optimizer's ``steps_called``, which only grows: ``engine.global_steps``
  moves back when a checkpoint is loaded, and the grads of the steps taken since
  must not survive the load) and it tells them
  whether this micro-batch ends the accumulation window
  (``engine.is_gradient_accumulation_boundary()`` and not inside
  ``engine.no_sync()``, ``seams.inside_no_sync``), so that overlapped reductions start only then.  The
  optimizer wrapper finishes the sync in ``step()`` (``finalize_model_grads``).
  ``engine.backward`` already divides the loss by the accumulation steps, so the
  buffers accumulate the mean DeepSpeed would.
  With DeepSpeed's ``PipelineEngine`` the schedule runs the backwards of a step
  after (and between) its forwards, so the forward pre-hook only starts the
  window and marks every micro-batch "not last"; a forward hook on
  ``engine.module`` puts a gradient hook on each training output, which runs
  when that micro-batch's backward reaches the stage, before any parameter
  gradient: it counts the backwards and marks the last one
  (``seams.pipeline_micro_batches``-th), so that overlapped reductions start during the
  last backward and never before its gradients are in.  The pipeline engine's own
  reduction is switched off by the same accessor; its tied-weight all-reduce reads
  ``.grad``, which the buffers leave empty (``finalize_model_grads`` sums the tied
  embedding instead).
* DeepSpeed path: DeepSpeed's all-reduce over the mpu's data-parallel group (and,
  for MoE layers, its expert path over our expert groups, ``integration.moe``).
  Gradients of sequence-parallel parameters and of KV copies are partial sums over TP,
  which DeepSpeed does not know; they are completed inside backward by tensor hooks
  (``register_tp_partial_grad_hooks``).
"""
from __future__ import annotations

from typing import List

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..config.ddp import DistributedDataParallelConfig
from ..distributed import DistributedDataParallel
from ..errors import ConfigError
from ..optimizer import DistributedOptimizer
from ..parallel_state import ParallelState
from ..tensor_parallel.params import register_tp_partial_grad_hooks
from .seams import inside_no_sync, pipeline_micro_batches, set_deepspeed_reduces_gradients


def check_engine_supports_megatron_ddp(engine, ddp_config: DistributedDataParallelConfig) -> None:
    """Refuse engine settings that would also own the gradients (one sentence, with the fix).

    The config refuses these before anything starts; this guards an engine built another way.
    """
    stage = engine.zero_optimization_stage()
    if stage != 0:
        raise ConfigError(f"megatron.use_megatron_ddp is on but zero_optimization.stage is {stage}; ZeRO reduces "
                          "and partitions gradients itself: set the stage to 0 (use megatron.use_distributed_optimizer "
                          "to shard optimizer state) or turn use_megatron_ddp off")
    if engine.bfloat16_enabled() or engine.fp16_enabled():
        raise ConfigError("megatron.use_megatron_ddp is on together with DeepSpeed's own bf16/fp16 section, whose "
                          "optimizer wrapper keeps separate gradient copies; disable DeepSpeed's bf16/fp16 and use "
                          "ds_megatron's mixed-precision optimizer (it reads param.main_grad)")
    if ddp_config.use_distributed_optimizer and not isinstance(getattr(engine, "optimizer", None),
                                                               DistributedOptimizer):
        raise ConfigError("megatron.use_distributed_optimizer is on but the engine's optimizer is not ds_megatron's "
                          "DistributedOptimizer, which alone reads the reduce-scattered grad shards; build the engine "
                          "with ds_megatron.initialize and megatron.optimizer_impl \"megatron\", or turn "
                          "use_distributed_optimizer off")


class MegatronDDPInEngine:
    """Ties one ``DistributedDataParallel`` to one DeepSpeed engine (see the module docstring)."""

    def __init__(self, engine, ddp: DistributedDataParallel):
        check_engine_supports_megatron_ddp(engine, ddp.ddp_config)
        if ddp.module is not engine.module:
            raise RuntimeError("the DistributedDataParallel wraps another module than engine.module; build it "
                               "around the model passed to deepspeed.initialize")
        _check_params_still_in_buffers(ddp)
        self.engine = engine
        self.ddp = ddp
        self.params = list(ddp.param_to_bucket_group)
        self._zeroed_at_step = self._steps_called()  # fresh buffers are zero
        self.pipeline = isinstance(engine, PipelineEngine)
        self._backwards = 0  # backward passes in this window (pipeline)
        set_deepspeed_reduces_gradients(engine, False)
        self._handles = [engine.module.register_forward_pre_hook(self._before_forward)]
        if self.pipeline:
            self._handles.append(engine.module.register_forward_hook(self._hook_backward_start))

    def _before_forward(self, module, inputs) -> None:
        engine = self.engine
        steps = self._steps_called()
        if steps != self._zeroed_at_step:
            # The optimizer consumed the grads of the last window: start a new one.
            self.ddp.zero_grad_buffer()
            for p in self.params:
                p.grad = None
            self._zeroed_at_step = steps
            self._backwards = 0
        if self.pipeline:
            self.ddp.set_is_last_microbatch(False)  # the backward pre-hook says which one is
        else:
            self.ddp.set_is_last_microbatch(engine.is_gradient_accumulation_boundary()
                                            and not inside_no_sync(engine))

    def _steps_called(self) -> int:
        return self.engine.optimizer.steps_called  # our optimizer: the Megatron path's only one

    def _hook_backward_start(self, module, inputs, output) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        flat, _ = torch.utils._pytree.tree_flatten(output)
        first = next((t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(self._before_backward)

    def _before_backward(self, grad):
        self._backwards += 1
        self.ddp.set_is_last_microbatch(self._backwards == pipeline_micro_batches(self.engine))

    def detach(self) -> None:
        """Give reduction back to DeepSpeed (tests, or swapping the wrapper)."""
        for handle in self._handles:
            handle.remove()
        set_deepspeed_reduces_gradients(self.engine, True)
        self.ddp.remove_hooks()


def _check_params_still_in_buffers(ddp: DistributedDataParallel) -> None:
    # deepspeed.initialize ran between building the DDP and now; had it replaced a param's
    # storage (a device move, a cast), the buffers would no longer reach that param.
    for buffer in ddp.all_buffers:
        if buffer.param_data is None:
            continue
        base = buffer.param_data.untyped_storage().data_ptr()
        for p in buffer.params:
            if p.untyped_storage().data_ptr() != base:
                raise RuntimeError(f"param {buffer.param_to_name.get(p, tuple(p.shape))} no longer lives in the "
                                   "distributed optimizer's param buffer after deepspeed.initialize (moved or "
                                   "cast); place and cast the model before ds_megatron.initialize")


def complete_tp_partial_grads_in_backward(module, parallel_state: ParallelState) -> List:
    """The DeepSpeed path's share of the model-parallel sync: TP-partial grads (sequence-parallel, KV copies)
    summed over TP in backward, every micro-batch."""
    return register_tp_partial_grad_hooks(module, parallel_state.tp)
