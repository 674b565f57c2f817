"""``DistributedDataParallelConfig``: the switches of Megatron's gradient buffers (pure, no torch).

Field names are Megatron-LM's and are the ``"megatron"`` section's keys too
(the section is read straight into this dataclass).  On the Megatron optimizer
path these buffers are the one gradient reducer; see ``ds_megatron.distributed``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError, check_positive_int
from .parsing import SECTION

# Megatron's default bucket: large enough that per-collective latency is amortized,
# growing with DP so that each rank's shard of a bucket stays >= 1M elements.
MIN_DEFAULT_BUCKET_SIZE = 40_000_000
DEFAULT_BUCKET_SIZE_PER_DP_RANK = 1_000_000


def default_bucket_size(data_parallel_world_size: int) -> int:
    """max(40,000,000, 1,000,000 x DP) elements."""
    return max(MIN_DEFAULT_BUCKET_SIZE, DEFAULT_BUCKET_SIZE_PER_DP_RANK * data_parallel_world_size)


@dataclass(frozen=True)
class DistributedDataParallelConfig:
    """How gradients are buffered, bucketed and reduced over data-parallel ranks."""

    # Accumulate and reduce grads in fp32.  None (the default): fp32 for fp16/bf16 params, as
    # Megatron's mixed-precision optimizer reduces fp32 main grads; false: in the params' dtype.
    grad_reduce_in_fp32: Optional[bool] = None
    # Start each bucket group's reduction during backward, as soon as all its grads are ready.
    overlap_grad_reduce: bool = False
    # (Distributed optimizer) all-gather updated params during the next forward.
    overlap_param_gather: bool = False
    # Reduce-scatter grads and keep params in one contiguous buffer, padded so every
    # bucket splits evenly over DP ranks.
    use_distributed_optimizer: bool = False
    # Elements per bucket; None = default_bucket_size(DP) when overlapping, one bucket otherwise.
    bucket_size: Optional[int] = None
    # Pad buckets to a multiple of 2^16 too (NCCL ring bus bandwidth at large DP).
    pad_buckets_for_high_nccl_busbw: bool = False
    # Average with the collective itself (ReduceOp.AVG) instead of pre-scaling by 1/DP.
    average_in_collective: bool = False
    # (Distributed optimizer, model.fp8) keep the fp8 layers' weights as fp8 bytes cast from the fp32 main params
    # after each step, and all-gather them in fp8 (Megatron's DistributedDataParallelConfig.fp8_param_gather).
    fp8_param_gather: bool = False

    def __post_init__(self):
        if self.bucket_size is not None:
            check_positive_int(f"{SECTION}.bucket_size", self.bucket_size)
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError(f"{SECTION}.overlap_param_gather is true but use_distributed_optimizer is false; params "
                              "are only all-gathered by the distributed optimizer: enable it or drop overlap_param_gather")
        if self.fp8_param_gather and not self.use_distributed_optimizer:
            raise ConfigError(f"{SECTION}.fp8_param_gather is true but use_distributed_optimizer is false; the fp8 "
                              "weights are cast from the distributed optimizer's fp32 main params: enable it or drop "
                              "fp8_param_gather")

    def grad_dtype_is_fp32(self, params_are_16bit: bool) -> bool:
        """Whether the grad buffer of params of this kind holds fp32."""
        return params_are_16bit if self.grad_reduce_in_fp32 is None else self.grad_reduce_in_fp32
