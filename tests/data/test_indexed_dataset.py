"""Megatron .bin/.idx: round trips, the byte layout parsed by hand, crash-safe writes, clear errors."""
import json
import os
import struct

import numpy as np
import pytest

from ds_megatron.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, best_dtype)

DTYPES = [np.uint8, np.uint16, np.int32]


def _random_docs(rng, dtype, n=50):
    hi = min(np.iinfo(dtype).max, 100_000)
    docs = [rng.integers(0, hi + 1, size=int(rng.integers(0, 300))) for _ in range(n)]
    docs[3] = np.zeros(0, dtype=np.int64)  # an empty document is legal
    return docs


def _write(prefix, docs, dtype):
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for d in docs:
            b.add_document(d)
    return prefix


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(int(np.dtype(dtype).itemsize))
    docs = _random_docs(rng, dtype)
    ds = IndexedDataset(_write(str(tmp_path / "ds"), docs, dtype))
    assert len(ds) == len(docs) and ds.num_documents == len(docs)
    assert ds.dtype == np.dtype(dtype)
    assert ds.sizes.tolist() == [len(d) for d in docs]
    assert ds.doc_idx.tolist() == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d.tolist()
    assert ds[-1].tolist() == docs[-1].tolist()
    assert [a.tolist() for a in ds[1:3]] == [docs[1].tolist(), docs[2].tolist()]
    big = max(range(len(docs)), key=lambda i: len(docs[i]))
    assert ds.get(big, 5, 7).tolist() == docs[big][5:12].tolist()
    assert ds.get(big, 5).tolist() == docs[big][5:].tolist()


def test_header_layout_parsed_by_hand(tmp_path):
    docs = [[1, 2, 3], [], [300, 301], [7] * 10]
    prefix = _write(str(tmp_path / "ds"), docs, np.uint16)
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n, d = struct.unpack_from("<QBQQ", raw, 9)
    assert (version, code, n, d) == (1, 8, 4, 5)  # Megatron's code for uint16 is 8
    off = 9 + 8 + 1 + 8 + 8
    sizes = np.frombuffer(raw, "<i4", n, off)
    pointers = np.frombuffer(raw, "<i8", n, off + 4 * n)
    doc_idx = np.frombuffer(raw, "<i8", d, off + 12 * n)
    assert len(raw) == off + 12 * n + 8 * d
    assert sizes.tolist() == [3, 0, 2, 10]
    assert pointers.tolist() == [0, 6, 6, 10]  # byte offsets, 2 bytes per token
    assert doc_idx.tolist() == [0, 1, 2, 3, 4]
    data = np.fromfile(prefix + ".bin", dtype="<u2")
    assert data.tolist() == [1, 2, 3, 300, 301] + [7] * 10


@pytest.mark.parametrize("dtype,code", [(np.uint8, 1), (np.int32, 4), (np.int64, 5)])
def test_dtype_codes(tmp_path, dtype, code):
    prefix = _write(str(tmp_path / "ds"), [[1, 2]], dtype)
    assert open(prefix + ".idx", "rb").read()[17] == code


def test_best_dtype():
    assert best_dtype(256) == np.uint8
    assert best_dtype(257) == np.uint16
    assert best_dtype(65536) == np.uint16
    assert best_dtype(65537) == np.int32


def test_ids_outside_dtype_are_refused(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "ds"), np.uint8) as b:
        with pytest.raises(ValueError, match="uint8"):
            b.add_document([1, 256])
        with pytest.raises(ValueError, match="uint8"):
            b.add_document([-1])


def test_crash_mid_build_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "ds")
    with pytest.raises(RuntimeError, match="boom"):
        with IndexedDatasetBuilder(prefix, np.uint16) as b:
            b.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_unfinished_build_never_shows_final_name(tmp_path):
    prefix = str(tmp_path / "ds")
    b = IndexedDatasetBuilder(prefix, np.uint16)
    b.add_document([1, 2, 3])
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    b.finalize()
    assert IndexedDataset(prefix)[0].tolist() == [1, 2, 3]
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx", "ds.stats.json"]


