"""The ``"megatron"`` section of a DeepSpeed JSON config: one typed tree, parsed once, torch-free.

| module | what it holds |
| --- | --- |
| ``megatron`` | ``MegatronConfig`` (the tree) and ``split_config`` (DeepSpeed config in, both parts out) |
| ``parallel`` | ``ParallelConfig``: sizes, order, sequence parallelism, vocab padding |
| ``ddp`` | ``DistributedDataParallelConfig``: Megatron's gradient-buffer switches |
| ``precision`` | ``PrecisionConfig``: fp16/bf16/clipping from DeepSpeed's own sections, and who honours them |
| ``cuda_graph`` | ``CudaGraphConfig`` |
| ``model``, ``training`` | ``GPTConfig``; ``TrainConfig`` and ``DataConfig`` of ``ds-megatron train`` |
| ``parsing`` | JSON into dataclasses with one-line errors; loading the file |

Nothing here imports torch or DeepSpeed, so a bad config fails in well under
a second, before any process group exists.
"""
from ..errors import ConfigError
from .cuda_graph import CUDA_GRAPH_IMPLS, CUDA_GRAPH_SCOPES, CudaGraphConfig
from .ddp import DistributedDataParallelConfig, default_bucket_size
from .megatron import MegatronConfig, split_config
from .model import GPTConfig
from .parallel import ParallelConfig
from .parsing import SECTION, load_ds_config, parse_section, world_size_from_env
from .precision import PrecisionConfig, resolve_precision
from .training import DataConfig, TrainConfig

__all__ = ["ConfigError", "CUDA_GRAPH_IMPLS", "CUDA_GRAPH_SCOPES", "CudaGraphConfig", "DistributedDataParallelConfig",
           "default_bucket_size", "MegatronConfig", "split_config", "GPTConfig", "ParallelConfig", "SECTION",
           "load_ds_config", "parse_section", "world_size_from_env", "PrecisionConfig", "resolve_precision",
           "DataConfig", "TrainConfig"]
