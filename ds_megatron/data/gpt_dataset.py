"""GPT pretraining samples cut from an indexed dataset, Megatron style, in an order a run's length cannot change.

Documents (the sequences of the ``IndexedDataset``) of one split are put in a
seeded random order per epoch and read as one token stream, epoch 0's
documents, then epoch 1's, ...; sample ``i`` is the ``seq_length + 1`` tokens
starting at stream position ``i * seq_length``, so a sample crosses document
boundaries and shares its last token with the next sample's first.  Three
index arrays, named as in Megatron, describe it:

``doc_idx``
    the document order of the stream (all epochs back to back);
``sample_idx``
    ``[num_built + 1, 2]``: row ``i`` is (position in ``doc_idx``, token
    offset) of the first token of sample ``i``; row ``i + 1`` is its last token;
``shuffle_idx``
    the order in which ``dataset[k]`` hands out samples.

The order is a function of the data, the split, ``seq_length`` and ``seed``
alone: epoch ``e``'s document order comes from a generator seeded by
``(seed, e)``, and the shuffle permutes fixed blocks of ``samples_per_epoch``
samples (block ``b`` from a generator seeded by ``(seed, b)``).  A larger
``num_samples`` only appends epochs and blocks, so ``dataset[k]`` is the same
sample in a 20-step run and in a 30-step one.  Megatron instead shuffles all
of a run's samples together (and its last epoch apart), so its order depends on
the run's length: a run extended later would see other samples.

Each sample carries Megatron's ``loss_mask`` and, with ``reset_position_ids``,
its ``position_ids`` (``_get_ltor_masks_and_position_ids``): the positions
restart at 0 after every end-of-document token (the EOD belongs to the
document it ends), which is also where a model that reads documents from
restarting positions cuts attention (``reset_attention_mask``); with
``eod_mask_loss`` no position whose input is the EOD is trained.  Without the
resets a sample is one document's run of tokens to the model and carries no
position ids (it would read them on the host to find no boundary).

Megatron computes the indices with a C++ helper and caches them on disk; numpy
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

# The first key of each generator: document orders and sample blocks draw from different streams.
_DOCUMENT_ORDER, _SAMPLE_ORDER = 0, 1


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


def split_fractions(split: Union[str, Sequence[float]]) -> List[Tuple[float, float]]:
    """``(start, end)`` fractions of the documents, one pair per split weight: consecutive, the last ending at 1."""
    bounds = [0.0]
    for f in parse_split(split):
        bounds.append(bounds[-1] + f)
    bounds[-1] = 1.0
    return list(zip(bounds[:-1], bounds[1:]))


def split_document_ranges(split: Union[str, Sequence[float]], num_documents: int) -> List[range]:
    """Disjoint, consecutive document ranges, one per split weight, covering all documents."""
    return [fraction_range(pair, num_documents) for pair in split_fractions(split)]


def fraction_range(pair: Tuple[float, float], n: int, items: str = "documents") -> range:
    """The items ``round(start * n) .. round(end * n)`` of ``n``: what a ``(start, end)`` split pair selects."""
    start, end = pair
    if not 0.0 <= start <= end <= 1.0:
        raise ValueError(f"split {pair!r} must be fractions 0 <= start <= end <= 1 of the {items}")
    return range(int(round(start * n)), int(round(end * n)))


def split_range(split: Split, n: int, items: str, prefix: str) -> range:
    """What ``split`` selects of ``n`` ``items`` of the dataset at ``prefix``: a ``(start, end)`` fraction pair
    (``fraction_range``) or a ``range`` of them, checked."""
    if isinstance(split, range):
        if split.step != 1 or not 0 <= split.start <= split.stop <= n:
            raise ValueError(f"split {split!r} must be a contiguous range inside the {n} {items} of {prefix!r}")
        return split
    return fraction_range(split, n, items)


def ltor_position_ids_and_loss_mask(tokens: np.ndarray, eod: Optional[int], reset_position_ids: bool,
                                    eod_mask_loss: bool) -> Tuple[np.ndarray, np.ndarray]:
    """``(position_ids, loss_mask)`` of one sample's input ``tokens`` by Megatron's rules (see the module docstring)."""
    positions = np.arange(len(tokens), dtype=np.int64)
    loss_mask = np.ones(len(tokens), dtype=np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    if not reset_position_ids:
        return positions, loss_mask
    starts = np.zeros(len(tokens), dtype=bool)
    starts[0] = True
    starts[1:] = tokens[:-1] == eod  # a document starts after each EOD
    return positions - np.maximum.accumulate(np.where(starts, positions, 0)), loss_mask


class GPTDataset(torch.utils.data.Dataset):
    """Fixed-length samples over the documents of one split of ``indexed_dataset``.

    ``split`` picks the documents: a ``(start_frac, end_frac)`` pair of the
    document count, or a ``range`` of document numbers.  ``samples_per_epoch``
    is the number of full samples one pass gives; ``num_samples=None`` takes
    that many, a larger ``num_samples`` reads on into more epochs, each in a new
    document order.  ``eod`` (the tokenizer's end-of-document id) is needed by
    ``reset_position_ids`` and ``eod_mask_loss``.  ``document_fields``: samples carry ``position_ids`` and
    ``padding_mask`` even without ``reset_position_ids`` (batched with packed data in a blend); with it they always do.
    """

    def __init__(self, indexed_dataset: IndexedDataset, seq_length: int, num_samples: Optional[int] = None,
                 seed: int = 1234, split: Split = (0.0, 1.0), *, eod: Optional[int] = None,
                 reset_position_ids: bool = False, eod_mask_loss: bool = False, document_fields: bool = False):
        if not isinstance(seq_length, int) or seq_length < 1:
            raise ValueError(f"seq_length must be a positive integer, got {seq_length!r}")
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
            raise ValueError(f"num_samples must be a positive integer or None, got {num_samples!r}")
        if not 0 <= seed < 2 ** 32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        if (reset_position_ids or eod_mask_loss) and eod is None:
            raise ValueError("reset_position_ids and eod_mask_loss need the end-of-document id: pass eod")
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        self.seed = seed
        self.eod, self.reset_position_ids, self.eod_mask_loss = eod, reset_position_ids, eod_mask_loss
        self.document_fields = document_fields or reset_position_ids
        self.documents = split_range(split, indexed_dataset.num_documents, "documents", indexed_dataset.prefix)
        if len(self.documents) == 0:
            raise ValueError(f"split {split!r} selects none of the {indexed_dataset.num_documents} documents of "
                             f"{indexed_dataset.prefix!r}; widen the split or add documents")
        # Sequence numbers of the split: a document is doc_idx[d] .. doc_idx[d+1].
        doc_bounds = np.asarray(indexed_dataset.doc_idx, dtype=np.int64)
        first, last = int(doc_bounds[self.documents.start]), int(doc_bounds[self.documents.stop])
        self._sequences = np.arange(first, last, dtype=np.int64)
        self.tokens_per_epoch = int(np.asarray(indexed_dataset.sizes)[first:last].sum(dtype=np.int64))
        if self.tokens_per_epoch < seq_length + 1:
            raise ValueError(f"documents {self.documents.start}..{self.documents.stop} of "
                             f"{indexed_dataset.prefix!r} hold {self.tokens_per_epoch} tokens, fewer than "
                             f"seq_length + 1 = {seq_length + 1}; lower seq_length or add data")
        self.samples_per_epoch = (self.tokens_per_epoch - 1) // seq_length
        self.num_samples = self.samples_per_epoch if num_samples is None else num_samples
        # Whole shuffle blocks, so that every sample a block may hand out exists.
        blocks = -(-self.num_samples // self.samples_per_epoch)
        num_built = blocks * self.samples_per_epoch
        # Fewest epochs whose stream holds the built samples' num_built * seq_length + 1 tokens.
        self.num_epochs = -(-(num_built * seq_length + 1) // self.tokens_per_epoch)
        self.doc_idx = np.concatenate([self._epoch_order(e) for e in range(self.num_epochs)])
        self.sample_idx = self._build_sample_idx(num_built)
        self.shuffle_idx = np.concatenate([b * self.samples_per_epoch + self._block_order(b)
                                           for b in range(blocks)])[:self.num_samples]

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.RandomState([self.seed, _DOCUMENT_ORDER, epoch]).permutation(self._sequences)

    def _block_order(self, block: int) -> np.ndarray:
        return np.random.RandomState([self.seed, _SAMPLE_ORDER, block]).permutation(self.samples_per_epoch)

    def _build_sample_idx(self, num_built: int) -> np.ndarray:
        lengths = np.asarray(self.indexed_dataset.sizes, dtype=np.int64)[self.doc_idx]
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        positions = np.arange(num_built + 1, dtype=np.int64) * self.seq_length
        # The last document starting at or before the position: skips empty documents.
        which = np.searchsorted(starts, positions, side="right") - 1
        return np.stack([which, positions - starts[which]], axis=1)

    def __len__(self) -> int:
        return self.num_samples

    def describe(self) -> str:
        """One line for the job's start: the data, its size, this set's samples."""
        return (f"{self.num_samples:,} samples of {self.seq_length} tokens from {self.indexed_dataset.prefix} "
                f"(documents {self.documents.start}..{self.documents.stop}: {self.tokens_per_epoch:,} tokens, "
                f"{self.samples_per_epoch:,} samples a pass)")

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
        text = self.get_sample_tokens(int(self.shuffle_idx[idx]))
        tokens = text[:-1]
        position_ids, loss_mask = ltor_position_ids_and_loss_mask(tokens, self.eod, self.reset_position_ids,
                                                                  self.eod_mask_loss)
        sample = {
            "tokens": torch.from_numpy(tokens.copy()),
            "labels": torch.from_numpy(text[1:].copy()),
            "loss_mask": torch.from_numpy(loss_mask),
        }
        if self.document_fields:  # what a model keeps documents apart by (a row of one needs none: no host read)
            sample["position_ids"] = torch.from_numpy(position_ids)
            sample["padding_mask"] = torch.zeros(len(tokens), dtype=torch.bool)
        return sample
