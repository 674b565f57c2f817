"""Put a ``DistributedDataParallel`` in charge of gradient reduction inside a DeepSpeed engine.

The plain loop keeps working::

    loss = engine(batch); engine.backward(loss); engine.step()

Seams used (DeepSpeed 0.19.8, ZeRO stage 0):

* ``engine.allreduce_gradients`` is where DeepSpeed reduces: ``_backward_epilogue``
  calls it after every ``engine.backward`` outside ``engine.no_sync()``, and
  ``step()`` calls it in unmanaged accumulation mode.  We replace it on this
  engine with ours: on the accumulation boundary it waits for (or runs) our
  bucketed reductions and points each ``param.grad`` at its reduced
  ``main_grad`` (a view, no copy, when the dtypes match) so that DeepSpeed's
  clipping and the client optimizer read reduced grads.  DeepSpeed's own
  all-reduce therefore never runs: no double reduction.
* A forward pre-hook on ``engine.module`` (``register_forward_pre_hook``) starts
  each micro-batch: after an optimizer step it zeroes the buffers (one op per
  buffer) and clears ``.grad``; it tells the bucket groups whether this is the
  last micro-batch (``engine.is_gradient_accumulation_boundary()`` and not
  inside ``engine.no_sync()``), so that overlapped reductions start only then.
  Enter ``engine.no_sync()`` before the forward, as DeepSpeed documents.

``engine.backward`` already divides the loss by gradient_accumulation_steps, so
``main_grad`` accumulates the same mean DeepSpeed would; we average over DP.

With ``use_distributed_optimizer`` the DDP is built before ``deepspeed.initialize``
(the ``DistributedOptimizer`` given to DeepSpeed is made from its buffers) and
passed in here; the reductions are reduce-scatters, so only each rank's shard
of ``main_grad`` is reduced and ``.grad`` is left unset: the optimizer reads its
shard of ``main_grad`` itself.
"""
from __future__ import annotations

from ..config import ConfigError
from .ddp_config import DistributedDataParallelConfig
from .distributed_data_parallel import DistributedDataParallel


def check_engine_supports_megatron_ddp(engine, ddp_config: DistributedDataParallelConfig) -> None:
    """Refuse engine settings that would also own the gradients (one sentence, with the fix)."""
    stage = engine.zero_optimization_stage()
    if stage != 0:
        raise ConfigError(f"megatron.use_megatron_ddp is on but zero_optimization.stage is {stage}; ZeRO reduces "
                          "and partitions gradients itself: set the stage to 0 (use megatron.use_distributed_optimizer "
                          "to shard optimizer state) or turn use_megatron_ddp off")
    if engine.bfloat16_enabled() or engine.fp16_enabled():
        raise ConfigError("megatron.use_megatron_ddp is on together with DeepSpeed's own bf16/fp16 section, whose "
                          "optimizer wrapper keeps separate gradient copies; disable DeepSpeed's bf16/fp16 and use "
                          "ds_megatron's mixed-precision optimizer (it reads param.main_grad)")
    if ddp_config.use_distributed_optimizer and not _is_distributed_optimizer(getattr(engine, "optimizer", None)):
        raise ConfigError("megatron.use_distributed_optimizer is on but the engine's optimizer is not ds_megatron's "
                          "DistributedOptimizer, which alone reads the reduce-scattered grad shards; build the engine "
                          "with ds_megatron.initialize and megatron.optimizer_impl \"megatron\", or turn "
                          "use_distributed_optimizer off")


def _is_distributed_optimizer(optimizer) -> bool:
    from ..optimizer.distrib_optimizer import DistributedOptimizer
    return isinstance(optimizer, DistributedOptimizer)


def _reads_main_grad(optimizer) -> bool:
    try:
        from ..optimizer.megatron_optimizer import MegatronOptimizer
    except ImportError:
        return False
    return isinstance(optimizer, MegatronOptimizer)


