"""Partition arithmetic for tensor parallelism: exact division, vocab ranges (vocab padding is config's).

Pure functions, no process group needed, so the CLI and tests can call them
as they are.
"""
from __future__ import annotations

from typing import Optional, Tuple

from ..config.model import pad_vocab_size  # noqa: F401  (pure, shared with the planner)


def divide(numerator: int, denominator: int, what: Optional[str] = None) -> int:
    """``numerator // denominator``, refusing a remainder (a TP split must be exact).

    ``what`` names the quantity being split, for the error message."""
    name = f"{what}={numerator}" if what else str(numerator)
    if denominator <= 0:
        raise ValueError(f"cannot split {name} into {denominator} partitions; the partition count "
                         "must be a positive integer")
    if numerator % denominator != 0:
        raise ValueError(f"{name} is not divisible by {denominator}; use a multiple of {denominator} "
                         f"(the number of partitions, usually the tensor-parallel size) or change that size")
    return numerator // denominator


def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                              world_size: int) -> Tuple[int, int]:
    """``[start, end)`` of the vocab rows rank ``rank`` of ``world_size`` owns."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of size {world_size}")
    start = rank * per_partition_vocab_size
    return start, start + per_partition_vocab_size


def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
    """``[start, end)`` of the vocab rows rank ``rank`` owns when ``global_vocab_size`` is split evenly."""
    return vocab_range_from_per_partition_vocab_size(divide(global_vocab_size, world_size), rank, world_size)
