"""GPT pretraining samples cut from an indexed dataset, Megatron style.

Documents (the sequences of the ``IndexedDataset``) of one split are put in a
seeded random order per epoch and read as one token stream; sample ``i`` is
the ``seq_length + 1`` tokens starting at stream position ``i * seq_length``,
so a sample crosses document boundaries and shares its last token with the
next sample's first.  Three index arrays, named as in Megatron, describe it:

``doc_idx``
    the document order of the stream (all epochs back to back);
``sample_idx``
    ``[num_samples + 1, 2]``: row ``i`` is (position in ``doc_idx``, token
    offset) of the first token of sample ``i``; row ``i + 1`` is its last token;
``shuffle_idx``
    the order in which ``dataset[k]`` hands out samples.

Megatron computes these with a C++ helper and caches them on disk; numpy
vectorized over the stream builds them in milliseconds for the corpora we use,
so they live in memory only.  Shuffles use ``numpy.random.RandomState``,
whose streams numpy keeps stable across versions.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .indexed_dataset import IndexedDataset

Split = Union[Tuple[float, float], range]


def parse_split(split: Union[str, Sequence[float]]) -> List[float]:
    """``"98,2"`` or ``"949,50,1"`` (train, valid[, test] weights) as normalized fractions."""
    parts = split.split(",") if isinstance(split, str) else list(split)
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"split {split!r} is not a list of numbers; write it like \"98,2\" "
                         f"(train,valid) or \"949,50,1\" (train,valid,test)") from None
    if not 2 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"split {split!r} must be 2 or 3 non-negative weights with a positive sum, "
                         f"like \"98,2\" or \"949,50,1\"")
    total = sum(weights)
    return [w / total for w in weights]


def split_document_ranges(split: Union[str, Sequence[float]], num_documents: int) -> List[range]:
    """Disjoint, consecutive document ranges, one per split weight, covering all documents."""
    fractions = parse_split(split)
    bounds = [0]
    acc = 0.0
    for f in fractions:
        acc += f
        bounds.append(int(round(acc * num_documents)))
    bounds[-1] = num_documents
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


class GPTDataset(torch.utils.data.Dataset):
    """Fixed-length samples over the documents of one split of ``indexed_dataset``.

    ``split`` picks the documents: a ``(start_frac, end_frac)`` pair of the
    document count, or a ``range`` of document numbers.  ``num_samples=None``
    takes every full sample of one pass; a larger ``num_samples`` adds epochs,
    each in a new document order.
    """

    def __init__(self, indexed_dataset: IndexedDataset, seq_length: int, num_samples: Optional[int] = None,
                 seed: int = 1234, split: Split = (0.0, 1.0)):
        if not isinstance(seq_length, int) or seq_length < 1:
            raise ValueError(f"seq_length must be a positive integer, got {seq_length!r}")
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
            raise ValueError(f"num_samples must be a positive integer or None, got {num_samples!r}")
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        self.seed = seed
        self.documents = self._documents(indexed_dataset, split)
        # Sequence numbers of the split: a document is doc_idx[d] .. doc_idx[d+1].
        doc_bounds = np.asarray(indexed_dataset.doc_idx, dtype=np.int64)
        first, last = int(doc_bounds[self.documents.start]), int(doc_bounds[self.documents.stop])
        sequences = np.arange(first, last, dtype=np.int64)
        tokens_per_epoch = int(np.asarray(indexed_dataset.sizes)[first:last].sum(dtype=np.int64))
        if tokens_per_epoch < seq_length + 1:
            raise ValueError(f"documents {self.documents.start}..{self.documents.stop} of "
                             f"{indexed_dataset.prefix!r} hold {tokens_per_epoch} tokens, fewer than "
                             f"seq_length + 1 = {seq_length + 1}; lower seq_length or add data")
        per_epoch = (tokens_per_epoch - 1) // seq_length
        if num_samples is None:
            num_samples = per_epoch
        # Fewest epochs whose stream holds num_samples * seq_length + 1 tokens.
        num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
        self.num_samples = num_samples
        self.num_epochs = num_epochs
        rng = np.random.RandomState(seed)
        orders = []
        for _ in range(num_epochs):
            order = sequences.copy()
            rng.shuffle(order)
            orders.append(order)
        self.doc_idx = np.concatenate(orders)
        self.sample_idx = self._build_sample_idx()
        self.shuffle_idx = np.arange(num_samples, dtype=np.int64)
        rng.shuffle(self.shuffle_idx)

    @staticmethod
    def _documents(indexed_dataset: IndexedDataset, split: Split) -> range:
        n = indexed_dataset.num_documents
        if isinstance(split, range):
            if split.step != 1 or not 0 <= split.start <= split.stop <= n:
                raise ValueError(f"split {split!r} must be a contiguous range inside the {n} documents "
                                 f"of {indexed_dataset.prefix!r}")
            return split
        start, end = split
        if not 0.0 <= start <= end <= 1.0:
            raise ValueError(f"split {split!r} must be fractions 0 <= start <= end <= 1 of the documents")
        return range(int(round(start * n)), int(round(end * n)))

    def _build_sample_idx(self) -> np.ndarray:
        lengths = np.asarray(self.indexed_dataset.sizes, dtype=np.int64)[self.doc_idx]
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        positions = np.arange(self.num_samples + 1, dtype=np.int64) * self.seq_length
        # The last document starting at or before the position: skips empty documents.
        which = np.searchsorted(starts, positions, side="right") - 1
        return np.stack([which, positions - starts[which]], axis=1)

    def __len__(self) -> int:
        return self.num_samples

    def get_sample_tokens(self, sample: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``sample`` in stream order (before shuffling)."""
        (doc_f, off_f), (doc_l, off_l) = self.sample_idx[sample], self.sample_idx[sample + 1]
        get = self.indexed_dataset.get
        if doc_f == doc_l:
            return np.asarray(get(int(self.doc_idx[doc_f]), int(off_f), int(off_l - off_f + 1)), dtype=np.int64)
        parts = [get(int(self.doc_idx[doc_f]), int(off_f))]
        parts += [get(int(self.doc_idx[d])) for d in range(doc_f + 1, doc_l)]
        parts.append(get(int(self.doc_idx[doc_l]), 0, int(off_l + 1)))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not -self.num_samples <= idx < self.num_samples:
            raise IndexError(f"sample {idx} is out of range for {self.num_samples} samples")
        text = torch.from_numpy(self.get_sample_tokens(int(self.shuffle_idx[idx])))
        return {
            "tokens": text[:-1].contiguous(),
            "labels": text[1:].contiguous(),
            # Samples are cut from a continuous stream, so no position is padding.
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
        }


