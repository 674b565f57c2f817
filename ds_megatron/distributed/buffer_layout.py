"""Where each param's gradient (and, with the distributed optimizer, its value) lives in a contiguous buffer.

Pure arithmetic on element counts, no torch: ``build_buffer_layout`` gives the
index maps a ``ParamAndGradBuffer`` is allocated from, and
``bucket_shard_param_ranges`` gives the per-DP-rank slices the distributed
optimizer owns.  Both can be printed and property-tested without a process group.

The rules (Megatron-LM's ``_ParamAndGradBuffer``):

* Params are laid out in reverse model order, roughly the order backward
  produces their grads, so the first bucket is ready first.
* With the distributed optimizer every param starts at a multiple of 64
  elements (128-byte aligned for 16-bit data) and every bucket ends at a
  multiple of lcm(DP, 128) (or lcm(DP, 128, 2^16) for high NCCL bus bandwidth),
  so each bucket, and so the buffer, splits into DP equal shards.  Without it,
  nothing is padded.
* A param is never split across buckets; a bucket closes as soon as it holds
  >= ``bucket_size`` elements (``None``: one bucket for everything).
* With the distributed optimizer a shared-embedding param gets a bucket of its
  own, so the first and last pipeline stages shard its optimizer state the same way.
  The bucket before it closes at the shared param's 64-aligned start, so its
  unpadded size includes that alignment padding (megatron-core 0.16's
  ``numel_unpadded``, which ``tests/distributed/test_buffer_layout.py`` compares).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

PARAM_START_ALIGNMENT = 64  # elements: 128 bytes of >= 16-bit data
BUCKET_END_ALIGNMENT = 128  # elements: 256 bytes, also keeps cuBLAS on aligned algorithms
HIGH_BUSBW_ALIGNMENT = 2 ** 16  # NCCL ring message (bucket / DP) wants a large power of two


def pad(index: int, divisor: int) -> int:
    """The smallest multiple of ``divisor`` that is >= ``index``."""
    return int(math.ceil(index / divisor) * divisor)


def bucket_size_divisor(data_parallel_world_size: int, pad_buckets_for_high_nccl_busbw: bool = False) -> int:
    """What every bucket end is padded to with the distributed optimizer."""
    if pad_buckets_for_high_nccl_busbw:
        return math.lcm(data_parallel_world_size, BUCKET_END_ALIGNMENT, HIGH_BUSBW_ALIGNMENT)
    return math.lcm(data_parallel_world_size, BUCKET_END_ALIGNMENT)


@dataclass(frozen=True)
class Range:
    """Half-open [start, end) with Megatron's ``normalize`` (shift to start at a new origin)."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def normalize(self, start: int = 0) -> "Range":
        return Range(start, start + self.size)


@dataclass(frozen=True)
class BufferLayout:
    """The index maps of one buffer.  Params are identified by their position in the input list.

    ``param_index_map[i] = (start, end, bucket_id)`` in buffer elements;
    ``bucket_indices[b] = (start, end)`` including the bucket's end padding;
    ``bucket_params[b]`` lists param positions in layout (reverse) order.
    """

    param_index_map: Tuple[Tuple[int, int, int], ...]
    bucket_indices: Tuple[Tuple[int, int], ...]
    per_bucket_numel_unpadded: Tuple[int, ...]
    bucket_params: Tuple[Tuple[int, ...], ...]
    numel: int
    numel_unpadded: int
    data_parallel_world_size: int
    use_distributed_optimizer: bool

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_indices)

    def bucket_shard_ranges(self, bucket_id: int) -> List[Range]:
        """Each DP rank's slice of bucket ``bucket_id``, in buffer coordinates (rank order)."""
        start, end = self.bucket_indices[bucket_id]
        dp = self.data_parallel_world_size
        if (end - start) % dp:
            raise ValueError(f"bucket {bucket_id} has {end - start} elements, not divisible by DP={dp}; "
                             "only a distributed-optimizer layout is padded for sharding")
        shard = (end - start) // dp
        return [Range(start + r * shard, start + (r + 1) * shard) for r in range(dp)]

    def describe(self, names: Optional[Sequence[str]] = None) -> str:
        """A table: one line per bucket, then its params (layout order) with their ranges."""
        lines = [f"buffer: numel={self.numel} numel_unpadded={self.numel_unpadded} "
                 f"buckets={self.num_buckets} dp={self.data_parallel_world_size}"]
        for b, (start, end) in enumerate(self.bucket_indices):
            lines.append(f"  bucket {b}: [{start}, {end}) unpadded={self.per_bucket_numel_unpadded[b]}")
            for i in self.bucket_params[b]:
                s, e, _ = self.param_index_map[i]
                name = names[i] if names is not None else f"param {i}"
                lines.append(f"    {name}: [{s}, {e})")
        return "\n".join(lines)