def test_crash_keeps_existing_dataset(tmp_path):
    prefix = _write(str(tmp_path / "ds"), [[5, 6, 7], [8]], np.uint16)
    before = {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")}
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetBuilder(prefix, np.uint16) as b:
            b.add_document(list(range(1000)))
            raise KeyboardInterrupt
    after = {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")}
    assert after == before
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx", "ds.stats.json"]


def test_rebuild_replaces_dataset(tmp_path):
    prefix = _write(str(tmp_path / "ds"), [[5, 6, 7]], np.uint16)
    _write(prefix, [[1], [2, 3]], np.uint8)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint8 and [d.tolist() for d in ds[:]] == [[1], [2, 3]]


def test_empty_dataset(tmp_path):
    ds = IndexedDataset(_write(str(tmp_path / "ds"), [], np.uint16))
    assert len(ds) == 0 and ds.num_tokens == 0


def test_missing_files_name_path_and_fix(tmp_path):
    prefix = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"nope\.idx.*ds-megatron preprocess --input"):
        IndexedDataset(prefix)
    prefix = _write(str(tmp_path / "ds"), [[1, 2]], np.uint16)
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"ds\.bin.*--output-prefix"):
        IndexedDataset(prefix)


def _corrupt(prefix, data):
    with open(prefix + ".idx", "wb") as f:
        f.write(data)


def test_corrupt_index_is_reported(tmp_path):
    prefix = _write(str(tmp_path / "ds"), [[1, 2], [3]], np.uint16)
    good = open(prefix + ".idx", "rb").read()
    cases = [
        (b"MMID", "shorter than"),
        (b"XXXXXXXXX" + good[9:], "magic"),
        (good[:9] + struct.pack("<Q", 2) + good[17:], "version 2"),
        (good[:17] + bytes([99]) + good[18:], "dtype code 99"),
        (good[:-3], "header promises"),
    ]
    for data, what in cases:
        _corrupt(prefix, data)
        with pytest.raises(ValueError, match=rf"ds\.idx.*{what}.*ds-megatron preprocess"):
            IndexedDataset(prefix)


def test_mismatched_bin_is_reported(tmp_path):
    prefix = _write(str(tmp_path / "ds"), [[1, 2], [3]], np.uint16)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(ValueError, match=r"ds\.bin.*8 bytes.*describes 6"):
        IndexedDataset(prefix)


def test_pickles_by_prefix(tmp_path):
    import pickle
    ds = IndexedDataset(_write(str(tmp_path / "ds"), [list(range(100))], np.int32))
    blob = pickle.dumps(ds)
    assert len(blob) < 200  # the tokens are not copied into the pickle
    assert pickle.loads(blob)[0].tolist() == list(range(100))


def test_files_are_byte_identical_to_megatron_core(tmp_path):
    """Interchangeability, checked against the reference when megatron-core is installed."""
    mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, size=int(rng.integers(0, 50))) for _ in range(20)]
    ours = _write(str(tmp_path / "ours"), docs, np.uint16)
    theirs = mcore.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for d in docs:
        theirs.add_document(torch.tensor(d), [len(d)])
    theirs.finalize(str(tmp_path / "theirs.idx"))
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(str(tmp_path / "theirs") + ext, "rb").read()
    assert [x.tolist() for x in mcore.IndexedDataset(ours)] == [d.tolist() for d in docs]


# --- token ids: integers only, and the largest one known at start -------------------------------------

def _with_dtype_code(prefix, code):
    """Rewrite the header's dtype code (as DeepSpeed's data-efficiency writer would have put it)."""
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw[17] = code
    open(prefix + ".idx", "wb").write(bytes(raw))
    return prefix


@pytest.mark.parametrize("code,name", [(6, "float64"), (7, "float32")])
def test_float_dtype_codes_are_refused_naming_the_file_and_the_code(tmp_path, code, name):
    """DeepSpeed's MMapIndexedDataset writes code 6 for uint16: read as float64 the ids were garbage."""
    prefix = _with_dtype_code(_write(str(tmp_path / "ds"), [[1, 2, 3, 4]], np.uint16), code)
    with pytest.raises(ValueError, match=rf"{prefix}\.idx.* has dtype code {code} \({name}.*token ids must be "
                                         "integers"):
        IndexedDataset(prefix)
    with pytest.raises(ValueError, match="cannot hold token ids"):
        IndexedDatasetBuilder(str(tmp_path / "f"), np.float32)


def test_max_token_id_from_the_stats_file_or_the_bin(tmp_path):
    from ds_megatron.data.indexed_dataset import max_token_id
    prefix = _write(str(tmp_path / "ds"), [[1, 700, 3], [], [9]], np.uint16)
    assert json.load(open(prefix + ".stats.json"))["max_token_id"] == 700
    assert max_token_id(prefix) == 700
    os.remove(prefix + ".stats.json")  # e.g. a Megatron-made dataset: read from the .bin
    assert max_token_id(prefix) == 700
    open(prefix + ".stats.json", "w").write(json.dumps({"max_token_id": 5, "bin_bytes": 2, "dtype_code": 8}))
    assert max_token_id(prefix) == 700  # a stale record (another .bin size) is not trusted
