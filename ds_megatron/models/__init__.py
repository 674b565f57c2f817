"""Models built from ds_megatron's tensor-parallel transformer blocks."""
from .gpt import GPTConfig, GPTModel

__all__ = ["GPTConfig", "GPTModel"]