def build_train_valid_datasets(prefix: str, seq_length: int, split: str = "98,2", seed: int = 1234,
                               train_samples: Optional[int] = None, valid_samples: Optional[int] = None
                               ) -> Tuple[GPTDataset, Optional[GPTDataset]]:
    """Train and valid ``GPTDataset``s over disjoint document ranges of ``prefix``.

    ``split`` weights documents as in Megatron's ``--split``; a third (test)
    weight keeps those documents out of both sets.  A zero valid weight gives
    ``None`` for valid.
    """
    indexed = IndexedDataset(prefix)
    ranges = split_document_ranges(split, indexed.num_documents)
    fractions = parse_split(split)
    train_docs, valid_docs = ranges[0], ranges[1]
    if len(train_docs) == 0:
        raise ValueError(f"split {split!r} leaves no train documents out of {indexed.num_documents} "
                         f"in {prefix!r}; raise the train weight or add documents")
    train = GPTDataset(indexed, seq_length, train_samples, seed, split=train_docs)
    if fractions[1] == 0:
        return train, None
    if len(valid_docs) == 0:
        raise ValueError(f"split {split!r} leaves no valid documents out of {indexed.num_documents} "
                         f"in {prefix!r}; raise the valid weight, add documents, or use a 0 valid weight")
    valid = GPTDataset(indexed, seq_length, valid_samples, seed, split=valid_docs)
    return train, valid
