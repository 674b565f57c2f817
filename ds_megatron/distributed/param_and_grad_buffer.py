"""``ParamAndGradBuffer``: one contiguous gradient buffer (and, with the distributed optimizer, param buffer).

All params of one (param dtype, grad dtype) pair share a buffer laid out by
``buffer_layout.build_buffer_layout``.  Each param gets ``param.main_grad``, a
view into ``grad_data`` at its mapped offset, where backward accumulates its
gradient over micro-batches; with the distributed optimizer ``param.data``
is re-pointed into ``param_data`` as well (values kept), so an all-gather of
the updated shards writes the params in place.  A ``ParamAndGradBucket`` is
the contiguous slice of both buffers that is reduced with one collective.

Building a buffer needs no process group (only the DP size), so layouts and
views can be checked on one process.
"""
from __future__ import annotations

from enum import Enum
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..config.ddp import DistributedDataParallelConfig
from ..fp8.param import make_fp8_param
from ..parallel_state import ParallelGroup
from .buffer_layout import BufferLayout, Range, build_buffer_layout


class BufferType(Enum):
    PARAM = 1
    GRAD = 2


class ParamAndGradBucket:
    """A contiguous slice of a buffer whose grads are reduced by one collective.

    ``param_to_index[param] = (start, end)`` relative to the bucket's start;
    ``offset`` is the bucket's start in the buffer.
    """

    def __init__(self, params: List[torch.nn.Parameter], param_data: Optional[torch.Tensor], grad_data: torch.Tensor,
                 offset: int, numel_unpadded: int, gradient_scaling_factor: float, bucket_id: int,
                 param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]]):
        self.params_list = params
        self.params = set(params)
        self.param_data = param_data
        self.grad_data = grad_data
        self.offset = offset
        self.numel_unpadded = numel_unpadded
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = bucket_id
        self.param_to_index = {p: (param_index_map[p][0] - offset, param_index_map[p][1] - offset) for p in params}

    def shard_range(self, dp_rank: int, dp_size: int) -> Range:
        """``dp_rank``'s slice of this bucket, relative to the bucket's start."""
        shard = self.grad_data.numel() // dp_size
        return Range(dp_rank * shard, (dp_rank + 1) * shard)


