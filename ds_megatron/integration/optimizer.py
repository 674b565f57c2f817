"""Megatron's optimizer path behind ``deepspeed.initialize``: what DeepSpeed is handed, and why.

The client-optimizer contract (DeepSpeed 0.19.8, ``runtime/engine.py``): a
``torch.optim.Optimizer`` is used as it is when neither fp16, bf16 nor ZeRO is
enabled in DeepSpeed's config; the engine calls its ``step()`` once per
accumulation boundary (``_take_model_step``), reads ``optimizer.overflow`` (True
skips the LR-scheduler step and counts a skipped step), copies
``optimizer._global_grad_norm`` into ``engine.get_global_grad_norm()``, saves
``state_dict()`` and restores it with ``load_state_dict()``, and calls
``refresh_fp32_params()`` after a module-only load.  So, with
``megatron.optimizer_impl`` "megatron", ``prepare_optimizer_path``:

* moves the model to DeepSpeed's device and casts it to fp16/bf16 (DeepSpeed
  sees fp16/bf16 off, so it neither casts nor refuses fp16 on a CPU);
* builds the model's ``DistributedDataParallel``: the gradient buffers that are
  the one gradient reducer of this path (dense grads over dp-cp, expert grads
  over their expert-data-parallel group, fp32 ``main_grad`` for 16-bit params).
  It is built here, before ``deepspeed.initialize``, because the distributed
  optimizer is made from its buffers; this is the only place it is built;
* wraps the torch optimizer (the caller's, or one built from the ``"optimizer"``
  section) in the matching Megatron wrapper over those buffers, with the scaler
  and clipping of the user's ``"fp16"`` / ``"gradient_clipping"``;
* hands DeepSpeed a config without precision, clipping and optimizer
  (``PrecisionConfig.deepspeed_view``), and hooks on the module that scale the
  loss gradient (``optimizer.float16_module``).

With ``optimizer_impl`` "deepspeed" (or no model) DeepSpeed gets everything as given.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from ..config.megatron import MegatronConfig
from ..distributed import DistributedDataParallel
from ..errors import ConfigError
from ..models.gpt_chunks import GPTModelChunks
from ..optimizer import (MegatronOptimizer, attach_float16_hooks, get_megatron_optimizer, get_param_groups,
                         optimizer_from_section)
from ..parallel_state import ParallelGroup, ParallelState
from .runtime import accelerator_device

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class OptimizerPath:
    """What ``deepspeed.initialize`` is called with, after our path took over what it owns."""

    ds_config: Dict[str, Any]
    optimizer: Any
    model_parameters: Any
    ddp: Optional[DistributedDataParallel] = None  # the gradient reducer on our path
    hooks: List[Any] = field(default_factory=list)


def _cast_model_params(model: torch.nn.Module, dtype: torch.dtype, device) -> None:
    # In place (``param.data``) so that the Parameter objects, which the caller's
    # optimizer and LR scheduler already reference, stay the same objects.
    for p in model.parameters():
        p.grad = None
        p.data = p.data.to(device=device, dtype=dtype if p.is_floating_point() else p.dtype)


def prepare_optimizer_path(ds_config: Dict[str, Any], megatron_config: MegatronConfig,
                           model: Optional[torch.nn.Module], optimizer, model_parameters,
                           parallel_state: Optional[ParallelState] = None,
                           expert_group: Optional[Callable[[torch.nn.Parameter], ParallelGroup]] = None,
                           outputs_feed_the_loss: bool = True) -> OptimizerPath:
    """Decide what ``deepspeed.initialize`` gets; with our path, cast the model, build the buffers, wrap the optimizer.

    ``parallel_state``: the job's groups (None: one rank).  ``expert_group``: the reduction group of expert
    params that are not ours (DeepSpeed's MoE layer).  ``outputs_feed_the_loss``: False on a pipeline stage
    before the last (its outputs go to the next stage, unscaled, in the model's dtype).
    """
    parallel_state = parallel_state if parallel_state is not None else ParallelState.single()
    precision = megatron_config.precision
    if megatron_config.ddp.use_distributed_optimizer and model is None:
        raise ConfigError("megatron.use_distributed_optimizer is true but no model= was given; the distributed "
                          "optimizer shards the model's grad buffers: pass model=")
    if not precision.owns_optimizer or model is None:
        return OptimizerPath(dict(ds_config), optimizer, model_parameters)
    if isinstance(optimizer, MegatronOptimizer):
        raise ConfigError("optimizer= is already a Megatron optimizer wrapper; pass the plain torch optimizer "
                          "(ds_megatron.initialize wraps it) or set megatron.optimizer_impl to \"deepspeed\"")
    if optimizer is not None and "optimizer" in ds_config:
        raise ConfigError("both optimizer= and an \"optimizer\" config section were given; keep one")

    # Built before the cast so param groups reference the same Parameter objects the cast keeps.
    if optimizer is None and "optimizer" in ds_config:
        weight_decay = ds_config["optimizer"].get("params", {}).get("weight_decay", 0.0)
        params = model_parameters if model_parameters is not None else get_param_groups(model, weight_decay)
        optimizer = optimizer_from_section(ds_config["optimizer"], params)
    elif optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
    if optimizer is None and megatron_config.ddp.use_distributed_optimizer:
        raise ConfigError("megatron.use_distributed_optimizer is true but there is no optimizer to shard; "
                          "add an \"optimizer\" section or pass optimizer= (a torch optimizer or a callable)")
    params_dtype = _DTYPES[precision.params_dtype]
    _cast_model_params(model, params_dtype, accelerator_device())
    ddp, wrapped = None, None
    if optimizer is not None:  # without one nothing steps (an engine for inference): no buffers to read
        # Params move into the buffers (values kept) when the distributed optimizer shards them.
        ddp = DistributedDataParallel(model, megatron_config.ddp, parallel_state, expert_group=expert_group)
        wrapped = get_megatron_optimizer(optimizer, precision, parallel_state, model_chunks=[ddp])
    hooks = []
    if params_dtype != torch.float32:
        scaler = wrapped.grad_scaler if wrapped is not None else None
        # Model chunks are run one by one by our pipeline runtime: each casts its inputs, the last scales the loss.
        targets = [(chunk, chunk.is_last) for chunk in model.chunks] if isinstance(model, GPTModelChunks) \
            else [(model, outputs_feed_the_loss)]
        for module, feeds_loss in targets:
            hooks += attach_float16_hooks(module, params_dtype, scaler, feeds_loss)
    return OptimizerPath(precision.deepspeed_view(ds_config), wrapped, model_parameters, ddp, hooks)
