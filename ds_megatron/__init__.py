"""ds_megatron: Megatron-LM's parallel machinery inside DeepSpeed's engine.

``ds_megatron.initialize`` is a drop-in for ``deepspeed.initialize`` that also
builds Megatron's process groups from the ``"megatron"`` section of the
DeepSpeed JSON config and hands DeepSpeed our mpu.
"""
__version__ = "0.1.0"

from .config import ConfigError, MegatronConfig  # noqa: E402  (pure, cheap)


def __getattr__(name):
    # The engine pulls in torch and DeepSpeed; import it on first use so that
    # `import ds_megatron` and config validation stay fast.
    if name in ("initialize", "initialize_model_parallel", "validate_config", "add_config_arguments"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'ds_megatron' has no attribute {name!r}")


__all__ = ["ConfigError", "MegatronConfig", "initialize", "initialize_model_parallel", "validate_config",
           "add_config_arguments"]
