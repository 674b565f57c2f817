"""PackedCollator: examples packed whole into rows, each trained only on its own tokens; the model's loss and
gradients on the collated batch are the examples' own (float64, each example alone as the reference)."""
import pytest
import torch

from ds_megatron.data.collator import PackedCollator
from ds_megatron.models import GPTConfig, GPTModel


def _examples():
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (9, 3, 14, 6, 1, 11):
        ids = torch.randint(1, 50, (n,), generator=g).tolist()
        labels = [t if torch.rand((), generator=g) > 0.4 else -100 for t in ids]
        out.append({"input_ids": ids, "labels": labels})
    out.append({"input_ids": [5, 6, 7, 8], "assistant_masks": [0, 0, 1, 1]})
    out.append({"input_ids": [9, 10, 11]})  # every token but the first
    return out


def test_each_example_is_placed_whole_with_its_own_targets():
    examples = _examples()
    batch = PackedCollator(seq_length=16, pad_id=0)(examples)
    assert batch["tokens"].shape[1] == 16 and batch["tokens"].shape[0] == 4  # 51 tokens need 4 rows of 16
    found = []
    for r in range(batch["tokens"].size(0)):
        positions = batch["position_ids"][r].tolist()
        starts = [i for i, p in enumerate(positions) if p == 0] + [16]
        for a, z in zip(starts, starts[1:]):
            if batch["padding_mask"][r, a]:
                assert batch["padding_mask"][r, a:].all() and batch["loss_mask"][r, a:].sum() == 0
                break
            ids = batch["tokens"][r, a:z].tolist()
            example = next(e for e in examples if e["input_ids"] == ids)
            found.append(examples.index(example))
            trained = ([t != -100 for t in example["labels"]] if "labels" in example else
                       [bool(m) for m in example.get("assistant_masks", [1] * len(ids))])
            assert batch["labels"][r, a:z - 1].tolist() == ids[1:]
            assert batch["loss_mask"][r, a:z - 1].tolist() == [float(t) for t in trained[1:]]
            assert batch["loss_mask"][r, z - 1] == 0  # an example's last token predicts nothing of its own
    assert sorted(found) == list(range(len(examples)))


def test_the_model_on_a_collated_batch_gives_each_examples_own_loss_and_gradients():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                               seq_length=16, vocab_size=50, hidden_dropout=0.0, attention_dropout=0.0,
                               position_embedding_type="rope", normalization="RMSNorm")).double()
    examples = _examples()
    loss = model(PackedCollator(16)(examples))
    loss.backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total, count = 0.0, 0
    for e in examples:
        ids = torch.tensor(e["input_ids"])[None]
        mask = PackedCollator(16)([e])["loss_mask"][:, :ids.size(1)].double()
        if mask.sum() == 0:
            continue
        part = model(ids, torch.cat((ids[:, 1:], ids[:, :1]), dim=1), mask) * mask.sum()
        part.backward()
        total, count = total + float(part.detach()), count + int(mask.sum())
    assert abs(float(loss.detach()) - total / count) <= 1e-12 * abs(total / count)
    for n, p in model.named_parameters():
        assert torch.allclose(packed[n], p.grad / count, rtol=1e-10, atol=1e-13), n


def test_bad_examples_are_refused():
    with pytest.raises(ValueError, match="example 0 has 17 tokens"):
        PackedCollator(16)([{"input_ids": list(range(17))}])
    with pytest.raises(ValueError, match="3 input_ids but 2 labels"):
        PackedCollator(16)([{"input_ids": [1, 2, 3], "labels": [1, 2]}])
