"""Bucket groups: the unit of gradient reduction (and of param all-gather with the distributed optimizer).

A ``ParamAndGradBucketGroup`` holds one or more buckets, possibly from
different buffers, whose collectives are issued together as soon as every
param in them has its final gradient (``register_grad_ready`` on the last
micro-batch with ``overlap_grad_reduce``), or all at once in
``finish_grad_sync`` otherwise.  ``partition_buckets`` decides the grouping.

Averaging: each bucket is pre-scaled by its ``gradient_scaling_factor`` and
summed, or, with ``average_in_collective``, reduced with ``ReduceOp.AVG`` over
the group (gloo supports AVG for all-reduce and reduce-scatter) and then scaled
by the factor (1 for dense grads; edp/dp-cp for expert grads).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..config.ddp import DistributedDataParallelConfig
from ..parallel_state import ParallelGroup
from ..utils.collectives import AVG, SUM, all_gather_into, all_reduce, reduce_scatter_into
from .param_and_grad_buffer import ParamAndGradBucket, ParamAndGradBuffer


class ParamAndGradBucketGroup:
    """Buckets whose reductions start together; see the module docstring."""

    def __init__(self, buckets: List[ParamAndGradBucket], ddp_config: DistributedDataParallelConfig,
                 collective_group: ParallelGroup):
        self.buckets = buckets
        self.ddp_config = ddp_config
        self.collective_group = collective_group
        self.collective_group_size = collective_group.size
        self.params = set().union(*(b.params for b in buckets)) if buckets else set()
        self.params_with_grad = set()
        # False inside no_sync(): grads are still being accumulated, nothing is reduced.
        self.is_last_microbatch = True
        self.grad_reduce_handles: Optional[list] = None
        self.param_gather_handles: Optional[list] = None

    def reset(self) -> None:
        """Ready for the next accumulation window."""
        self.params_with_grad = set()
        self.is_last_microbatch = True

    def _rank(self) -> int:
        return self.collective_group.rank

    def start_grad_sync(self) -> None:
        """Issue this group's reductions (async): all-reduce, or reduce-scatter with the distributed optimizer."""
        if self.grad_reduce_handles is not None:
            raise RuntimeError("start_grad_sync called twice for one bucket group in one step; call "
                               "finish_grad_sync (or zero_grad_buffer) before starting another reduction")
        avg = self.ddp_config.average_in_collective
        op = AVG if avg else SUM
        handles = []
        for bucket in self.buckets:
            if not avg and bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
            if self.collective_group_size == 1:
                continue
            if self.ddp_config.use_distributed_optimizer:
                # In place: this rank's shard of the bucket receives the reduced values.
                r = bucket.shard_range(self._rank(), self.collective_group_size)
                handles.append(reduce_scatter_into(bucket.grad_data[r.start:r.end], bucket.grad_data,
                                                   self.collective_group, op=op, async_op=True))
            else:
                handles.append(all_reduce(bucket.grad_data, self.collective_group, op=op, async_op=True))
        self.grad_reduce_handles = handles

    def finish_grad_sync(self) -> None:
        """Wait for this group's reductions, starting them first if backward did not."""
        if self.grad_reduce_handles is None:
            self.start_grad_sync()
        for h in self.grad_reduce_handles:
            h.wait()
        self.grad_reduce_handles = None
        if self.ddp_config.average_in_collective:
            for bucket in self.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    self._reduced_part(bucket).mul_(bucket.gradient_scaling_factor)

    def _reduced_part(self, bucket: ParamAndGradBucket) -> torch.Tensor:
        if self.ddp_config.use_distributed_optimizer and self.collective_group_size > 1:
            r = bucket.shard_range(self._rank(), self.collective_group_size)
            return bucket.grad_data[r.start:r.end]
        return bucket.grad_data

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Called by the backward hook (``overlap_grad_reduce``): start the reduction once every grad is in."""
        if not self.ddp_config.overlap_grad_reduce:
            raise RuntimeError("register_grad_ready is only for overlap_grad_reduce=True")
        if not self.is_last_microbatch:
            return
        if param not in self.params:
            raise ValueError("param is not in this bucket group")
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params) and self.grad_reduce_handles is None:
            self.start_grad_sync()

    def start_param_sync(self, force_sync: bool = False) -> None:
        """(Distributed optimizer) all-gather each bucket's param shards into the full param buffer."""
        if not self.ddp_config.use_distributed_optimizer:
            raise RuntimeError("params are only all-gathered with use_distributed_optimizer=True")
        if self.param_gather_handles is not None:
            return
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        handles = []
        if self.collective_group_size > 1:
            for bucket in self.buckets:
                r = bucket.shard_range(self._rank(), self.collective_group_size)
                handles.append(all_gather_into(bucket.param_data, bucket.param_data[r.start:r.end],
                                               self.collective_group, async_op=async_op))
        self.param_gather_handles = [h for h in handles if h is not None] if async_op else None

    def finish_param_sync(self) -> None:
        for h in self.param_gather_handles or []:
            h.wait()
        self.param_gather_handles = None


def partition_buckets(buffers: Sequence[ParamAndGradBuffer],
                      force_single_bucket_group: bool = False) -> List[ParamAndGradBucketGroup]:
    """Group the buckets of ``buffers`` (all reduced over the same group) into bucket groups.

    * ``force_single_bucket_group``: everything in one group (one synchronization point).
    * No fp8 (uint8) buffer: one group per bucket.
    * With an fp8 buffer: one group per fp8 bucket, and all other buckets join the
      *last* fp8 group, because the last bucket covers the model's first layers:
      joining them to an earlier group would hold its reduction until backward
      reaches the first layers.
    """
    buffers = list(buffers)
    if not buffers:
        return []
    by_dtype = {}
    for buffer in buffers:
        if buffer.param_dtype in by_dtype:
            raise ValueError(f"two buffers hold param dtype {buffer.param_dtype}; partition_buckets takes the "
                             "buffers of one reduction group, one per param dtype")
        by_dtype[buffer.param_dtype] = buffer
    first = buffers[0]
    for buffer in buffers[1:]:
        if buffer.ddp_config != first.ddp_config or buffer.data_parallel_group != first.data_parallel_group:
            raise ValueError("partition_buckets got buffers with different configs or reduction groups; "
                             "partition dense and expert buffers separately")

    def group(buckets):
        return ParamAndGradBucketGroup(buckets, first.ddp_config, first.data_parallel_group)

    if force_single_bucket_group:
        return [group([b for buffer in buffers for b in buffer.buckets])]
    if torch.uint8 not in by_dtype:
        return [group([b]) for buffer in buffers for b in buffer.buckets]
    fp8_buckets = by_dtype[torch.uint8].buckets
    others = [b for buffer in buffers if buffer.param_dtype != torch.uint8 for b in buffer.buckets]
    return [group([b] + (others if i == len(fp8_buckets) - 1 else [])) for i, b in enumerate(fp8_buckets)]
