"""Models built from ds_megatron's tensor-parallel transformer blocks (``GPTConfig`` lives in ``ds_megatron.config``)."""
from ..config.model import GPTConfig
from .gpt import GPTModel

__all__ = ["GPTConfig", "GPTModel"]
