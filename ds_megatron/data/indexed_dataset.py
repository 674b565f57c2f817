"""Megatron's memory-mapped indexed dataset: token ids in ``.bin``, their index in ``.idx``.

The on-disk layout is Megatron-LM's ``MMapIndexedDataset`` (version 1), so files
written here load in Megatron and the other way round.  For a prefix ``P``:

``P.bin``
    the token ids of all sequences, back to back, in one dtype, no header.

``P.idx`` (all integers little-endian)
    ========  ======================  =====================================
    bytes     type                    content
    ========  ======================  =====================================
    9         magic                   ``b"MMIDIDX\\x00\\x00"``
    8         uint64                  version, 1
    1         uint8                   dtype code (``DTYPE_CODES``)
    8         uint64                  N, number of sequences
    8         uint64                  D, length of the document index
    4 * N     int32                   ``sizes``: tokens per sequence
    8 * N     int64                   ``pointers``: byte offset of each sequence in ``.bin``
    8 * D     int64                   ``doc_idx``: first sequence of each document, then N
    ========  ======================  =====================================

A document is one or more consecutive sequences; ``doc_idx`` starts with 0 and
ends with N, so there are D - 1 documents.  ``IndexedDatasetBuilder`` writes
one sequence per document.

Token files hold integers: the float codes (6 float64, 7 float32) are refused
when reading, naming the file and the code.  DeepSpeed's data-efficiency
``MMapIndexedDataset`` writes 6 for uint16, 7 for uint32 and 8 for uint64, so
its files cannot be told apart from Megatron's by the header alone.

``P.stats.json`` (ours, optional) records the largest token id, so the job can
check a dataset against the model's vocabulary at start without reading the
``.bin``; it is trusted only while the ``.bin`` has the size it records
(``max_token_id`` computes it from the ``.bin`` otherwise).

Writes are crash-safe: the builder fills temporary files next to the final
ones and only renames them into place in ``finalize``.  The ``.idx`` acts as the
commit marker (the old one is removed first and the new one renamed last), so
a complete ``.bin``/``.idx`` pair under a prefix always belongs together.
"""
from __future__ import annotations

import json
import os
import struct
import uuid
from typing import Dict, Iterable, Optional, Union

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# Megatron's DType enum values; the code is what lands in the .idx header.
DTYPE_CODES: Dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
# Codes whose dtype can hold token ids.
TOKEN_DTYPE_CODES = {c for c, t in DTYPE_CODES.items() if np.dtype(t).kind in "iu"}
# magic + version + dtype code + N + D
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8

PREPROCESS_HINT = "run `ds-megatron preprocess --input FILE.jsonl --output-prefix {prefix}`"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def stats_file_path(prefix: str) -> str:
    return prefix + ".stats.json"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))


def token_dtype_code(prefix: str) -> int:
    """The dtype code in ``prefix.idx``'s header; a ValueError naming the file unless it is an integer type."""
    path = index_file_path(prefix)
    with open(path, "rb") as f:
        header = f.read(_HEADER_BYTES)
    if len(header) < _HEADER_BYTES or header[:len(INDEX_HEADER)] != INDEX_HEADER:
        raise ValueError(f"indexed dataset index {path!r} is not a Megatron mmap index (bad header); rebuild it: "
                         + PREPROCESS_HINT.format(prefix=prefix))
    (code,) = struct.unpack_from("<B", header, len(INDEX_HEADER) + 8)
    if code not in DTYPE_CODES:
        raise ValueError(f"indexed dataset index {path!r} has dtype code {code}, which is unknown; rebuild it: "
                         + PREPROCESS_HINT.format(prefix=prefix))
    if code not in TOKEN_DTYPE_CODES:
        raise ValueError(f"indexed dataset index {path!r} has dtype code {code} ({np.dtype(DTYPE_CODES[code]).name} "
                         "in Megatron's format); token ids must be integers (DeepSpeed's data-efficiency "
                         "MMapIndexedDataset writes code 6 for uint16 and 7 for uint32, which read as floats here): "
                         + PREPROCESS_HINT.format(prefix=prefix))
    return code


