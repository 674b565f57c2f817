"""Models built from ds_megatron's tensor-parallel transformer blocks.

``GPTConfig`` is pure Python; ``GPTModel`` (torch) is imported on first use so
that validating a job config stays fast.
"""
from .gpt_config import GPTConfig


def __getattr__(name):
    if name == "GPTModel":
        from .gpt import GPTModel
        return GPTModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GPTConfig", "GPTModel"]
