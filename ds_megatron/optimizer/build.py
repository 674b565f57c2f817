"""Building a job's optimizer: the torch optimizer from DeepSpeed's ``"optimizer"`` section, the grad
scaler from the precision settings, and the Megatron wrapper around them (``get_megatron_optimizer``)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from ..config.precision import PrecisionConfig
from ..distributed import DistributedDataParallel
from ..errors import ConfigError
from ..parallel_state import ParallelState
from .distrib_optimizer import DistributedOptimizer
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .megatron_optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer, MegatronOptimizer

# DeepSpeed "optimizer" params each torch optimizer accepts (DeepSpeed's names where they differ).
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "fused", "foreach")
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
_IGNORED_KEYS = ("torch_adam",)  # selects DeepSpeed's kernel, meaningless for a torch optimizer


def build_grad_scaler(precision: PrecisionConfig, device=None) -> Optional[MegatronGradScaler]:
    """Megatron's choice: a constant scaler for an explicit loss_scale, dynamic for fp16, none otherwise."""
    if precision.loss_scale > 0 and precision.params_dtype != "fp32":
        return ConstantGradScaler(precision.loss_scale, device=device)
    if precision.params_dtype == "fp16":
        return DynamicGradScaler(initial_scale=precision.initial_scale, min_scale=precision.min_loss_scale,
                                 growth_factor=2.0, backoff_factor=0.5, growth_interval=precision.loss_scale_window,
                                 hysteresis=precision.hysteresis, device=device)
    return None


def get_megatron_optimizer(optimizer: torch.optim.Optimizer, precision: PrecisionConfig,
                           parallel_state: Optional[ParallelState] = None,
                           model_chunks: Sequence[DistributedDataParallel] = ()) -> MegatronOptimizer:
    """Wrap a torch optimizer over the (already cast) model params in the matching Megatron wrapper.

    ``model_chunks``: the model's gradient buffers; the wrapper finishes their sync in ``step()``.
    Built with ``use_distributed_optimizer`` they make it a ``DistributedOptimizer`` (any precision).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = params[0].device if params else None
    common = dict(clip_grad=precision.clip_grad, log_num_zeros_in_grad=precision.log_num_zeros_in_grad,
                  grad_scaler=build_grad_scaler(precision, device), parallel_state=parallel_state)
    if model_chunks and model_chunks[0].ddp_config.use_distributed_optimizer:
        return DistributedOptimizer(optimizer, model_chunks, **common)
    if precision.params_dtype == "fp32":
        return FP32Optimizer(optimizer, model_chunks=model_chunks, **common)
    return Float16OptimizerWithFloat16Params(optimizer, model_chunks=model_chunks, **common)


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
    if cls is not torch.optim.SGD and "foreach" not in raw:
        # torch's fused kernel: the same update (bit-identical moments, params equal up to the rounding of the
        # last multiply-add; tests/optimizer/test_fused_adamw.py) at a quarter of the time on CPU, and DeepSpeed's
        # own Adam is fused too.  "foreach" or "fused": false in the section choose torch's other kernels.
        raw.setdefault("fused", True)
    return cls(params, **raw)
