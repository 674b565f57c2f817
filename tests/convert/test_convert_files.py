"""``ds-megatron convert``: Hugging Face -> ours -> Hugging Face is bit-exact; bad inputs fail in one line, writing nothing."""
import json
import os

import pytest
import torch
from safetensors import safe_open

import hf_models
from ds_megatron.cli import main as cli_main
from ds_megatron.convert.checkpoint import METADATA, convert
from ds_megatron.errors import ConvertError


def _tensors(directory):
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(directory, f), "pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.mark.parametrize("family,layout,dtype,rope", [
    ("llama", dict(tp=2, pp=2), torch.float32, None), ("mistral", dict(tp=4), torch.bfloat16, None),
    ("qwen2", dict(tp=2, pp=2), torch.float32, None), ("mixtral", dict(tp=2, ep=2, etp=1), torch.bfloat16, None),
    ("qwen2_moe", dict(tp=4, pp=2, ep=2), torch.float32, None), ("qwen3_moe", dict(tp=4, ep=4), torch.float32, None),
    ("qwen3", dict(tp=2, pp=2), torch.bfloat16, "yarn_mscale"), ("llama", dict(pp=2), torch.float32, "llama3"),
    ("gemma2", dict(tp=2, pp=2), torch.bfloat16, None), ("gemma3", dict(tp=2, pp=2), torch.float32, None)])
def test_round_trip_is_bit_exact(tmp_path, family, layout, dtype, rope):
    model = hf_models.make_model(family, dtype=dtype, rope=rope)
    src = hf_models.save(model, str(tmp_path / "hf"))
    args = [f"--{k}={v}" for k, v in layout.items()]
    assert cli_main(["convert", src, str(tmp_path / "ours"), *args]) == 0
    assert os.path.isfile(tmp_path / "ours" / METADATA)
    if rope is not None:  # our model section holds the scaling (config.json must come back with it, below)
        model_section = json.load(open(tmp_path / "ours" / METADATA))["model"]
        assert model_section["rope_scaling_type"] == hf_models.ROPE_SCALINGS[rope]["rope_type"]
    assert cli_main(["convert", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    before, after = _tensors(src), _tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype == dtype, name
        assert torch.equal(before[name], after[name]), name
    for f in ("config.json", "generation_config.json"):
        assert json.load(open(tmp_path / "hf" / f)) == json.load(open(tmp_path / "back" / f))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    return hf_models.save(hf_models.make_model("llama", dtype=torch.float32), str(d / "hf"))


def _copy(src, dst):
    os.makedirs(dst)
    for f in os.listdir(src):
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
            b.write(a.read())
    return dst


def _fails(src, dst, match, **layout):
    with pytest.raises(ConvertError) as e:
        convert(src, dst, **layout)
    msg = str(e.value)
    assert "\n" not in msg
    assert match in msg, msg
    assert not os.path.exists(dst)
    assert not [f for f in os.listdir(os.path.dirname(dst)) if f.startswith(".")]  # no temporary left
    return msg


def test_unsupported_config_is_refused(tmp_path, llama_dir):
    src = _copy(llama_dir, str(tmp_path / "scaled"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    _fails(src, str(tmp_path / "out"), "config.json: rope_parameters.rope_type='dynamic' is not supported")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    _fails(src, str(tmp_path / "out"), "architectures=['GPT2LMHeadModel'] is not supported")


def test_unknown_config_field_is_refused(tmp_path, llama_dir):
    src = _copy(llama_dir, str(tmp_path / "odd"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["attention_multiplier"] = 0.5
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    _fails(src, str(tmp_path / "out"), "attention_multiplier=0.5 is not supported")


def test_missing_shard_names_the_file_and_tensor(tmp_path, llama_dir):
    src = _copy(llama_dir, str(tmp_path / "sharded"))
    os.rename(os.path.join(src, "model.safetensors"), os.path.join(src, "model-00001-of-00002.safetensors"))
    with safe_open(os.path.join(src, "model-00001-of-00002.safetensors"), "pt") as st:
        names = list(st.keys())
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    json.dump({"weight_map": weight_map}, open(os.path.join(src, "model.safetensors.index.json"), "w"))
    msg = _fails(src, str(tmp_path / "out"), "model-00002-of-00002.safetensors: missing shard", tp=2)
    assert "model.norm.weight" in msg


def test_shape_mismatch_names_the_file_and_tensor(tmp_path, llama_dir):
    src = _copy(llama_dir, str(tmp_path / "wide"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["intermediate_size"] = 96
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    msg = _fails(src, str(tmp_path / "out"), "model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has "
                 "shape [64, 32] but config.json implies [96, 32]")
    assert msg.startswith(src)


def test_layout_that_does_not_divide_is_refused(tmp_path, llama_dir):
    with pytest.raises(Exception, match="num_attention_heads=4 is not divisible by tensor_model_parallel_size=3"):
        convert(llama_dir, str(tmp_path / "out"), tp=3)
    assert not os.path.exists(tmp_path / "out")


def test_existing_destination_is_never_overwritten(tmp_path, llama_dir):
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ConvertError, match="the destination exists"):
        convert(llama_dir, str(dst))
    assert (dst / "keep.txt").read_text() == "mine"
