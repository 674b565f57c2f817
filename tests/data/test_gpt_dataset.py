"""GPTDataset: samples cut from the shuffled document stream, labels shifted, disjoint splits."""
import numpy as np
import pytest
import torch

from ds_megatron.data.gpt_dataset import (GPTDataset, build_train_valid_datasets, parse_split,
                                          split_document_ranges)
from ds_megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def _make(tmp_path, num_docs=40, seed=0, empty=(5,)):
    """Document j holds tokens 1000*j + 0, 1, 2, ...: every token names its document."""
    rng = np.random.default_rng(seed)
    prefix = str(tmp_path / "ds")
    with IndexedDatasetBuilder(prefix, np.int32) as b:
        for j in range(num_docs):
            n = 0 if j in empty else int(rng.integers(1, 60))
            b.add_document(1000 * j + np.arange(n))
    return prefix


def _stream(ds):
    return np.concatenate([ds.indexed_dataset.get(int(s)) for s in ds.doc_idx]).astype(np.int64)


@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_samples_concatenate_to_the_shuffled_stream(tmp_path, seq_length):
    ds = GPTDataset(IndexedDataset(_make(tmp_path)), seq_length, seed=3)
    stream = _stream(ds)
    assert len(ds) == (len(stream) - 1) // seq_length
    by_sample = {}
    for i in range(len(ds)):
        item = ds[i]
        assert item["tokens"].dtype == torch.int64 and item["labels"].dtype == torch.int64
        assert item["tokens"].shape == item["labels"].shape == (seq_length,)
        assert torch.equal(item["tokens"][1:], item["labels"][:-1])
        assert torch.equal(item["loss_mask"], torch.ones(seq_length))
        by_sample[int(ds.shuffle_idx[i])] = item
    assert sorted(by_sample) == list(range(len(ds)))  # shuffle_idx is a permutation
    joined = torch.cat([by_sample[k]["tokens"] for k in range(len(ds))] + [by_sample[len(ds) - 1]["labels"][-1:]])
    assert joined.tolist() == stream[:len(ds) * seq_length + 1].tolist()


def test_documents_are_shuffled_by_seed(tmp_path):
    indexed = IndexedDataset(_make(tmp_path))
    a, b, c = (GPTDataset(indexed, 16, seed=s) for s in (1, 1, 2))
    assert sorted(a.doc_idx.tolist()) == list(range(40))
    assert a.doc_idx.tolist() != list(range(40))
    assert a.doc_idx.tolist() == b.doc_idx.tolist() and a.shuffle_idx.tolist() == b.shuffle_idx.tolist()
    assert a.doc_idx.tolist() != c.doc_idx.tolist()
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))


def test_more_samples_than_one_epoch(tmp_path):
    indexed = IndexedDataset(_make(tmp_path))
    one = GPTDataset(indexed, 32)
    ds = GPTDataset(indexed, 32, num_samples=3 * len(one) + 1)
    assert len(ds) == 3 * len(one) + 1 and ds.num_epochs == 4
    for e in range(ds.num_epochs):
        assert sorted(ds.doc_idx[40 * e:40 * (e + 1)].tolist()) == list(range(40))
    assert ds.doc_idx[:40].tolist() != ds.doc_idx[40:80].tolist()
    stream = _stream(ds)
    for k in (0, len(ds) // 2, len(ds) - 1):
        assert ds.get_sample_tokens(k).tolist() == stream[32 * k:32 * k + 33].tolist()


def test_split_ranges():
    assert parse_split("98,2") == pytest.approx([0.98, 0.02])
    assert split_document_ranges("98,2", 100) == [range(0, 98), range(98, 100)]
    assert split_document_ranges("949,50,1", 1000) == [range(0, 949), range(949, 999), range(999, 1000)]
    with pytest.raises(ValueError, match="split 'a,b'"):
        parse_split("a,b")
    with pytest.raises(ValueError, match="2 or 3"):
        parse_split("1")


def test_train_valid_are_disjoint_by_documents(tmp_path):
    prefix = _make(tmp_path, num_docs=60, empty=())
    train, valid = build_train_valid_datasets(prefix, 8, split="80,20", seed=5)
    train_docs, valid_docs = set(train.doc_idx.tolist()), set(valid.doc_idx.tolist())
    assert train_docs == set(range(48)) and valid_docs == set(range(48, 60))
    # Every token names its document: no train sample may touch a valid document.
    seen_train = {int(t) // 1000 for i in range(len(train)) for t in train[i]["tokens"].tolist() + train[i]["labels"].tolist()}
    seen_valid = {int(t) // 1000 for i in range(len(valid)) for t in valid[i]["tokens"].tolist() + valid[i]["labels"].tolist()}
    assert seen_train <= train_docs and seen_valid <= valid_docs
    assert seen_train and seen_valid


def test_zero_valid_weight_and_empty_splits(tmp_path):
    prefix = _make(tmp_path, num_docs=3, empty=())
    train, valid = build_train_valid_datasets(prefix, 4, split="100,0")
    assert valid is None and len(train) > 0
    with pytest.raises(ValueError, match="no valid documents"):
        build_train_valid_datasets(prefix, 4, split="98,2")


def test_too_short_for_one_sample(tmp_path):
    prefix = _make(tmp_path, num_docs=2, empty=())
    with pytest.raises(ValueError, match=r"seq_length \+ 1"):
        GPTDataset(IndexedDataset(prefix), 10_000)


def test_data_loader_batches(tmp_path):
    from ds_megatron.data.sampler import build_data_loader
    ds = GPTDataset(IndexedDataset(_make(tmp_path)), 8)
    batch = next(iter(build_data_loader(ds, micro_batch_size=3, dp_rank=1, dp_size=2)))
    assert batch["tokens"].shape == (3, 8) and batch["tokens"].dtype == torch.int64
    assert torch.equal(batch["tokens"], torch.stack([ds[i]["tokens"] for i in (3, 4, 5)]))
