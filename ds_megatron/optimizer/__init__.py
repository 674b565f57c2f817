"""Megatron's optimizer path: grad scalers, fp32 main params, clipping by the true global norm.

Imports are lazy so that the pure modules (``precision_config``) can be used by
config validation and ``ds-megatron plan`` without importing torch.
"""
from importlib import import_module

_EXPORTS = {
    "clip_grad_by_total_norm_fp32": "clip_grads", "get_grad_norm_fp32": "clip_grads", "grads_for_norm": "clip_grads",
    "count_zeros_fp32": "clip_grads",
    "MegatronGradScaler": "grad_scaler", "ConstantGradScaler": "grad_scaler", "DynamicGradScaler": "grad_scaler",
    "MegatronOptimizer": "megatron_optimizer", "Float16OptimizerWithFloat16Params": "megatron_optimizer",
    "FP32Optimizer": "megatron_optimizer",
    "DistributedOptimizer": "distrib_optimizer",
    "get_param_groups": "param_groups",
    "PrecisionConfig": "precision_config", "resolve_precision": "precision_config", "precision_of": "precision_config",
    "get_megatron_optimizer": "deepspeed_integration",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
