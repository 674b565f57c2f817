"""RoPE scaling and Qwen3 in ``config.json`` <-> our model section: both spellings, refusals in one line naming the
field, and the way back (a from-scratch export) read by transformers into the same tables; DeepSeek-V3's YaRN
(mscale / mscale_all_dim, attention_factor) into transformers' tables and multi-latent attention's softmax scale."""
import json

import pytest
import torch
import transformers as T
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import hf_models
from ds_megatron.config.hf_config import hf_config_from_model, hf_from_model, model_from_hf
from ds_megatron.config.model import GPTConfig
from ds_megatron.errors import ConvertError
from ds_megatron.transformer.rotary import rope_frequencies


def _config_json(family="llama", rope=None, **overrides):
    cls_config = hf_models.FAMILIES[family][0]
    kw = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, **hf_models.FAMILIES[family][2])
    if rope is not None:
        kw["rope_parameters"] = dict(hf_models.ROPE_SCALINGS[rope])
    kw.update(overrides)
    cfg = json.loads(cls_config(**kw).to_json_string())  # as save_pretrained writes it
    cfg["architectures"] = [hf_models.FAMILIES[family][1].__name__]
    return cfg


def test_both_spellings_give_the_same_model():
    new = _config_json(rope="yarn_mscale")
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in new["rope_parameters"].items()}
    assert model_from_hf(new) == model_from_hf(old)
    family, model = model_from_hf(new)
    assert (model["rope_scaling_type"], model["rope_scaling_factor"], model["original_max_position_embeddings"],
            model["yarn_mscale"], model["yarn_mscale_all_dim"], model["yarn_beta_fast"],
            model["yarn_correction_range_round_to_int"]) == ("yarn", 4.0, 64, 0.707, 1.0, 4.0, False)
    assert "rope_scaling_type" not in model_from_hf(_config_json())[1]  # plain RoPE: the section as before


def test_qwen3_maps_qk_norms_and_head_dim():
    family, model = model_from_hf(_config_json("qwen3"))
    assert family == "qwen3" and model["qk_layernorm"] and model["kv_channels"] == 16
    assert not model["add_qkv_bias"] and not model["add_bias_linear"]


def _refused(cfg, match):
    with pytest.raises(ConvertError) as e:
        model_from_hf(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config.json: ") and match in msg, msg


def test_moe_layer_sparsity_maps_to_the_list_form_as_transformers_builds_it():
    # transformers: layer i is sparse when i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    for family in ("qwen2_moe", "qwen3_moe"):
        cfg = _config_json(family, num_hidden_layers=6)
        assert "moe_layer_freq" not in model_from_hf(cfg)[1]  # every layer MoE: the integer default
        assert model_from_hf({**cfg, "decoder_sparse_step": 3})[1]["moe_layer_freq"] == [0, 0, 1, 0, 0, 1]
        assert model_from_hf({**cfg, "decoder_sparse_step": 2, "mlp_only_layers": [1, 4, 9]})[1][
            "moe_layer_freq"] == [0, 0, 0, 1, 0, 1]
        _refused({**cfg, "decoder_sparse_step": 0}, "decoder_sparse_step=0")
        _refused({**cfg, "mlp_only_layers": list(range(6))}, "no layer is MoE")
    _refused({**_config_json("mixtral"), "decoder_sparse_step": 2}, "decoder_sparse_step=2")


def test_unreproduced_rope_is_refused_naming_the_field():
    cfg = _config_json()
    _refused({**cfg, "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
                                         "rope_theta": 1e4}}, "rope_parameters.rope_type='longrope' is not supported")
    _refused({**cfg, "rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
             "rope_scaling.rope_type='dynamic' is not supported")
    _refused({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "short_factor": [1.0]}},
             "rope_parameters.short_factor=[1.0] is not supported; rope_type 'yarn' does not read it")
    _refused({**cfg, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
             "rope_parameters.low_freq_factor=None is not supported; rope_type 'llama3' needs it")
    _refused({**cfg, "rope_parameters": {"type": "linear", "rope_type": "yarn", "factor": 2.0}},
             "rope_parameters.type='linear' is not supported; it differs from rope_parameters.rope_type")
    _refused({**cfg, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
             "rope_parameters={'rope_theta': 10000.0, 'rope_type': 'default'} is not supported; it differs from "
             "rope_scaling")
    _refused(_config_json("qwen3", attention_bias=True), "attention_bias=True is not supported; qwen3 with "
                                                         "attention_bias biases o_proj without the MLP")


@pytest.mark.parametrize("family,rope", [("qwen3", "yarn_mscale"), ("llama", "llama3"), ("qwen2", "linear"),
                                         ("mistral", "yarn")])
def test_export_from_scratch_loads_into_the_same_tables(family, rope):
    """Our section -> config.json -> transformers: the same inverse frequencies and attention factor, and the
    config maps back to our section."""
    _, model = model_from_hf(_config_json(family, rope))
    hf = hf_config_from_model(family, model)
    assert model_from_hf(hf)[1] == model
    hf_config = T.AutoConfig.for_model(**hf)
    kind = hf_config.rope_parameters["rope_type"]
    ref, factor = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    ours, our_factor = rope_frequencies(GPTConfig(**model))
    assert torch.equal(ours, ref) and our_factor == factor


def test_export_refuses_what_transformers_cannot_express():
    # transformers reads mscale only together with a non-zero mscale_all_dim
    _, model = model_from_hf(_config_json("qwen3", "yarn"))
    with pytest.raises(ConvertError, match=r"model.yarn_mscale=0.707 cannot be exported as 'qwen3'"):
        hf_config_from_model("qwen3", {**model, "yarn_mscale": 0.707})
    # an imported model's export keeps the original config.json: a changed scaling is refused
    base = _config_json("llama", "llama3")
    family, model = model_from_hf(base)
    assert hf_from_model(family, model, base) == base
    with pytest.raises(ConvertError, match=r"model.rope_scaling_factor=16.0 differs from the Hugging Face model"):
        hf_from_model(family, {**model, "rope_scaling_factor": 16.0}, base)


@pytest.mark.parametrize("scaling", [dict(mscale=0.707, mscale_all_dim=1.0), dict(mscale_all_dim=1.0),
                                     dict(attention_factor=1.2, mscale_all_dim=0.8), dict(mscale=0.707), {}],
                         ids=["both", "all_dim_only", "attention_factor", "mscale_only", "neither"])
def test_deepseek_v3_yarn_gives_transformers_tables_and_softmax_scale(scaling):
    """DeepSeek-V3's YaRN: transformers scales MLA's softmax by m(factor, mscale_all_dim)^2 whenever mscale_all_dim
    is set, and cos / sin by attention_factor, or m(factor, mscale) / m(factor, mscale_all_dim) with both set, or
    the paper's 0.1 ln(factor) + 1."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    from ds_megatron.transformer.multi_latent_attention import mla_softmax_scale
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
            **scaling}
    hf = T.DeepseekV3Config(**{**hf_models.DEEPSEEK_V3, "rope_parameters": rope})
    cfg = json.loads(hf.to_json_string())
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    ours = GPTConfig(**model_from_hf(cfg)[1])
    ref, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    inv_freq, our_factor = rope_frequencies(ours)
    assert torch.equal(inv_freq, ref) and our_factor == pytest.approx(factor, rel=1e-15)
    qk = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    assert mla_softmax_scale(ours) == pytest.approx(yarn_apply_mscale(hf.rope_parameters, qk ** -0.5), rel=1e-15)
