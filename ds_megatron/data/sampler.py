"""Which sample indices each data-parallel rank reads at each step (Megatron's samplers).

A step's global batch is ``micro_batch_size * data_parallel_size`` samples;
DP rank ``r`` takes the ``r``-th slice of ``micro_batch_size`` of them.  The
choice depends on the DP rank only, so every tensor/pipeline-parallel rank of
one model replica reads the same micro-batch, and different replicas read
disjoint ones.  ``consumed_samples`` (the global count already trained on, as
saved in a checkpoint) makes a resumed run continue exactly where it stopped,
also at another DP size or global batch: the next step starts at the next sample.
"""
from __future__ import annotations

from typing import Iterator, List

import torch


def _check(total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
           data_parallel_size: int) -> None:
    if total_samples < 1:
        raise ValueError(f"total_samples must be positive, got {total_samples}; the dataset is empty")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be positive, got {data_parallel_size}")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data_parallel_rank {data_parallel_rank} must be in [0, {data_parallel_size})")
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")


class MegatronPretrainingSampler:
    """Sequential batch sampler: step ``k`` covers global indices
    ``consumed + k*G .. consumed + (k+1)*G`` with ``G = micro_batch_size * data_parallel_size``.

    With ``drop_last=False`` a last, short global batch is split the same way
    (trailing ranks may then get a shorter or empty slice; empty ones are not yielded).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if consumed_samples >= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} >= total_samples {total_samples}: "
                             f"nothing left to read; raise the sample count (train_samples / epochs)")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last
        self.global_batch = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        if self.drop_last:
            return remaining // self.global_batch
        start = self.data_parallel_rank * self.micro_batch_size
        full, rest = divmod(remaining, self.global_batch)
        return full + (1 if rest > start else 0)

    def __iter__(self) -> Iterator[List[int]]:
        start = self.data_parallel_rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples, self.global_batch):
            last = min(first + self.global_batch, self.total_samples)
            if last - first < self.global_batch and self.drop_last:
                return
            batch = list(range(first + start, min(first + start + self.micro_batch_size, last)))
            if batch:
                yield batch


class MegatronPretrainingRandomSampler:
    """Shuffled batch sampler over endless epochs of a ``total_samples`` dataset (Megatron's "cyclic").

    Global position ``p`` reads sample ``order_e[p % total_samples]``, epoch ``e = p // total_samples`` drawing
    its order from ``seed + e``; step ``k`` covers positions ``consumed + k*G .. consumed + (k+1)*G`` and DP rank
    ``r`` takes the ``r``-th ``micro_batch_size`` of them, as ``MegatronPretrainingSampler`` does.  So the order
    depends on the dataset and the seed alone: not on the run's length, the DP size or the global batch, and
    ``consumed_samples`` resumes it at the same sample.  A global batch may straddle two epochs.  (Megatron's
    sampler gives each DP rank its own bucket and drops an epoch's last ``total_samples % G`` samples, so its
    order changes with the DP size and the global batch.)
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, seed: int = 1234):
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.seed = seed
        self.global_batch = micro_batch_size * data_parallel_size
        self._epoch, self._order = -1, None  # the order of the epoch read last

    def sample_at(self, position: int) -> int:
        """The dataset index read at global position ``position``."""
        epoch, k = divmod(position, self.total_samples)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.total_samples, generator=generator)
        return int(self._order[k])

    def __iter__(self) -> Iterator[List[int]]:
        start = self.data_parallel_rank * self.micro_batch_size
        while True:  # endless: the training loop takes the steps it needs
            first = self.consumed_samples + start
            batch = [self.sample_at(p) for p in range(first, first + self.micro_batch_size)]
            self.consumed_samples += self.global_batch
            yield batch


def build_data_loader(dataset, micro_batch_size: int, dp_rank: int, dp_size: int, consumed_samples: int = 0,
                      num_workers: int = 0, dataloader_type: str = "single", seed: int = 1234,
                      drop_last: bool = True, pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """A DataLoader over ``dataset`` that yields this DP rank's micro-batches.

    ``dataloader_type`` is Megatron's ``--dataloader-type``: ``"single"``
    (sequential) or ``"cyclic"`` (``MegatronPretrainingRandomSampler``, endless).
    ``pin_memory``: batches in page-locked memory, so a GPU job copies them asynchronously.
    """
    if dataloader_type == "single":
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                             dp_rank, dp_size, drop_last=drop_last)
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(len(dataset), consumed_samples, micro_batch_size,
                                                   dp_rank, dp_size, seed=seed)
    else:
        raise ValueError(f"dataloader_type {dataloader_type!r} is unknown; use \"single\" or \"cyclic\"")
    # Every DataLoader iterator draws a base seed from its generator; with none it would
    # draw from the default RNG and shift the dropout stream, so a resumed run (which
    # builds its iterator at a different point) would not replay the same masks.
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       persistent_workers=num_workers > 0, generator=generator, pin_memory=pin_memory)
