"""ds_megatron: Megatron-LM's parallel machinery inside DeepSpeed's engine.

``ds_megatron.initialize`` is a drop-in for ``deepspeed.initialize`` that also
builds Megatron's process groups from the ``"megatron"`` section of the
DeepSpeed JSON config and hands DeepSpeed our mpu.

Importing the package loads neither torch nor DeepSpeed (the config, layout
and CLI checks are torch-free, so a bad config fails in a fraction of a
second): this module is a boundary, and each entry point below imports its
implementation when called.
"""
__version__ = "0.1.0"

from .config import ConfigError, MegatronConfig


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with Megatron's groups: see ``ds_megatron.integration.engine.initialize``."""
    from .integration.engine import initialize as _initialize  # boundary: torch and DeepSpeed load here
    return _initialize(*args, **kwargs)


def initialize_model_parallel(config):
    """Validate, start torch.distributed if needed and build every group: a ``ParallelState``."""
    from .integration.engine import initialize_model_parallel as _impl  # boundary: torch and DeepSpeed load here
    return _impl(config)


def validate_config(config, world_size=None):
    """Parse and check a DeepSpeed config with a ``"megatron"`` section against a world size, creating nothing."""
    from .integration.engine import validate_config as _validate_config  # boundary: torch and DeepSpeed load here
    return _validate_config(config, world_size)


def add_config_arguments(parser):
    """``deepspeed.add_config_arguments`` (``--deepspeed``, ``--deepspeed_config``)."""
    from .integration.engine import add_config_arguments as _impl  # boundary: torch and DeepSpeed load here
    return _impl(parser)


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
    """``engine.save_checkpoint`` plus MoE experts and the gathered distributed-optimizer state."""
    from .checkpointing.api import save_checkpoint as _impl  # boundary: torch and DeepSpeed load here
    return _impl(engine, save_dir, tag, client_state, save_latest, **kwargs)


def load_checkpoint(engine, load_dir, tag=None, **kwargs):
    """``engine.load_checkpoint`` plus MoE experts."""
    from .checkpointing.api import load_checkpoint as _impl  # boundary: torch and DeepSpeed load here
    return _impl(engine, load_dir, tag, **kwargs)


def save_dist_checkpoint(engine, directory, client_state=None):
    """The layout-independent checkpoint (``torch.distributed.checkpoint``; resumable at any TP / PP / EP / DP):
    see ``ds_megatron.checkpointing.torch_dist``.  Collective; ``directory`` is one checkpoint's."""
    from .checkpointing.api import save_dist_checkpoint as _impl  # boundary: torch and DeepSpeed load here
    return _impl(engine, directory, client_state)


def load_dist_checkpoint(engine, directory):
    """Read a ``save_dist_checkpoint`` directory written at any layout into ``engine``; returns the client state."""
    from .checkpointing.api import load_dist_checkpoint as _impl  # boundary: torch and DeepSpeed load here
    return _impl(engine, directory)


def from_pretrained(path, parallel_state=None, **options):
    """This rank's model (``GPTModel``, or with PP its ``GPTModelChunks``) built from a Hugging Face directory or
    one ``ds-megatron convert`` wrote, with its weights: see ``ds_megatron.checkpointing.pretrained``."""
    from .checkpointing.pretrained import from_pretrained as _impl  # boundary: torch and DeepSpeed load here
    return _impl(path, parallel_state, **options)


_PIPELINE_NAMES = ("GPTModelChunks", "GPTPipelineModule", "pipeline_topology")


def __getattr__(name):
    # The pipeline models (ours, and DeepSpeed's PipelineModule of the GPT): loaded on first use, like the entry
    # points above.
    if name in _PIPELINE_NAMES:
        from .integration import pipeline  # boundary: torch and DeepSpeed load here
        return getattr(pipeline, name)
    raise AttributeError(f"module 'ds_megatron' has no attribute {name!r}")


__all__ = ["ConfigError", "MegatronConfig", "initialize", "initialize_model_parallel", "validate_config",
           "add_config_arguments", "save_checkpoint", "load_checkpoint", "save_dist_checkpoint",
           "load_dist_checkpoint", "from_pretrained", *_PIPELINE_NAMES]