class ParamAndGradBuffer:
    """Grad (and param) storage for params of one (param_dtype, grad_dtype); see the module docstring.

    ``params`` in model order, reduced over ``data_parallel_group``;
    ``param_indices``: each param's index among all params of its dtype in the
    model (kept for checkpoint conversion, as in Megatron).
    """

    def __init__(self, ddp_config: DistributedDataParallelConfig, param_dtype: torch.dtype, grad_dtype: torch.dtype,
                 params: Sequence[torch.nn.Parameter], data_parallel_group: ParallelGroup,
                 bucket_size: Optional[int], gradient_scaling_factor: float,
                 param_indices: Optional[Sequence[int]] = None, param_to_name: Optional[Dict] = None,
                 fp8_recipes: Optional[Dict] = None):
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.params = list(params)
        self.data_parallel_group = data_parallel_group
        data_parallel_world_size = data_parallel_group.size
        self.data_parallel_world_size = data_parallel_world_size
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_indices = list(param_indices) if param_indices is not None else list(range(len(self.params)))
        self.param_to_name = param_to_name or {}
        if len(set(map(id, self.params))) != len(self.params):
            raise ValueError("a param appears twice in the list given to ParamAndGradBuffer; pass each param once")
        if (param_dtype == torch.uint8) != bool(fp8_recipes):
            raise ValueError("a uint8 buffer holds fp8 params and needs their recipes (fp8_recipes), and only it")
        for p in self.params:
            if p.dtype != param_dtype and not (fp8_recipes and p.dtype in (torch.float16, torch.bfloat16)):
                raise ValueError(f"param {self.param_to_name.get(p, tuple(p.shape))} has dtype {p.dtype}, "
                                 f"this buffer holds {param_dtype}; group params by dtype first")

        self.layout: BufferLayout = build_buffer_layout(
            [p.numel() for p in self.params], data_parallel_world_size, bucket_size,
            ddp_config.use_distributed_optimizer, ddp_config.pad_buckets_for_high_nccl_busbw,
            shared_embedding=[getattr(p, "shared_embedding", False) for p in self.params])
        self.param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]] = {
            p: self.layout.param_index_map[i] for i, p in enumerate(self.params)}
        self.bucket_indices: List[Tuple[int, int]] = list(self.layout.bucket_indices)
        self.per_bucket_numel_unpadded: List[int] = list(self.layout.per_bucket_numel_unpadded)
        self.numel = self.layout.numel
        self.numel_unpadded = self.layout.numel_unpadded

        device = self.params[0].device if self.params else torch.device("cpu")
        # Only the distributed optimizer needs params contiguous: it all-gathers them in place.
        self.param_data: Optional[torch.Tensor] = None
        if ddp_config.use_distributed_optimizer:
            self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device, requires_grad=False)
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device, requires_grad=False)

        for p in self.params:
            start, _, _ = self.param_index_map[p]
            if fp8_recipes:
                if self.param_data is None:
                    raise ValueError("fp8 params live in the distributed optimizer's param buffer; build the buffer "
                                     "with use_distributed_optimizer=True")
                make_fp8_param(p, self._get(p.shape, start, BufferType.PARAM), fp8_recipes[p])
            elif self.param_data is not None:
                old = p.data
                p.data = self._get(old.shape, start, BufferType.PARAM)
                p.data.copy_(old)
            p.main_grad = self._get(p.data.shape, start, BufferType.GRAD)

        self.buckets: List[ParamAndGradBucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, ParamAndGradBucket] = {}
        for b, (start, end) in enumerate(self.bucket_indices):
            bucket_params = [self.params[i] for i in self.layout.bucket_params[b]]
            bucket = ParamAndGradBucket(
                params=bucket_params,
                param_data=None if self.param_data is None else self.param_data[start:end],
                grad_data=self.grad_data[start:end], offset=start,
                numel_unpadded=self.per_bucket_numel_unpadded[b],
                gradient_scaling_factor=gradient_scaling_factor, bucket_id=b,
                param_index_map=self.param_index_map)
            self.buckets.append(bucket)
            for p in bucket_params:
                self.param_to_bucket[p] = bucket

    def _get(self, shape: torch.Size, start_index: int, buffer_type: BufferType) -> torch.Tensor:
        """A view of ``shape`` into the param or grad buffer starting at ``start_index``."""
        end_index = start_index + shape.numel()
        if end_index > self.numel:
            raise ValueError(f"view [{start_index}, {end_index}) runs past the buffer's {self.numel} elements")
        data = self.param_data if buffer_type is BufferType.PARAM else self.grad_data
        return data[start_index:end_index].view(shape)

    def reset(self) -> None:
        """Zero the whole grad buffer (one op) before a new accumulation window."""
        self.grad_data.zero_()

    def grad_shard(self, bucket_id: int, dp_rank: int) -> torch.Tensor:
        """``dp_rank``'s slice of a bucket's grads: what a reduce-scatter leaves reduced on that rank."""
        bucket = self.buckets[bucket_id]
        r = bucket.shard_range(dp_rank, self.data_parallel_world_size)
        return bucket.grad_data[r.start:r.end]

    def param_shard(self, bucket_id: int, dp_rank: int) -> torch.Tensor:
        """``dp_rank``'s slice of a bucket's params (distributed optimizer only): what it updates and gathers."""
        if self.param_data is None:
            raise ValueError("param_shard needs the param buffer, which exists only with use_distributed_optimizer")
        bucket = self.buckets[bucket_id]
        r = bucket.shard_range(dp_rank, self.data_parallel_world_size)
        return bucket.param_data[r.start:r.end]
