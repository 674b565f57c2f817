"""Put Megatron's optimizer path behind ``deepspeed.initialize``: what DeepSpeed is handed, and why.

DeepSpeed 0.19.8 uses a client optimizer as it is when it is a
``torch.optim.Optimizer`` and neither fp16, bf16 nor ZeRO is enabled in its
config; it then calls ``step()`` once per accumulation boundary, reads
``optimizer.overflow`` (a True skips its LR-scheduler step and counts a
skipped step), copies ``optimizer._global_grad_norm`` into
``engine.get_global_grad_norm()``, saves ``state_dict()`` and restores it with
``load_state_dict()``.  So, when ``megatron.optimizer_impl`` is "megatron":

* the model params are moved to DeepSpeed's device and cast to fp16/bf16 here
  (DeepSpeed sees fp16/bf16 off, so it neither casts nor refuses fp16 on CPU);
* the torch optimizer (the caller's, or one built from the ``"optimizer"``
  section) is wrapped in ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer``
  with the scaler and clipping from the user's ``"fp16"`` / ``"gradient_clipping"``;
* the config DeepSpeed sees has precision, clipping and the optimizer section
  removed (``PrecisionConfig.deepspeed_view``); its gradient all-reduce then
  runs in fp32 (DeepSpeed's ``communication_data_type`` default without fp16/bf16);
* hooks on the module scale the loss gradient (``float16_module``);
* with ``megatron.use_distributed_optimizer`` the Megatron DDP is built here,
  around the cast model and before ``deepspeed.initialize``, because the
  ``DistributedOptimizer`` handed to DeepSpeed is made from its buffers
  (``attach_megatron_ddp`` later hooks that same DDP, the optimizer's
  ``model_chunks[0]``, into the engine).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from ..config import ConfigError
from .float16_module import attach_float16_hooks
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .megatron_optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer, MegatronOptimizer
from .param_groups import get_param_groups
from .precision_config import PrecisionConfig

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# DeepSpeed "optimizer" params each torch optimizer accepts (DeepSpeed's names where they differ).
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
_IGNORED_KEYS = ("torch_adam",)  # selects DeepSpeed's kernel, meaningless for a torch optimizer


@dataclass
class OptimizerPath:
    """What ``deepspeed.initialize`` is called with, after our path took over what it owns."""

    precision: PrecisionConfig
    ds_config: Dict[str, Any]
    optimizer: Any
    model_parameters: Any
    hooks: List[Any] = field(default_factory=list)
    # True when our optimizer averages the grads over data parallel (fp32 main grads),
    # so DeepSpeed's own backward all-reduce must be off.
    optimizer_reduces_grads: bool = False

    def attach(self, engine) -> None:
        """Adjust the built engine: hand the gradient all-reduce to our optimizer when it owns it.

        ``enable_backward_allreduce`` is the engine attribute DeepSpeed's own pipeline
        engine turns off for the same reason.  DeepSpeed would otherwise reduce the
        fp16/bf16 grads in place (rounding the average back to 16 bits, and on CPUs
        refusing fp16 grads outright) before our step reduces them in fp32.
        """
        if self.optimizer_reduces_grads:
            engine.enable_backward_allreduce = False


def build_grad_scaler(precision: PrecisionConfig, device=None) -> Optional[MegatronGradScaler]:
    """Megatron's choice: a constant scaler for an explicit loss_scale, dynamic for fp16, none otherwise."""
    if precision.loss_scale > 0 and precision.params_dtype != "fp32":
        return ConstantGradScaler(precision.loss_scale, device=device)
    if precision.params_dtype == "fp16":
        return DynamicGradScaler(initial_scale=precision.initial_scale, min_scale=precision.min_loss_scale,
                                 growth_factor=2.0, backoff_factor=0.5, growth_interval=precision.loss_scale_window,
                                 hysteresis=precision.hysteresis, device=device)
    return None