def build_buffer_layout(param_numels: Sequence[int], data_parallel_world_size: int, bucket_size: Optional[int],
                        use_distributed_optimizer: bool, pad_buckets_for_high_nccl_busbw: bool = False,
                        shared_embedding: Optional[Sequence[bool]] = None) -> BufferLayout:
    """Lay out params (given in model order, as element counts) in one buffer; see the module docstring."""
    if data_parallel_world_size < 1:
        raise ValueError(f"data_parallel_world_size must be >= 1, got {data_parallel_world_size}")
    if bucket_size is not None and bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1 or None, got {bucket_size}")
    n = len(param_numels)
    shared = list(shared_embedding) if shared_embedding is not None else [False] * n
    if len(shared) != n:
        raise ValueError(f"shared_embedding has {len(shared)} flags for {n} params; give one per param")
    dp = data_parallel_world_size
    divisor = bucket_size_divisor(dp, pad_buckets_for_high_nccl_busbw)

    def pad_param_start(index: int) -> int:
        return pad(index, PARAM_START_ALIGNMENT) if use_distributed_optimizer else index

    def pad_bucket_end(index: int) -> int:
        return pad(index, divisor) if use_distributed_optimizer else index

    def needs_own_bucket(i: int) -> bool:
        return bool(shared[i]) and use_distributed_optimizer

    param_index_map: Dict[int, Tuple[int, int, int]] = {}
    bucket_indices: List[Tuple[int, int]] = []
    per_bucket_numel_unpadded: List[int] = []
    bucket_params: List[Tuple[int, ...]] = []
    current: List[int] = []
    bucket_start = 0
    param_start = 0
    param_end = 0

    def close_bucket(end_of_last_param: int) -> int:
        nonlocal bucket_start, current
        per_bucket_numel_unpadded.append(end_of_last_param - bucket_start)
        bucket_end = pad_bucket_end(end_of_last_param)
        bucket_indices.append((bucket_start, bucket_end))
        bucket_params.append(tuple(current))
        bucket_start, current = bucket_end, []
        return bucket_end

    for i in reversed(range(n)):
        numel = int(param_numels[i])
        if numel < 1:
            raise ValueError(f"param {i} has {numel} elements; every buffered param needs at least one")
        param_start = pad_param_start(param_start)
        if needs_own_bucket(i) and current:
            # Close what came before at this param's 64-aligned start, as megatron-core 0.16 does
            # (so that bucket's "unpadded" size counts the alignment padding after its last param:
            # numel_unpadded and per-bucket sizes equal megatron-core's).  The new bucket begins
            # where the padded old one ends, never inside it.
            param_start = close_bucket(param_start)
        param_end = param_start + numel
        param_index_map[i] = (param_start, param_end, len(bucket_indices))
        current.append(i)
        if (bucket_size is not None and param_end - bucket_start >= bucket_size) or needs_own_bucket(i):
            param_start = close_bucket(param_end)
        else:
            param_start = param_end
    if current:
        close_bucket(param_end)

    numel = bucket_indices[-1][1] if bucket_indices else 0
    numel_unpadded = sum(per_bucket_numel_unpadded)
    if use_distributed_optimizer:
        assert numel % dp == 0, (numel, dp)
    else:
        assert numel == numel_unpadded, (numel, numel_unpadded)
    return BufferLayout(
        param_index_map=tuple(param_index_map[i] for i in range(n)),
        bucket_indices=tuple(bucket_indices),
        per_bucket_numel_unpadded=tuple(per_bucket_numel_unpadded),
        bucket_params=tuple(bucket_params),
        numel=numel, numel_unpadded=numel_unpadded,
        data_parallel_world_size=dp, use_distributed_optimizer=use_distributed_optimizer)


@dataclass(frozen=True)
class ParamShardRanges:
    """Where the part of one param owned by one DP rank sits (Megatron's four ranges).

    ``gbuf_world``: in the whole buffer; ``gbuf_world_in_bucket``: in its bucket;
    ``gbuf_local``: in this rank's shard of the bucket; ``param``: in the flattened param.
    """

    gbuf_world: Range
    gbuf_world_in_bucket: Range
    gbuf_local: Range
    param: Range


def bucket_shard_param_ranges(layout: BufferLayout, bucket_id: int, dp_rank: int) -> Dict[int, ParamShardRanges]:
    """The params (by position) of bucket ``bucket_id`` that overlap ``dp_rank``'s shard, with their ranges.

    The shards ignore param boundaries, so a param may be cut between ranks;
    each rank reduces, updates and gathers only its own pieces.
    """
    shard = layout.bucket_shard_ranges(bucket_id)[dp_rank]
    bucket_start = layout.bucket_indices[bucket_id][0]
    out: Dict[int, ParamShardRanges] = {}
    for i in layout.bucket_params[bucket_id]:
        p_start, p_end, _ = layout.param_index_map[i]
        start, end = max(p_start, shard.start), min(p_end, shard.end)
        if start >= end:
            continue
        out[i] = ParamShardRanges(
            gbuf_world=Range(start, end),
            gbuf_world_in_bucket=Range(start - bucket_start, end - bucket_start),
            gbuf_local=Range(start - shard.start, end - shard.start),
            param=Range(start - p_start, end - p_start))
    return out
