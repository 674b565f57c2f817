"""GPTDataset: samples cut from the shuffled document stream, an order no run length changes, Megatron's pretraining
flags (position ids, loss mask) against a re-implementation of its rules and against megatron-core's own function."""
import numpy as np
import pytest
import torch

from ds_megatron.data.gpt_dataset import (GPTDataset, fraction_range, parse_split, split_document_ranges,
                                          split_fractions)
from ds_megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

EOD = 7  # the end-of-document id of the EOD-terminated data below; document tokens are >= 1000


def _make(tmp_path, num_docs=40, seed=0, empty=(5,), eod=False, max_len=60):
    """Document j holds tokens 1000*j + 0, 1, 2, ... (then EOD when ``eod``): every token names its document."""
    rng = np.random.default_rng(seed)
    prefix = str(tmp_path / "ds")
    with IndexedDatasetBuilder(prefix, np.int32) as b:
        for j in range(num_docs):
            n = 0 if j in empty else int(rng.integers(1, max_len))
            b.add_document(list(1000 * (j + 1) + np.arange(n)) + ([EOD] if eod and n else []))
    return prefix


def _stream(ds):
    return np.concatenate([ds.indexed_dataset.get(int(s)) for s in ds.doc_idx]).astype(np.int64)


@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_samples_concatenate_to_the_shuffled_stream(tmp_path, seq_length):
    ds = GPTDataset(IndexedDataset(_make(tmp_path)), seq_length, seed=3)
    stream = _stream(ds)
    assert len(ds) == ds.samples_per_epoch == (len(stream) - 1) // seq_length
    by_sample = {}
    for i in range(len(ds)):
        item = ds[i]
        assert item["tokens"].dtype == torch.int64 and item["labels"].dtype == torch.int64
        assert item["tokens"].shape == item["labels"].shape == (seq_length,)
        assert torch.equal(item["tokens"][1:], item["labels"][:-1])
        assert torch.equal(item["loss_mask"], torch.ones(seq_length))
        assert "position_ids" not in item  # one run of tokens to the model: nothing to read on the host
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
    per_epoch = len(one)
    ds = GPTDataset(indexed, 32, num_samples=3 * per_epoch + 1)
    # Four whole shuffle blocks of one pass's samples are built: 4 * per_epoch * 32 + 1 tokens of the stream.
    assert len(ds) == 3 * per_epoch + 1
    assert ds.num_epochs == -(-(4 * per_epoch * 32 + 1) // one.tokens_per_epoch)
    for e in range(ds.num_epochs):
        assert sorted(ds.doc_idx[40 * e:40 * (e + 1)].tolist()) == list(range(40))
    assert ds.doc_idx[:40].tolist() != ds.doc_idx[40:80].tolist()
    stream = _stream(ds)
    for k in (0, len(ds) // 2, len(ds) - 1):
        assert ds.get_sample_tokens(k).tolist() == stream[32 * k:32 * k + 33].tolist()
    # The shuffle permutes each block of one pass's samples within itself (the last block is cut at len).
    for b in range(3):
        block = ds.shuffle_idx[b * per_epoch:(b + 1) * per_epoch].tolist()
        assert sorted(block) == list(range(b * per_epoch, (b + 1) * per_epoch))
    assert 3 * per_epoch <= ds.shuffle_idx[-1] < 4 * per_epoch
    assert sorted(ds.shuffle_idx.tolist()) != ds.shuffle_idx.tolist()


@pytest.mark.parametrize("seq_length", [5, 32])
def test_order_does_not_depend_on_the_number_of_samples(tmp_path, seq_length):
    """Item 5: a run extended later reads what one long run reads: dataset[k] is the same sample at every size
    (sizes inside the first block, at a block's edge, across several epochs)."""
    indexed = IndexedDataset(_make(tmp_path))
    longest = GPTDataset(indexed, seq_length, num_samples=5 * GPTDataset(indexed, seq_length).samples_per_epoch + 3)
    per_epoch = longest.samples_per_epoch
    for n in (1, per_epoch // 2, per_epoch, per_epoch + 1, 3 * per_epoch - 1, len(longest)):
        ds = GPTDataset(indexed, seq_length, num_samples=n)
        assert len(ds) == n
        assert ds.shuffle_idx.tolist() == longest.shuffle_idx[:n].tolist()
        assert ds.doc_idx.tolist() == longest.doc_idx[:len(ds.doc_idx)].tolist()
        for k in sorted({0, n // 2, n - 1}):
            assert torch.equal(ds[k]["tokens"], longest[k]["tokens"]), (n, k)
            assert torch.equal(ds[k]["labels"], longest[k]["labels"]), (n, k)


def test_split_ranges():
    assert parse_split("98,2") == pytest.approx([0.98, 0.02])
    assert split_document_ranges("98,2", 100) == [range(0, 98), range(98, 100)]
    assert split_document_ranges("949,50,1", 1000) == [range(0, 949), range(949, 999), range(999, 1000)]
    for split in ("98,2", "949,50,1", "1,1,1", "33,67,0"):
        for n in (1, 7, 100, 12345):
            # The fraction pairs a dataset takes select exactly the ranges (the pairs are what build passes on).
            assert [fraction_range(p, n) for p in split_fractions(split)] == split_document_ranges(split, n)
            ranges = split_document_ranges(split, n)
            assert ranges[0].start == 0 and ranges[-1].stop == n
            assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(ValueError, match="split 'a,b'"):
        parse_split("a,b")
    with pytest.raises(ValueError, match="2 or 3"):
        parse_split("1")


def test_train_valid_are_disjoint_by_documents(tmp_path):
    indexed = IndexedDataset(_make(tmp_path, num_docs=60, empty=()))
    train_split, valid_split = split_fractions("80,20")
    train = GPTDataset(indexed, 8, seed=5, split=train_split)
    valid = GPTDataset(indexed, 8, seed=5, split=valid_split)
    train_docs, valid_docs = set(train.doc_idx.tolist()), set(valid.doc_idx.tolist())
    assert train_docs == set(range(48)) and valid_docs == set(range(48, 60))
    # Every token names its document: no train sample may touch a valid document.
    seen_train = {int(t) // 1000 - 1 for i in range(len(train))
                  for t in train[i]["tokens"].tolist() + train[i]["labels"].tolist()}
    seen_valid = {int(t) // 1000 - 1 for i in range(len(valid))
                  for t in valid[i]["tokens"].tolist() + valid[i]["labels"].tolist()}
    assert seen_train <= train_docs and seen_valid <= valid_docs
    assert seen_train and seen_valid


def test_empty_split_and_too_little_data(tmp_path):
    indexed = IndexedDataset(_make(tmp_path, num_docs=3, empty=()))
    with pytest.raises(ValueError, match=r"split \(0.98, 1.0\) selects none of the 3 documents of .*ds'; widen"):
        GPTDataset(indexed, 4, split=split_fractions("98,2")[1])
    with pytest.raises(ValueError, match=r"seq_length \+ 1"):
        GPTDataset(indexed, 10_000)
    with pytest.raises(ValueError, match="reset_position_ids and eod_mask_loss need the end-of-document id"):
        GPTDataset(indexed, 4, eod_mask_loss=True)


def test_data_loader_batches(tmp_path):
    from ds_megatron.data.sampler import build_data_loader
    ds = GPTDataset(IndexedDataset(_make(tmp_path)), 8)
    batch = next(iter(build_data_loader(ds, micro_batch_size=3, dp_rank=1, dp_size=2)))
    assert batch["tokens"].shape == (3, 8) and batch["tokens"].dtype == torch.int64
    assert torch.equal(batch["tokens"], torch.stack([ds[i]["tokens"] for i in (3, 4, 5)]))


# -- item 2: Megatron's pretraining flags -------------------------------------------------------------------------

def _megatron_rules(tokens, eod, reset_position_ids, eod_mask_loss):
    """Megatron's ``_get_ltor_masks_and_position_ids`` as its docs state the rules, written out token by token:
    loss 0 where the input is the EOD; positions count from 0 and, with the reset, start again after each EOD."""
    loss_mask, position_ids, position = [], [], 0
    for token in tokens:
        loss_mask.append(0.0 if eod_mask_loss and token == eod else 1.0)
        position_ids.append(position)
        position = 0 if reset_position_ids and token == eod else position + 1
    return position_ids, loss_mask


FLAGS = [(False, False), (False, True), (True, True)]  # (reset_position_ids = reset_attention_mask, eod_mask_loss)


@pytest.fixture(scope="module")
def eod_data(tmp_path_factory):
    """Short EOD-terminated documents and a 9-token row: EODs inside rows, at their first and last positions."""
    return IndexedDataset(_make(tmp_path_factory.mktemp("eod"), num_docs=60, empty=(), eod=True, max_len=12))


def _samples_with_eods(ds):
    items = [ds[i] for i in range(len(ds))]
    eods = [(item["tokens"] == EOD).nonzero().flatten().tolist() for item in items]
    seq = ds.seq_length
    assert any(seq - 1 in e for e in eods) and any(0 in e for e in eods) and any(len(e) >= 2 for e in eods)
    return items


@pytest.mark.parametrize("reset,mask_eod", FLAGS)
def test_position_ids_and_loss_mask_follow_megatrons_rules(eod_data, reset, mask_eod):
    plain = GPTDataset(eod_data, 9, seed=4)
    ds = GPTDataset(eod_data, 9, seed=4, eod=EOD, reset_position_ids=reset, eod_mask_loss=mask_eod,
                    document_fields=True)
    for base, item in zip(_samples_with_eods(plain), _samples_with_eods(ds)):
        assert torch.equal(item["tokens"], base["tokens"]) and torch.equal(item["labels"], base["labels"])
        position_ids, loss_mask = _megatron_rules(item["tokens"].tolist(), EOD, reset, mask_eod)
        assert item["position_ids"].tolist() == position_ids
        assert item["loss_mask"].tolist() == loss_mask
        assert item["position_ids"].dtype == torch.int64 and item["loss_mask"].dtype == torch.float32


@pytest.mark.parametrize("reset,mask_eod", FLAGS)
def test_batch_equals_megatron_cores_own_function(eod_data, reset, mask_eod):
    """megatron-core 0.16's ``_get_ltor_masks_and_position_ids`` gives the same loss mask and position ids, and its
    attention mask (``reset_attention_mask``) is exactly "causal, within the document the position ids mark"."""
    mcore = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    ds = GPTDataset(eod_data, 9, seed=4, eod=EOD, reset_position_ids=reset, eod_mask_loss=mask_eod,
                    document_fields=True)
    for item in _samples_with_eods(ds):
        attention_mask, loss_mask, position_ids = mcore._get_ltor_masks_and_position_ids(
            item["tokens"], EOD, reset, reset, mask_eod, True)
        assert torch.equal(item["loss_mask"], loss_mask)
        assert torch.equal(item["position_ids"], position_ids)
        document = torch.cumsum((item["position_ids"] == 0).long(), 0)  # what a packed-sequence model reads
        causal = torch.tril(torch.ones(9, 9, dtype=torch.bool))
        allowed = causal & (document[:, None] == document[None, :])
        assert torch.equal(~attention_mask[0], allowed)  # Megatron's mask is True where attention is cut
