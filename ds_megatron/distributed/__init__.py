"""Megatron's data-parallel gradient machinery: contiguous padded buffers, buckets, bucket groups, DDP wrapper.

| module | concept |
| --- | --- |
| ``buffer_layout`` | pure index maps: where each param's grad lives, buckets, per-DP-rank shard ranges |
| ``param_and_grad_buffer`` | ``ParamAndGradBuffer`` / ``ParamAndGradBucket``: the tensors laid out that way |
| ``bucket_group`` | ``ParamAndGradBucketGroup``: the unit of (overlapped) reduction and param all-gather |
| ``distributed_data_parallel`` | ``DistributedDataParallel``: hooks, accumulation into ``main_grad``, ``no_sync`` |
| ``finalize_model_grads`` | the end of a step's gradient sync (DP buckets, then sequence-parallel grads over TP) |

The switches are ``ds_megatron.config.DistributedDataParallelConfig``.
"""
from ..config.ddp import DistributedDataParallelConfig, default_bucket_size
from .bucket_group import ParamAndGradBucketGroup, partition_buckets
from .buffer_layout import (BufferLayout, ParamShardRanges, Range, bucket_shard_param_ranges, bucket_size_divisor,
                            build_buffer_layout, pad)
from .distributed_data_parallel import DistributedDataParallel
from .finalize_model_grads import finalize_model_grads
from .param_and_grad_buffer import BufferType, ParamAndGradBucket, ParamAndGradBuffer

__all__ = ["DistributedDataParallelConfig", "default_bucket_size", "ParamAndGradBucketGroup", "partition_buckets",
           "BufferLayout", "ParamShardRanges", "Range", "bucket_shard_param_ranges", "bucket_size_divisor",
           "build_buffer_layout", "pad", "DistributedDataParallel", "finalize_model_grads", "BufferType",
           "ParamAndGradBucket", "ParamAndGradBuffer"]