def get_megatron_optimizer(optimizer: torch.optim.Optimizer, precision: PrecisionConfig, parallel_state=None,
                           found_inf_groups=(), grad_reduce_group=None, model_chunks=None) -> MegatronOptimizer:
    """Wrap a torch optimizer over the (already cast) model params in the matching Megatron wrapper.

    ``model_chunks``: DDP wrappers built with ``use_distributed_optimizer``; then the
    wrapper is a ``DistributedOptimizer`` over their buffers (any precision).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = params[0].device if params else None
    scaler = build_grad_scaler(precision, device)
    if model_chunks:
        from .distrib_optimizer import DistributedOptimizer
        return DistributedOptimizer(optimizer, model_chunks, clip_grad=precision.clip_grad,
                                    log_num_zeros_in_grad=precision.log_num_zeros_in_grad, grad_scaler=scaler,
                                    parallel_state=parallel_state)
    common = dict(clip_grad=precision.clip_grad, log_num_zeros_in_grad=precision.log_num_zeros_in_grad,
                  grad_scaler=scaler, parallel_state=parallel_state, found_inf_groups=found_inf_groups)
    if precision.params_dtype == "fp32":
        return FP32Optimizer(optimizer, **common)
    return Float16OptimizerWithFloat16Params(optimizer, grad_reduce_group=grad_reduce_group, **common)


def optimizer_from_section(section: Dict[str, Any], params) -> torch.optim.Optimizer:
    """A torch Adam / AdamW / SGD from DeepSpeed's ``"optimizer"`` section."""
    kind = str(section.get("type", "")).lower()
    raw = dict(section.get("params", {}))
    for key in _IGNORED_KEYS:
        raw.pop(key, None)
    if kind in ("adam", "adamw"):
        # DeepSpeed's "Adam" decouples weight decay (AdamW) unless adam_w_mode is false.
        decoupled = bool(raw.pop("adam_w_mode", True)) if kind == "adam" else True
        cls, known = (torch.optim.AdamW if decoupled else torch.optim.Adam), _ADAM_KEYS
    elif kind == "sgd":
        cls, known = torch.optim.SGD, _SGD_KEYS
    else:
        raise ConfigError(f"optimizer.type={section.get('type')!r} is not one that megatron.optimizer_impl="
                          "'megatron' can build; use Adam, AdamW or SGD, pass a torch optimizer as optimizer=, "
                          "or set megatron.optimizer_impl to \"deepspeed\"")
    unknown = [k for k in raw if k not in known]
    if unknown:
        raise ConfigError(f"optimizer.params.{unknown[0]} is not a {cls.__name__} parameter; "
                          f"known: {', '.join(known)}")
    if "betas" in raw:
        raw["betas"] = tuple(raw["betas"])
    return cls(params, **raw)


def _cast_model_params(model: torch.nn.Module, dtype: torch.dtype, device) -> None:
    # In place (``param.data``) so that the Parameter objects, which the caller's
    # optimizer and LR scheduler already reference, stay the same objects.
    for p in model.parameters():
        p.grad = None
        p.data = p.data.to(device=device, dtype=dtype if p.is_floating_point() else p.dtype)


def _deepspeed_device():
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


def prepare_optimizer_path(ds_config: Dict[str, Any], megatron_config, model: Optional[torch.nn.Module],
                           optimizer, model_parameters, parallel_state=None) -> OptimizerPath:
    """Decide what ``deepspeed.initialize`` gets; with our path, cast the model and wrap the optimizer."""
    from .precision_config import precision_of
    precision = precision_of(ds_config, megatron_config)
    distributed_optimizer = bool(getattr(megatron_config, "use_distributed_optimizer", False))
    if distributed_optimizer and model is None:
        raise ConfigError("megatron.use_distributed_optimizer is true but no model= was given; the distributed "
                          "optimizer shards the model's grad buffers: pass model=")
    if not precision.owns_optimizer or model is None:
        return OptimizerPath(precision, dict(ds_config), optimizer, model_parameters)
    if isinstance(optimizer, MegatronOptimizer):
        raise ConfigError("optimizer= is already a Megatron optimizer wrapper; pass the plain torch optimizer "
                          "(ds_megatron.initialize wraps it) or set megatron.optimizer_impl to \"deepspeed\"")
    if optimizer is not None and "optimizer" in ds_config:
        raise ConfigError("both optimizer= and an \"optimizer\" config section were given; keep one")

    params_dtype = _DTYPES[precision.params_dtype]
    # Built before the cast so param groups reference the same Parameter objects the cast keeps.
    if optimizer is None and "optimizer" in ds_config:
        weight_decay = ds_config["optimizer"].get("params", {}).get("weight_decay", 0.0)
        params = model_parameters if model_parameters is not None else get_param_groups(model, weight_decay)
        optimizer = optimizer_from_section(ds_config["optimizer"], params)
    elif optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
    _cast_model_params(model, params_dtype, _deepspeed_device())

    hooks = []
    wrapped = None
    if distributed_optimizer:
        if optimizer is None:
            raise ConfigError("megatron.use_distributed_optimizer is true but there is no optimizer to shard; "
                              "add an \"optimizer\" section or pass optimizer= (a torch optimizer or a callable)")
        from ..distributed.distributed_data_parallel import DistributedDataParallel
        # Built now (params move into its param buffer, values kept): the optimizer is made from its buffers.
        ddp = DistributedDataParallel(model, megatron_config.ddp_config(), parallel_state)
        wrapped = get_megatron_optimizer(optimizer, precision, parallel_state, model_chunks=[ddp])
    elif optimizer is not None:
        groups = []
        if parallel_state is not None and parallel_state.ep.size > 1:
            groups.append(parallel_state.expert_mp.group)  # expert grads are reduced over EDP, not DP
        # Megatron DDP (ds_megatron.distributed), when enabled, owns the reduction itself.
        reduces = (params_dtype != torch.float32 and parallel_state is not None
                   and not getattr(megatron_config, "ddp_enabled", False))
        wrapped = get_megatron_optimizer(optimizer, precision, parallel_state, groups,
                                         grad_reduce_group=parallel_state.dp_cp.group if reduces else None)
    if params_dtype != torch.float32:
        scaler = wrapped.grad_scaler if wrapped is not None else None
        hooks = attach_float16_hooks(model, params_dtype, scaler)
    reduces = wrapped is not None and getattr(wrapped, "grad_reduce_group", None) is not None
    return OptimizerPath(precision, precision.deepspeed_view(ds_config), wrapped, model_parameters, hooks,
                         optimizer_reduces_grads=reduces)
