"""``megatron.cuda_graph``: validated at start, each error naming the field, the value and the fix."""
import pytest

from ds_megatron.config import ConfigError, MegatronConfig, split_config


def _parse(cuda_graph, model=None):
    section = {"cuda_graph": cuda_graph}
    if model is not None:
        section["model"] = model
    return MegatronConfig.from_section(section, {})


def test_defaults_are_off():
    cfg = MegatronConfig.from_section({}, {}).cuda_graph
    assert (cfg.impl, cfg.scope, cfg.enabled, cfg.required) == ("none", [], False, False)


def test_valid_partial_scope():
    cfg = _parse({"impl": "transformer_engine", "scope": ["attn", "moe_router", "moe_preprocess"], "warmup_steps": 2,
                  "required": True}, model={"num_experts": 4}).cuda_graph
    assert cfg.enabled and not cfg.whole_layer and cfg.warmup_steps == 2


@pytest.mark.parametrize("section, match", [
    ({"impl": "cudagraph"}, r"megatron.cuda_graph.impl='cudagraph' is unknown"),
    ({"impl": "transformer_engine", "scope": ["mlp"]}, r"megatron.cuda_graph.scope\[0\]='mlp' is unknown"),
    ({"impl": "transformer_engine", "scope": ["attn", "attn"]}, "lists an entry twice"),
    ({"impl": "transformer_engine", "scope": ["moe_preprocess"]}, "\"moe_preprocess\" without \"moe_router\""),
    ({"impl": "local", "scope": ["attn"]}, "captures whole layers only"),
    ({"impl": "transformer_engine", "warmup_steps": 0}, "warmup_steps must be an integer >= 1"),
    ({"impl": "transformer_engine", "scope": "attn"}, "megatron.cuda_graph.scope must be a JSON list"),
    ({"impl": "transformer_engine", "required": "yes"}, "megatron.cuda_graph.required must be of type bool"),
    ({"impl": "transformer_engine", "scopes": ["attn"]}, "unknown key megatron.cuda_graph.scopes"),
])
def test_bad_sections(section, match):
    with pytest.raises(ConfigError, match=match):
        _parse(section)


@pytest.mark.parametrize("scope, model, match", [
    # moe scopes on a dense model section
    (["attn", "moe_router"], {"num_layers": 2}, "model.num_experts is not set"),
    # dynamic shape: token dropping without padding changes the permuted token count
    (["attn", "moe_router", "moe_preprocess"], {"num_experts": 4, "moe_capacity_factor": 1.0},
     "moe_capacity_factor=1.0 drops tokens without padding"),
    # whole MoE layers need static expert shapes (drop and pad)
    ([], {"num_experts": 4}, "expert shapes are dynamic"),
    # and a dispatch free of host reads, which is not built
    ([], {"num_experts": 4, "moe_capacity_factor": 1.5, "moe_pad_expert_input_to_capacity": True},
     "reads its token counts on the host"),
])
def test_dynamic_shape_settings_are_refused(scope, model, match):
    with pytest.raises(ConfigError, match=match):
        _parse({"impl": "transformer_engine", "scope": scope}, model=model)


@pytest.mark.parametrize("scope, model", [
    (["attn", "moe_router", "moe_preprocess"], {"num_experts": 4}),  # no dropping: tokens x topk, static
    (["attn", "moe_router", "moe_preprocess"], {"num_experts": 4, "moe_capacity_factor": 1.0,
                                                "moe_pad_expert_input_to_capacity": True}),
    (["attn", "moe_router"], {"num_experts": 4, "moe_capacity_factor": 1.0}),  # router output shapes are static
    (["attn"], {"num_layers": 2}),
    ([], {"num_layers": 2}),  # whole dense layers
])
def test_static_shape_settings_pass(scope, model):
    _parse({"impl": "transformer_engine", "scope": scope}, model=model)


def test_off_ignores_moe_settings():
    _parse({"impl": "none", "scope": ["attn", "moe_router"]}, model={"num_layers": 2})


def test_example_config_parses():
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "ds_configs", "gpt_cuda_graphs.json")
    ds_config, cfg = split_config(path)
    assert "megatron" not in ds_config
    assert cfg.cuda_graph.impl == "transformer_engine" and "moe_preprocess" in cfg.cuda_graph.scope
