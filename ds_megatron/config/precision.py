"""Who owns precision and clipping, read from DeepSpeed's own config sections (pure Python, no torch).

Users keep writing DeepSpeed's ``"fp16"``, ``"bf16"`` and ``"gradient_clipping"``;
``"megatron": {"optimizer_impl": ...}`` picks who honors them:

* ``"megatron"`` (default): our optimizer path.  The config DeepSpeed itself
  sees has fp16/bf16 off, ``gradient_clipping`` 0 and no ``"optimizer"``
  section (we build that optimizer), because DeepSpeed would otherwise clip
  the still-scaled grads before our step, wrap our optimizer in its own, and
  refuse fp16 on CPUs.  Combinations that cannot work with it fail here, at
  start, with the field and the fix.
* ``"deepspeed"``: the config goes to DeepSpeed untouched (its FP16/BF16/ZeRO
  optimizers).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..errors import ConfigError
from .parsing import SECTION, deepspeed_section, unknown_key

OPTIMIZER_IMPLS = ("megatron", "deepspeed")

# DeepSpeed's defaults for these keys (deepspeed/runtime/precision_config.py, config.py).
FP16_DEFAULTS = {"loss_scale": 0.0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                 "min_loss_scale": 1.0}
DEFAULT_GRADIENT_CLIPPING = 1.0
# Keys of DeepSpeed's sections that only DeepSpeed's own optimizers implement: accepted
# with our path only at the value that means "off".
_FP16_OFF_ONLY = {"consecutive_hysteresis": False, "auto_cast": False, "fp16_master_weights_and_grads": False}
_FIX = f'set "{SECTION}": {{"optimizer_impl": "deepspeed"}} to use DeepSpeed\'s own optimizer'


@dataclass(frozen=True)
class PrecisionConfig:
    """The resolved precision settings of a job."""

    optimizer_impl: str = "megatron"
    params_dtype: str = "fp32"  # fp32 | fp16 | bf16
    loss_scale: float = 0.0  # fp16: > 0 constant scale, 0 dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    clip_grad: float = DEFAULT_GRADIENT_CLIPPING
    log_num_zeros_in_grad: bool = False

    @property
    def owns_optimizer(self) -> bool:
        """True when our path (not DeepSpeed's) runs precision, loss scaling and clipping."""
        return self.optimizer_impl == "megatron"

    @property
    def uses_loss_scaling(self) -> bool:
        return self.params_dtype == "fp16"

    @property
    def initial_scale(self) -> float:
        return self.loss_scale if self.loss_scale > 0 else float(2 ** self.initial_scale_power)

    def deepspeed_view(self, ds_config: Dict[str, Any]) -> Dict[str, Any]:
        """The config DeepSpeed should see: precision, clipping and the optimizer handed to us."""
        if not self.owns_optimizer:
            return copy.deepcopy(ds_config)
        view = {k: copy.deepcopy(v) for k, v in ds_config.items() if k not in ("fp16", "bf16", "bfloat16", "optimizer")}
        view["gradient_clipping"] = 0.0
        return view


def _number(where: str, value, minimum: float, integer: bool = False):
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value < minimum:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{where} must be {kind} >= {minimum}, got {value!r}")
    return value


def resolve_precision(ds_config: Dict[str, Any], optimizer_impl: str = "megatron",
                      log_num_zeros_in_grad: bool = False) -> PrecisionConfig:
    """Read and check ``fp16`` / ``bf16`` / ``gradient_clipping`` / ``zero_optimization`` for ``optimizer_impl``."""
    if optimizer_impl not in OPTIMIZER_IMPLS:
        raise ConfigError(f"{SECTION}.optimizer_impl={optimizer_impl!r} is unknown; use one of {OPTIMIZER_IMPLS}")
    fp16 = deepspeed_section(ds_config, "fp16")
    if "bf16" in ds_config and "bfloat16" in ds_config:
        raise ConfigError("both bf16 and bfloat16 are set (DeepSpeed treats them as one section); keep only bf16")
    bf16_key = "bfloat16" if "bfloat16" in ds_config else "bf16"
    bf16 = deepspeed_section(ds_config, bf16_key)
    fp16_on, bf16_on = bool(fp16.get("enabled", False)), bool(bf16.get("enabled", False))
    if fp16_on and bf16_on:
        raise ConfigError(f"fp16.enabled and {bf16_key}.enabled are both true; enable at most one of them")
    clip = ds_config.get("gradient_clipping", DEFAULT_GRADIENT_CLIPPING)
    clip = float(_number("gradient_clipping", clip, 0.0))
    dtype = "fp16" if fp16_on else "bf16" if bf16_on else "fp32"
    if optimizer_impl == "deepspeed":
        return PrecisionConfig(optimizer_impl, dtype, clip_grad=clip, log_num_zeros_in_grad=log_num_zeros_in_grad)

    stage = deepspeed_section(ds_config, "zero_optimization").get("stage", 0)
    if stage not in (0, False, None):
        raise ConfigError(f"zero_optimization.stage={stage!r} cannot be combined with "
                          f"{SECTION}.optimizer_impl='megatron' (ZeRO replaces the optimizer); set the stage to 0, "
                          f"or {_FIX}")
    for key in ("amp", "torch_autocast"):
        if deepspeed_section(ds_config, key).get("enabled", False):
            raise ConfigError(f"{key}.enabled is true with {SECTION}.optimizer_impl='megatron', which does its own "
                              f"mixed precision; turn {key} off and use fp16/bf16, or {_FIX}")
    data_types = deepspeed_section(ds_config, "data_types")
    if data_types.get("grad_accum_dtype") not in (None, "fp32"):
        raise ConfigError(f"data_types.grad_accum_dtype={data_types['grad_accum_dtype']!r} is not supported with "
                          f"{SECTION}.optimizer_impl='megatron' (main grads are fp32); remove it, or {_FIX}")
    for key in bf16:
        if key != "enabled":
            raise ConfigError(f"{bf16_key}.{key} is a DeepSpeed BF16-optimizer setting that "
                              f"{SECTION}.optimizer_impl='megatron' does not implement; remove it, or {_FIX}")
    values = dict(FP16_DEFAULTS)
    for key, value in fp16.items():
        if key == "enabled":
            continue
        if key in _FP16_OFF_ONLY:
            if value != _FP16_OFF_ONLY[key]:
                raise ConfigError(f"fp16.{key}={value!r} is a DeepSpeed FP16-optimizer setting that "
                                  f"{SECTION}.optimizer_impl='megatron' does not implement; remove it, or {_FIX}")
            continue
        if key not in values:
            raise unknown_key("fp16", key, ["enabled", *FP16_DEFAULTS, *_FP16_OFF_ONLY])
        values[key] = value
    _number("fp16.loss_scale", values["loss_scale"], 0.0)
    _number("fp16.initial_scale_power", values["initial_scale_power"], 0, integer=True)
    _number("fp16.loss_scale_window", values["loss_scale_window"], 1, integer=True)
    _number("fp16.hysteresis", values["hysteresis"], 1, integer=True)
    _number("fp16.min_loss_scale", values["min_loss_scale"], 1e-30)
    if fp16_on and values["loss_scale"] == 0 and values["min_loss_scale"] > 2 ** values["initial_scale_power"]:
        raise ConfigError(f"fp16.min_loss_scale={values['min_loss_scale']} exceeds the initial scale "
                          f"2**fp16.initial_scale_power={2 ** values['initial_scale_power']}; lower it or raise the power")
    return PrecisionConfig(optimizer_impl, dtype, loss_scale=float(values["loss_scale"]),
                           initial_scale_power=values["initial_scale_power"],
                           loss_scale_window=values["loss_scale_window"], hysteresis=values["hysteresis"],
                           min_loss_scale=float(values["min_loss_scale"]), clip_grad=clip,
                           log_num_zeros_in_grad=log_num_zeros_in_grad)
