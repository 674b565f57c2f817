"""Several datasets read as one, in Megatron's blend: each sample comes from the dataset furthest behind its share.

Megatron's blending indices (``build_blending_indices`` in megatron/core/datasets/helpers.cpp): with the
weights normalized to sum 1, sample ``i`` goes to the dataset ``d`` with the largest
``weights[d] * max(i, 1) - counts[d]`` (the first such ``d`` on a tie, in float64), where ``counts[d]`` is how
many samples ``d`` gave before; ``dataset_index[i] = d`` and ``dataset_sample_index[i] = counts[d]``.  So the
realized mix follows the weights at every prefix of a run, and the indices of ``n`` samples are the first ``n``
of those of any longer run: they depend on the weights alone.  The members are sized to exactly what the
blend draws from them, since a member's sample ``k`` does not depend on its size (``gpt_dataset``).

The indices are cached on disk, keyed by the hash of the blend's description (its members and weights:
Megatron's ``path_to_cache`` idea), in one ``[n, 2]`` ``.npy`` (``dataset_index``, ``dataset_sample_index``)
read memory-mapped: a restart reads them, and a longer run extends the cached ones from where they end.
Megatron's C++ loop is a Python loop here, about 0.2 s per million samples of a two-dataset blend.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

INDICES_SUFFIX = "-BlendedDataset-indices.npy"
DESCRIPTION_SUFFIX = "-BlendedDataset-description.json"


def normalize(weights: Sequence[float]) -> np.ndarray:
    """``weights / sum(weights)`` in float64 (Megatron's ``normalize``)."""
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def build_blending_indices(weights: np.ndarray, size: int, done: Optional[np.ndarray] = None) -> np.ndarray:
    """``[size, 2]`` int64 rows ``(dataset_index, dataset_sample_index)`` for normalized ``weights`` (module
    docstring); ``done``: the rows of a shorter blend of the same weights, which the result extends."""
    start = 0 if done is None else len(done)
    out = np.empty((max(size, start), 2), dtype=np.int64)
    counts = [0] * len(weights)
    if start:
        out[:start] = done
        counts = np.bincount(done[:, 0], minlength=len(weights)).tolist()
    w = [float(x) for x in weights]
    others = range(1, len(w))
    for i in range(start, size):
        x = float(max(i, 1))
        best, best_error = 0, w[0] * x - counts[0]
        for d in others:
            error = w[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
        out[i, 0], out[i, 1] = best, counts[best]
        counts[best] += 1
    return out[:size]


def _write_atomic(path: str, write: Callable[[Any], None]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _read_cache(indices_path: str, description_path: str, text: str) -> Optional[np.ndarray]:
    """The cached rows (memory-mapped) when both files are there and describe this blend, else None."""
    if not (os.path.isfile(indices_path) and os.path.isfile(description_path)):
        return None
    with open(description_path, encoding="utf-8") as f:
        if f.read() != text:
            return None
    try:
        cached = np.load(indices_path, mmap_mode="r")
    except ValueError:  # not a .npy: built again
        return None
    return cached if cached.ndim == 2 and cached.shape[1] == 2 and cached.dtype == np.int64 else None


def blending_indices(weights: np.ndarray, size: int, cache_dir: Optional[str] = None,
                     description: Optional[Dict[str, Any]] = None, write_cache: bool = True) -> np.ndarray:
    """``build_blending_indices`` through the cache in ``cache_dir`` (None: no cache).

    ``description`` (JSON) names the blend; its hash names the files.  Cached rows are reused when they are at
    least ``size`` long and extended otherwise; ``write_cache`` False only reads (one rank writes for all).
    """
    if cache_dir is None:
        return build_blending_indices(weights, size)
    text = json.dumps({**(description or {}), "weights": [float(w) for w in weights]}, indent=1, sort_keys=True)
    base = os.path.join(cache_dir, hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest())
    indices_path, description_path = base + INDICES_SUFFIX, base + DESCRIPTION_SUFFIX
    cached = _read_cache(indices_path, description_path, text)
    if cached is not None and len(cached) >= size:
        return cached[:size]
    indices = build_blending_indices(weights, size, done=None if cached is None else np.asarray(cached))
    if write_cache:
        os.makedirs(cache_dir, exist_ok=True)
        _write_atomic(description_path, lambda f: f.write(text.encode("utf-8")))
        _write_atomic(indices_path, lambda f: np.save(f, indices))
    return indices


class BlendedDataset(torch.utils.data.Dataset):
    """``datasets`` read through blending ``indices`` (``[n, 2]``: dataset, its sample), one sample per row.

    Any dataset with ``__len__`` / ``__getitem__`` blends; each must hold the samples the indices draw from it.
    """

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], indices: np.ndarray):
        self.datasets = list(datasets)
        self.dataset_index, self.dataset_sample_index = indices[:, 0], indices[:, 1]
        for d, (dataset, count) in enumerate(zip(self.datasets, blend_counts(indices, len(self.datasets)))):
            if count > len(dataset):
                raise ValueError(f"the blend draws {count} samples from its dataset {d}, which holds {len(dataset)}; "
                                 "size each dataset with blend_counts")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def describe(self) -> str:
        """One line for the job's start: the blend's members and what it draws from each."""
        counts = blend_counts(np.stack([self.dataset_index, self.dataset_sample_index], axis=1), len(self.datasets))
        members = "; ".join(getattr(d, "describe", lambda n=n: f"{n:,} samples")() for d, n in zip(self.datasets, counts))
        return f"{len(self):,} samples blended from {len(self.datasets)} datasets: {members}"

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]


def blend_counts(indices: np.ndarray, num_datasets: int) -> List[int]:
    """How many samples the blend draws from each dataset."""
    return np.bincount(indices[:, 0], minlength=num_datasets).tolist()


def build_blended_dataset(prefixes: Sequence[str], weights: Optional[Sequence[float]], size: int,
                          make: Callable[[str, Optional[int]], torch.utils.data.Dataset],
                          cache_dir: Optional[str] = None, description: Optional[Dict[str, Any]] = None,
                          write_cache: bool = True) -> Tuple[BlendedDataset, np.ndarray]:
    """The blend of ``size`` samples over ``make(prefix, num_samples)`` (``num_samples=None``: one pass).

    ``weights=None`` weighs each prefix by the samples one pass over it gives (Megatron's ``len`` of its
    one-epoch dataset).  Given weights are normalized twice, as Megatron's builder and its ``BlendedDataset``
    each do, so the same list gives Megatron's indices to the last bit.  Returns the dataset and the normalized
    weights the indices were built from.
    """
    if weights is None:
        weights = normalize([len(make(prefix, None)) for prefix in prefixes])
    else:
        weights = normalize(normalize(weights))
    indices = blending_indices(weights, size, cache_dir, {**(description or {}), "prefixes": list(prefixes)},
                               write_cache)
    counts = blend_counts(indices, len(prefixes))
    # A member the blend has not reached yet still gets its first sample (num_samples must be positive).
    members = [make(prefix, max(count, 1)) for prefix, count in zip(prefixes, counts)]
    return BlendedDataset(members, indices), weights
