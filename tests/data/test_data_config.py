"""megatron.data's dataset keys: Megatron's blend lists, train/valid/test paths, the pretraining flags; every bad value
refused in one line naming the field (and the list element)."""
import numpy as np
import pytest

from ds_megatron.config import ConfigError
from ds_megatron.config.parsing import parse_section
from ds_megatron.config.training import Blend, DataConfig
from ds_megatron.data.indexed_dataset import IndexedDatasetBuilder


def _data(**section):
    return parse_section(DataConfig, section, "megatron.data")


@pytest.fixture()
def prefixes(tmp_path):
    out = []
    for name, top in (("a", 200), ("b", 300)):
        prefix = str(tmp_path / name)
        with IndexedDatasetBuilder(prefix, np.int32) as builder:
            builder.add_document(np.arange(top))
        out.append(prefix)
    return out


def test_blend_forms(prefixes):
    a, b = prefixes
    assert _data(data_path=a).blend("data_path") == Blend([a], None, ["megatron.data.data_path"])
    assert _data(data_path=["0.3", a, "0.7", b]).blend("data_path") == Blend(
        [a, b], [0.3, 0.7], ["megatron.data.data_path[1]", "megatron.data.data_path[3]"])
    assert _data(data_path=[3, a, 7, b]).blend("data_path").weights == [3.0, 7.0]  # JSON numbers too
    assert _data(data_path=[a, b]).blend("data_path") == Blend(
        [a, b], None, ["megatron.data.data_path[0]", "megatron.data.data_path[1]"])
    data = _data(train_data_path=["1", a, "2", b], valid_data_path=b, test_data_path=a)
    assert data.split is None and data.blend("data_path") is None and data.blend("valid_data_path").prefixes == [b]
    assert _data().split == "98,2" and _data(data_path=a).split == "98,2"


@pytest.mark.parametrize("value,message", [
    (["0.3", "A", "0.7"], r"data_path has 3 elements, an odd number, but starts with a weight"),
    (["0.3", "A", "x", "B"], r"data_path\[2\]='x' is not a number; a blend list is weight, prefix pairs"),
    (["0.3", "A", "0", "B"], r"data_path\[2\]='0': a weight must be a finite number > 0"),
    (["-1", "A", "2", "B"], r"data_path\[0\]='-1': a weight must be a finite number > 0"),
    (["0.3", "A", "0.7", "missing"], r"data_path\[3\]='.*missing' has no .*missing.bin / .idx; make them with "
                                     r"`ds-megatron preprocess"),
    (["A", "0.5"], r"data_path\[1\]='0.5' is a number in a list of prefixes; a weighted blend starts with a weight"),
    (["0.3", 0.5], r"data_path\[1\]=0.5 must be a dataset prefix \(a string\)"),
    ([], r"data_path is an empty list"),
])
def test_bad_blend_lists_name_the_element(prefixes, value, message):
    value = [prefixes[0] if v == "A" else prefixes[1] if v == "B" else v for v in value]
    value = [str(prefixes[0]).replace("/a", "/missing") if v == "missing" else v for v in value]
    with pytest.raises(ConfigError, match="megatron.data." + message):
        _data(data_path=value)


def test_conflicting_keys_are_refused(prefixes):
    a, b = prefixes
    with pytest.raises(ConfigError, match="megatron.data.data_path and megatron.data.train_data_path are both set"):
        _data(data_path=a, train_data_path=b)
    with pytest.raises(ConfigError, match="megatron.data.split='90,10' is set with megatron.data.train_data_path, "
                                          "which is not cut by split"):
        _data(train_data_path=a, split="90,10")
    with pytest.raises(ConfigError, match="megatron.data.valid_data_path is set without megatron.data.train_data_path"):
        _data(valid_data_path=a)
    with pytest.raises(ConfigError, match=r"megatron.data.dataloader_type \"cyclic\" reshuffles one pass over a "
                                          r"single dataset, but the train set is a blend"):
        _data(data_path=[a, b], dataloader_type="cyclic")
    assert _data(train_data_path=a, valid_data_path=[a, b], dataloader_type="cyclic").dataloader_type == "cyclic"


def test_pretraining_flags():
    assert _data(eod_mask_loss=True).eod_mask_loss
    assert _data(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True).reset_position_ids
    with pytest.raises(ConfigError, match="megatron.data.reset_position_ids=true but reset_attention_mask=false: "
                                          "our models cut attention exactly where the position ids restart"):
        _data(reset_position_ids=True, eod_mask_loss=True)
    with pytest.raises(ConfigError, match="reset_position_ids=false but reset_attention_mask=true"):
        _data(reset_attention_mask=True, eod_mask_loss=True)
    with pytest.raises(ConfigError, match="reset_attention_mask are true but eod_mask_loss is false: each EOD's "
                                          "label is then the next document's first token"):
        _data(reset_position_ids=True, reset_attention_mask=True)


def test_vocab_is_checked_over_every_prefix(prefixes):
    a, b = prefixes
    data = _data(data_path=["0.5", a, "0.5", b])
    data.check_vocab(300)
    with pytest.raises(ConfigError, match=r"megatron.data.data_path\[3\]='.*b' holds token id 299 but "
                                          r"megatron.model.vocab_size=299"):
        data.check_vocab(299)


def test_packed_rows_are_refused_where_they_cannot_be_kept_apart(prefixes):
    """Rows packing several documents (Megatron's reset flags here) with CUDA graphs, or with DeepSpeed's
    PipelineEngine (which passes tokens and labels only); our pipeline runtime takes them."""
    from ds_megatron.config.megatron import split_config
    flags = {"data_path": prefixes[0], "reset_position_ids": True, "reset_attention_mask": True,
             "eod_mask_loss": True}
    assert _data(**flags).packed_sequences and not _data(data_path=prefixes[0]).packed_sequences

    def config(**megatron):
        return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                "megatron": {"data": flags, **megatron}}
    with pytest.raises(ConfigError, match=r"^megatron.cuda_graph.impl=.local. but megatron.data packs several "
                                          r"documents per row.*set cuda_graph.impl \"none\"$"):
        split_config(config(cuda_graph={"impl": "local"}))
    with pytest.raises(ConfigError, match=r"^megatron.data packs several documents per row, but with "
                                          r"megatron.optimizer_impl \"deepspeed\".*use optimizer_impl \"megatron\""):
        split_config(config(pipeline_model_parallel_size=2, optimizer_impl="deepspeed"))[1].layout(2)
    assert split_config(config(pipeline_model_parallel_size=2))[1].layout(2).pp == 2


def test_a_packed_sft_dataset_refuses_the_reset_flags(tmp_path):
    import chat_data
    from ds_megatron.data.preprocess import preprocess_sft
    tokenizer = chat_data.write_tokenizer(str(tmp_path / "tok"))
    prefix = str(tmp_path / "chat")
    preprocess_sft(chat_data.write_chat_jsonl(str(tmp_path / "chat.jsonl"), 10), prefix, tokenizer, 512)
    assert _data(data_path=prefix, tokenizer=tokenizer).packed_sequences
    with pytest.raises(ConfigError, match=r"but megatron.data.data_path is a packed SFT dataset .* set both false"):
        _data(data_path=prefix, tokenizer=tokenizer, reset_position_ids=True, reset_attention_mask=True,
              eod_mask_loss=True)