class MegatronDDPHooks:
    """Ties one ``DistributedDataParallel`` to one DeepSpeed engine; see the module docstring."""

    def __init__(self, engine, ddp: DistributedDataParallel):
        self.engine = engine
        self.ddp = ddp
        self.params = list(ddp.param_to_bucket_group)
        self._optimizer_reads_main_grad = _reads_main_grad(engine.optimizer)
        # Reduce-scattered grads are only valid in each rank's shard: never expose them as .grad.
        self._grads_are_sharded = ddp.ddp_config.use_distributed_optimizer
        self._zeroed_at_step = engine.global_steps
        self._synced = False
        self._forward_pre_hook = engine.module.register_forward_pre_hook(self._before_forward)
        # The seam: DeepSpeed's reduction entry point, replaced on this engine only.
        self._deepspeed_allreduce_gradients = engine.allreduce_gradients
        engine.allreduce_gradients = self.allreduce_gradients

    def _before_forward(self, module, inputs) -> None:
        engine = self.engine
        if engine.global_steps != self._zeroed_at_step:
            # The optimizer consumed the grads of the last window: start a new one.
            self.ddp.zero_grad_buffer()
            for p in self.params:
                p.grad = None
            self._zeroed_at_step = engine.global_steps
            self._synced = False
        self.ddp.set_is_last_microbatch(engine.is_gradient_accumulation_boundary()
                                        and not engine.inside_no_sync_ctxt)

    def allreduce_gradients(self, bucket_size=None) -> None:
        """Replaces ``engine.allreduce_gradients``: finish our reductions on the accumulation boundary."""
        if not self.engine.is_gradient_accumulation_boundary() or self._synced:
            return
        self.ddp.finish_grad_sync()
        self._synced = True
        if self._grads_are_sharded:
            return
        for p in self.params:
            # Same dtype: a view, no copy.  An fp32 main_grad of a 16-bit param is cast for a
            # plain torch optimizer only; ds_megatron's optimizers read main_grad directly.
            if p.main_grad.dtype == p.dtype:
                p.grad = p.main_grad
            elif not self._optimizer_reads_main_grad:
                p.grad = p.main_grad.to(p.dtype)

    def detach(self) -> None:
        """Give reduction back to DeepSpeed (tests, or swapping the wrapper)."""
        self._forward_pre_hook.remove()
        self.engine.allreduce_gradients = self._deepspeed_allreduce_gradients
        self.ddp.remove_hooks()


def attach_megatron_ddp(engine, ddp_config: DistributedDataParallelConfig, parallel_state,
                        ddp: DistributedDataParallel = None) -> DistributedDataParallel:
    """Build our buffers around ``engine.module`` (after DeepSpeed placed and cast it) and hook them in.

    With the distributed optimizer the DDP already exists: the engine's
    ``DistributedOptimizer`` was made from its buffers (``model_chunks[0]``); it is used,
    not rebuilt.  ``ddp``: pass one built around ``engine.module`` yourself.
    Returns the ``DistributedDataParallel``; its ``deepspeed_hooks`` attribute is the ``MegatronDDPHooks``.
    """
    check_engine_supports_megatron_ddp(engine, ddp_config)
    if ddp is None and ddp_config.use_distributed_optimizer:
        chunks = engine.optimizer.model_chunks
        if len(chunks) != 1:
            raise ValueError(f"the DistributedOptimizer shards {len(chunks)} model chunks; one DeepSpeed engine "
                             "drives one module: build it over that module's DDP only")
        ddp = chunks[0]
    if ddp is None:
        ddp = DistributedDataParallel(engine.module, ddp_config, parallel_state)
    else:
        _check_params_still_in_buffers(engine, ddp)
    ddp.deepspeed_hooks = MegatronDDPHooks(engine, ddp)
    return ddp


def _check_params_still_in_buffers(engine, ddp: DistributedDataParallel) -> None:
    # deepspeed.initialize ran between building the DDP and now; had it replaced a param's
    # storage (a device move, a cast), the all-gather would no longer reach that param.
    if ddp.module is not engine.module:
        raise RuntimeError("the prebuilt DistributedDataParallel wraps another module than engine.module; "
                           "build it around the model passed to deepspeed.initialize")
    for buffer in ddp.all_buffers:
        if buffer.param_data is None:
            continue
        base = buffer.param_data.untyped_storage().data_ptr()
        for p in buffer.params:
            if p.untyped_storage().data_ptr() != base:
                raise RuntimeError(f"param {buffer.param_to_name.get(p, tuple(p.shape))} no longer lives in the "
                                   "distributed optimizer's param buffer after deepspeed.initialize (moved or "
                                   "cast); place and cast the model before ds_megatron.initialize")


__all__ = ["attach_megatron_ddp", "check_engine_supports_megatron_ddp", "MegatronDDPHooks"]
