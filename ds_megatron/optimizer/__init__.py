"""Megatron's optimizer path: grad scalers, fp32 main params, clipping by the true global norm.

| module | concept |
| --- | --- |
| ``grad_scaler`` | ``ConstantGradScaler``, ``DynamicGradScaler`` (hysteresis) |
| ``megatron_optimizer`` | ``MegatronOptimizer``, ``Float16OptimizerWithFloat16Params``, ``FP32Optimizer`` |
| ``distrib_optimizer`` | ``DistributedOptimizer``: main params and state sharded over DP |
| ``clip_grads`` | the true global norm across model-parallel ranks, clipping, zero counting |
| ``float16_module`` | Megatron's ``Float16Module`` as hooks: input/output casts and the loss-scale seam |
| ``param_groups`` | the weight-decay rule (no decay for biases and norm weights) |
| ``build`` | the torch optimizer from DeepSpeed's ``"optimizer"`` section, the scaler, ``get_megatron_optimizer`` |

The wrappers reduce no gradient: the model's buffers do (``ds_megatron.distributed``),
finished by ``finalize_model_grads`` at the start of ``step()``.
"""
from .build import build_grad_scaler, get_megatron_optimizer, optimizer_from_section
from .clip_grads import clip_grad_by_total_norm_fp32, count_zeros_fp32, get_grad_norm_fp32, grads_for_norm
from .distrib_optimizer import DistributedOptimizer
from .float16_module import attach_float16_hooks
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .megatron_optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer, MegatronOptimizer
from .param_groups import get_param_groups

__all__ = ["build_grad_scaler", "get_megatron_optimizer", "optimizer_from_section", "clip_grad_by_total_norm_fp32",
           "count_zeros_fp32", "get_grad_norm_fp32", "grads_for_norm", "DistributedOptimizer", "attach_float16_hooks",
           "ConstantGradScaler", "DynamicGradScaler", "MegatronGradScaler", "Float16OptimizerWithFloat16Params",
           "FP32Optimizer", "MegatronOptimizer", "get_param_groups"]