def max_token_id(prefix: str) -> int:
    """The largest token id in ``prefix.bin`` (-1 when empty): from ``prefix.stats.json`` while it matches the
    ``.bin``, else read from the ``.bin`` with numpy."""
    code = token_dtype_code(prefix)
    bin_path = data_file_path(prefix)
    bin_bytes = os.path.getsize(bin_path)
    try:
        with open(stats_file_path(prefix)) as f:
            stats = json.load(f)
        if stats.get("bin_bytes") == bin_bytes and stats.get("dtype_code") == code:
            return int(stats["max_token_id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    dtype = np.dtype(DTYPE_CODES[code])
    if bin_bytes < dtype.itemsize:
        return -1
    data = np.memmap(bin_path, mode="r", dtype=dtype)
    chunk = 1 << 26
    return int(max(int(data[i:i + chunk].max()) for i in range(0, len(data), chunk)))


def best_dtype(vocab_size: int) -> np.dtype:
    """Smallest of uint8 / uint16 / int32 that holds every id below ``vocab_size``."""
    if vocab_size <= 2 ** 8:
        return np.dtype(np.uint8)
    if vocab_size <= 2 ** 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def _dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF_DTYPE:
        names = ", ".join(np.dtype(t).name for t in DTYPE_CODES.values())
        raise ValueError(f"dtype {dtype.name} has no code in the .idx format; use one of: {names}")
    return _CODE_OF_DTYPE[dtype]


class IndexedDatasetBuilder:
    """Writes ``prefix.bin`` / ``prefix.idx`` one document at a time.

    Use it as a context manager: a clean exit finalizes, an exception removes
    the temporary files and leaves whatever was under ``prefix`` untouched::

        with IndexedDatasetBuilder(prefix, best_dtype(tok.vocab_size)) as builder:
            for text in texts:
                builder.add_document(tok.tokenize(text) + [tok.eod])
    """

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self._code = _dtype_code(self.dtype)
        if self._code not in TOKEN_DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype.name} cannot hold token ids; use an integer dtype "
                             "(best_dtype(vocab_size))")
        info = np.iinfo(self.dtype)
        self._bounds = (int(info.min), int(info.max))
        self._max_id = -1
        parent = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(parent, exist_ok=True)
        # Unique names in the final directory: rename is then atomic and two
        # processes building the same prefix never write into one file.
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._bin_tmp = data_file_path(prefix) + tag
        self._idx_tmp = index_file_path(prefix) + tag
        self._stats_tmp = stats_file_path(prefix) + tag
        self._bin = open(self._bin_tmp, "wb")
        self._sizes = []
        self._done = False

    def add_document(self, ids: Iterable[int]) -> None:
        """Append one document (one sequence) of token ids."""
        if self._done:
            raise RuntimeError(f"builder for {self.prefix!r} is already finalized or aborted; "
                               f"create a new IndexedDatasetBuilder")
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"document ids must be one-dimensional, got shape {arr.shape}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._bounds[0] or hi > self._bounds[1]:
                raise ValueError(f"token ids span [{lo}, {hi}], outside dtype {self.dtype.name} "
                                 f"[{self._bounds[0]}, {self._bounds[1]}]; build with a wider dtype "
                                 f"(best_dtype(vocab_size))")
            self._max_id = max(self._max_id, hi)
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(arr.size))

    def finalize(self) -> str:
        """Write the index and move both files under the final prefix; returns the prefix."""
        if self._done:
            raise RuntimeError(f"builder for {self.prefix!r} is already finalized or aborted")
        self._done = True
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            sizes = np.asarray(self._sizes, dtype=np.int32)
            pointers = np.zeros(len(sizes), dtype=np.int64)
            if len(sizes) > 1:
                np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
            doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
            with open(self._idx_tmp, "wb") as f:
                f.write(INDEX_HEADER)
                f.write(struct.pack("<Q", INDEX_VERSION))
                f.write(struct.pack("<B", self._code))
                f.write(struct.pack("<Q", len(sizes)))
                f.write(struct.pack("<Q", len(doc_idx)))
                f.write(sizes.astype("<i4").tobytes())
                f.write(pointers.astype("<i8").tobytes())
                f.write(doc_idx.astype("<i8").tobytes())
                f.flush()
                os.fsync(f.fileno())
            with open(self._stats_tmp, "w") as f:
                json.dump({"max_token_id": self._max_id, "num_tokens": int(sizes.sum(dtype=np.int64)),
                           "bin_bytes": os.path.getsize(self._bin_tmp),
                           "dtype_code": self._code}, f)
            # .idx is the commit marker: drop the old one before the .bin changes,
            # rename the new one last, so no mismatched pair is ever visible.
            if os.path.exists(index_file_path(self.prefix)):
                os.remove(index_file_path(self.prefix))
            os.replace(self._bin_tmp, data_file_path(self.prefix))
            os.replace(self._stats_tmp, stats_file_path(self.prefix))
            os.replace(self._idx_tmp, index_file_path(self.prefix))
        except BaseException:
            self._remove_temporaries()
            raise
        return self.prefix

    def abort(self) -> None:
        """Drop everything written so far; the final prefix is not touched."""
        self._done = True
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        if not self._bin.closed:
            self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp, self._stats_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()


