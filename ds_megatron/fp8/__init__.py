"""FP8 linear layers: the recipe and its scaling state (``recipe``), quantization and the scaled GEMM
(``quantize``), the three GEMMs of a linear layer (``linear``), fp8 weights cast from fp32 main params
(``param``, Megatron's ``fp8_param_gather``)."""
from .linear import fp8_linear
from .recipe import FP8LinearState, FP8Recipe, delayed_scaling_groups, update_delayed_scaling

__all__ = ["FP8LinearState", "FP8Recipe", "delayed_scaling_groups", "fp8_linear", "update_delayed_scaling"]
