"""SFT samples over a packed SFT dataset (``ds-megatron preprocess --sft``, format in ``sft.py``).

Sample ``i`` is one packed row of ``seq_length`` tokens, its conversations side by side (Hugging Face's
"padding-free" convention): ``position_ids`` restart at 0 at each conversation and at the padding tail, which is
one more segment.  Inside a segment ``labels[j] = tokens[j + 1]`` and ``loss_mask[j] = 1`` exactly when token
``j + 1`` is trained; a segment's last position has loss 0 and the pad id as its label.  ``padding_mask`` marks the
padding tail (megatron-core's name: no document's tokens, left out of MoE routing losses).

The order depends only on the data, the split, ``seed`` and the epoch: epoch ``e`` is a permutation of the
split's rows drawn from ``numpy.random.RandomState([seed, e])``, and samples run through epoch 0, then 1, ..., so
``num_samples`` (a run's length) never changes which row sample ``i`` is.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import numpy as np
import torch

from .gpt_dataset import Split, split_range
from .indexed_dataset import IndexedDataset
from .sft import PADDING, TRAINED, PackedSFT


class PackedSFTDataset(torch.utils.data.Dataset):
    """The packed rows of one split of a packed SFT dataset, as training samples.

    ``indexed_dataset`` is the dataset's prefix or its ``IndexedDataset``; ``split`` a ``(start_frac, end_frac)``
    pair of the packed rows or a ``range`` of row numbers; ``num_samples=None`` is one epoch.  A ``seq_length``
    other than the one the data was packed for is refused.
    """

    def __init__(self, indexed_dataset: Union[str, IndexedDataset], seq_length: int,
                 num_samples: Optional[int] = None, seed: int = 1234, split: Split = (0.0, 1.0)):
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
            raise ValueError(f"num_samples must be a positive integer or None, got {num_samples!r}")
        if isinstance(indexed_dataset, str):
            self.packed = PackedSFT(indexed_dataset, seq_length)
        else:
            self.packed = PackedSFT(indexed_dataset.prefix, seq_length, tokens=indexed_dataset)
        self.seq_length, self.seed = seq_length, seed
        self.rows = split_range(split, self.packed.num_rows, "packed rows", self.packed.prefix)
        if len(self.rows) == 0:
            raise ValueError(f"split {split!r} holds none of the {self.packed.num_rows} packed rows of "
                             f"{self.packed.prefix!r}; widen the split or add data")
        self.num_samples = len(self.rows) if num_samples is None else num_samples
        self._orders: Dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def describe(self) -> str:
        """One line for the job's start: the data, its size, this set's samples."""
        return (f"{self.num_samples:,} samples of {self.seq_length} tokens from {self.packed.prefix} (packed SFT rows "
                f"{self.rows.start}..{self.rows.stop})")

    def row_of_sample(self, idx: int) -> int:
        """The packed row that sample ``idx`` reads."""
        epoch, k = divmod(idx, len(self.rows))
        if epoch not in self._orders:
            self._orders[epoch] = np.random.RandomState([self.seed, epoch]).permutation(len(self.rows))
        return self.rows.start + int(self._orders[epoch][k])

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not -self.num_samples <= idx < self.num_samples:
            raise IndexError(f"sample {idx} is out of range for {self.num_samples} samples")
        tokens, flags, segments = self.packed.row(self.row_of_sample(idx % self.num_samples))
        labels, loss_mask, position_ids = sample_targets(tokens, flags, segments, self.packed.pad_id)
        return {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(position_ids),
            # The row's tail: no document's, so left out of the MoE routing losses too (PackedSeqParams).
            "padding_mask": torch.from_numpy(flags == PADDING),
        }


def sample_targets(tokens: np.ndarray, flags: np.ndarray, segments: np.ndarray,
                   pad_id: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(labels, loss_mask, position_ids)`` of one packed row (rules in the module docstring)."""
    ends = np.cumsum(segments)
    position_ids = np.arange(len(tokens), dtype=np.int64) - np.repeat(ends - segments, segments)
    same_next = np.ones(len(tokens), dtype=bool)
    same_next[ends - 1] = False  # a segment's last token predicts nothing of its own
    labels = np.full(len(tokens), pad_id, dtype=np.int64)
    labels[:-1] = np.where(same_next[:-1], tokens[1:], pad_id)
    loss_mask = np.zeros(len(tokens), dtype=np.float32)
    loss_mask[:-1] = same_next[:-1] & (flags[1:] == TRAINED)
    return labels, loss_mask, position_ids