class IndexedDataset:
    """Read-only view of ``prefix.bin`` / ``prefix.idx`` through numpy memmaps.

    ``ds[i]`` is sequence ``i`` as a numpy array (a view into the mapped file);
    ``ds.get(i, offset, length)`` a slice of it without touching the rest.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._open()

    def _open(self) -> None:
        prefix = self.prefix
        hint = PREPROCESS_HINT.format(prefix=prefix)
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file {path!r} does not exist; check the "
                                        f"data prefix or {hint}")
        idx_bytes = os.path.getsize(idx_path)
        corrupt = f"indexed dataset index {idx_path!r} is corrupt"
        if idx_bytes < _HEADER_BYTES:
            raise ValueError(f"{corrupt}: {idx_bytes} bytes, shorter than the {_HEADER_BYTES}-byte "
                             f"header; rebuild it: {hint}")
        with open(idx_path, "rb") as f:
            header = f.read(_HEADER_BYTES)
        magic = header[:len(INDEX_HEADER)]
        if magic != INDEX_HEADER:
            raise ValueError(f"{corrupt}: magic {magic!r} is not {INDEX_HEADER!r} (not a Megatron "
                             f"mmap index); rebuild it: {hint}")
        pos = len(INDEX_HEADER)
        (version,) = struct.unpack_from("<Q", header, pos)
        (code,) = struct.unpack_from("<B", header, pos + 8)
        count, doc_count = struct.unpack_from("<QQ", header, pos + 9)
        if version != INDEX_VERSION:
            raise ValueError(f"{corrupt}: version {version}, only {INDEX_VERSION} is supported; "
                             f"rebuild it: {hint}")
        if code not in DTYPE_CODES:
            raise ValueError(f"{corrupt}: dtype code {code} is unknown; rebuild it: {hint}")
        token_dtype_code(prefix)  # integers only (float codes: a ValueError naming the file and the code)
        expected = _HEADER_BYTES + count * (4 + 8) + doc_count * 8
        # Megatron's multimodal indexes append one int8 mode per sequence; the
        # token layout is the same, so such files read fine here.
        if idx_bytes not in (expected, expected + count):
            raise ValueError(f"{corrupt}: {idx_bytes} bytes, the header promises {expected} "
                             f"({count} sequences, {doc_count} document entries); rebuild it: {hint}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self._index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = _HEADER_BYTES
        self.sizes = np.frombuffer(self._index, dtype="<i4", count=count, offset=off)
        off += 4 * count
        self.pointers = np.frombuffer(self._index, dtype="<i8", count=count, offset=off)
        off += 8 * count
        self.doc_idx = np.frombuffer(self._index, dtype="<i8", count=doc_count, offset=off)
        bin_bytes = os.path.getsize(bin_path)
        want = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if count else 0
        if bin_bytes != want:
            raise ValueError(f"indexed dataset data {bin_path!r} has {bin_bytes} bytes but its index "
                             f"describes {want}; the pair does not belong together, rebuild it: {hint}")
        # mmap refuses empty files; an empty dataset needs no mapping.
        self._data = (np.memmap(bin_path, mode="r", dtype=self.dtype) if bin_bytes
                      else np.zeros(0, dtype=self.dtype))

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sequence ``idx`` (to its end if ``length`` is None)."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence index {idx} is out of range for {n} sequences in {self.prefix!r}")
        idx %= n
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"offset {offset} + length {length} is outside sequence {idx} "
                             f"of {size} tokens in {self.prefix!r}")
        start = int(self.pointers[idx]) // self.dtype.itemsize + offset
        return self._data[start:start + length]

    def __getitem__(self, idx: Union[int, slice]):
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(int(idx))

    # DataLoader workers pickle the dataset: send the prefix, not the mapped bytes.
    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.prefix = state["prefix"]
        self._open()
