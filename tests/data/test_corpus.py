"""The stdlib default corpus: deterministic selection, identical builds, cached reuse."""
import os
import platform
import sysconfig

import pytest

from ds_megatron.data import corpus
from ds_megatron.data.corpus import build_default_dataset, stdlib_source_files
from ds_megatron.data.indexed_dataset import IndexedDataset
from ds_megatron.data.tokenizer import ByteTokenizer

BUDGET = 200_000


def test_file_selection():
    files = stdlib_source_files(BUDGET)
    names = [rel for rel, _ in files]
    assert names == sorted(names) and len(names) > 3
    assert all(rel.endswith(".py") for rel in names)
    assert not any(part in corpus.SKIPPED_DIRS for rel in names for part in rel.split("/")[:-1])
    total = sum(size for _, size in files)
    assert total <= BUDGET
    # Whole files, in order, until the next one would overflow the budget.
    everything = stdlib_source_files(10 ** 10)
    assert everything[:len(files)] == files
    assert total + everything[len(files)][1] > BUDGET
    assert not any("site-packages" in rel or "/test/" in f"/{rel}" for rel, _ in everything)


def test_builds_are_identical_and_hold_the_sources(tmp_path):
    a = build_default_dataset(str(tmp_path / "a"), max_bytes=BUDGET)
    b = build_default_dataset(str(tmp_path / "b"), max_bytes=BUDGET)
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(b + ext, "rb").read()
    ds, tok = IndexedDataset(a), ByteTokenizer()
    files = stdlib_source_files(BUDGET)
    assert len(ds) == len(files)
    root = sysconfig.get_paths()["stdlib"]
    first = open(os.path.join(root, files[0][0]), "rb").read()
    assert ds[0].tolist() == list(first) + [tok.eod]


def test_cached_build_is_reused(tmp_path, monkeypatch):
    prefix = build_default_dataset(str(tmp_path), max_bytes=BUDGET)
    key = os.path.basename(prefix)
    assert platform.python_version() in key and str(BUDGET) in key

    def no_rebuild(*a, **k):
        raise AssertionError("rebuilt a cached dataset")
    monkeypatch.setattr(corpus, "IndexedDatasetBuilder", no_rebuild)
    assert build_default_dataset(str(tmp_path), max_bytes=BUDGET) == prefix
    # A different budget is a different key, hence a new build.
    with pytest.raises(AssertionError, match="rebuilt"):
        build_default_dataset(str(tmp_path), max_bytes=BUDGET // 2)


def test_corrupt_cache_is_rebuilt(tmp_path):
    prefix = build_default_dataset(str(tmp_path), max_bytes=BUDGET)
    good = open(prefix + ".idx", "rb").read()
    with open(prefix + ".idx", "wb") as f:
        f.write(b"garbage")
    assert build_default_dataset(str(tmp_path), max_bytes=BUDGET) == prefix
    assert open(prefix + ".idx", "rb").read() == good


def test_bad_budget():
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_source_files(0)
