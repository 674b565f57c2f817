"""Megatron's data-parallel gradient machinery: contiguous padded buffers, buckets, bucket groups, DDP wrapper.

``buffer_layout`` and ``ddp_config`` are pure Python; the rest imports torch
on first use, so that config validation stays torch-free.
"""
from .buffer_layout import (BufferLayout, ParamShardRanges, Range, bucket_shard_param_ranges,  # noqa: F401
                            bucket_size_divisor, build_buffer_layout, pad)
from .ddp_config import DistributedDataParallelConfig, default_bucket_size  # noqa: F401

_LAZY = {
    "ParamAndGradBuffer": "param_and_grad_buffer", "ParamAndGradBucket": "param_and_grad_buffer",
    "BufferType": "param_and_grad_buffer",
    "ParamAndGradBucketGroup": "bucket_group", "partition_buckets": "bucket_group",
    "DistributedDataParallel": "distributed_data_parallel", "is_expert_param": "distributed_data_parallel",
    "attach_megatron_ddp": "deepspeed_hooks", "MegatronDDPHooks": "deepspeed_hooks",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BufferLayout", "ParamShardRanges", "Range", "bucket_shard_param_ranges", "bucket_size_divisor",
           "build_buffer_layout", "pad", "DistributedDataParallelConfig", "default_bucket_size", *_LAZY]
