"""GLM-4.5 / 4.6 (transformers' ``Glm4MoeForCausalLM``) through the converter, in float64 against transformers.

One tiny random model per module (``hf_models.make_glm4_moe``: head_dim 16 != hidden / heads with the first 8
channels rotated (partial_rotary_factor 0.5, transformers' default), q/k/v biases, q/k norms, 2 query groups,
sigmoid routing over 2 expert groups of which 1 is kept, a random non-zero ``e_score_correction_bias`` that changes
the choice, a shared expert, routed_scaling_factor 2.5, a dense first layer), saved by transformers with its default
of one multi-token-prediction layer declared and no MTP tensor: the main model loads with MTP off and one line says
so.  Our logits equal transformers' (``hf_models.float64_reference``: its fp32 router in float64) to 1e-10 at TP=1
(``from_pretrained``, and our converted directory), and in one 4-rank job at TP=2 with SP, TP=4 with SP (more
ranks than query groups), EP=2, PP=2 x EP=2 and CP=2 (the ring at TP=2, all-to-all at EP=2); HF -> ours -> HF is bit-exact with config.json unchanged.

MTP layers present (a released GLM-4.5's ``model.layers.{num_hidden_layers}``, which transformers neither builds nor
runs): our loss equals one built from transformers' own decoder layer and norms (as for DeepSeek-V3), and the
layer round-trips, with the embedding / head copies (GLM-4.5) or without them (GLM-4.6's files lack them); the
plan's parameter count is the model's, with and without the MTP layer.
"""
import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import hf_models
from harness import run_on_ranks
import ds_megatron
from ds_megatron.config.hf_config import hf_from_model, model_from_hf
from ds_megatron.config.model import GPTConfig
from ds_megatron.config.pipeline import stage_layer_counts, stage_layer_ranges
from ds_megatron.convert.checkpoint import HFSource, hf_to_ours
from ds_megatron.errors import ConvertError
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState

F64 = dict(moe_router_dtype=None)  # our router in the activations' float64, as the reference's
VOCAB, SEQ = hf_models.VOCAB, hf_models.SEQ


def _config_json_of(**overrides):
    import transformers as T
    return hf_models.hf_config_json(T.Glm4MoeConfig, hf_models.GLM4_MOE, "Glm4MoeForCausalLM", **overrides)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(the transformers model, its directory as transformers saved it, tokens, float64 logits, a directory)."""
    return hf_models.saved_family(hf_models.make_glm4_moe, tmp_path_factory.mktemp("glm4_moe"))


def test_config_maps_every_field():
    family, model = model_from_hf(_config_json_of())
    assert family == "glm4_moe"
    assert {k: model[k] for k in (
        "kv_channels", "num_query_groups", "rotary_percent", "add_qkv_bias", "add_bias_linear", "qk_layernorm",
        "norm_epsilon", "ffn_hidden_size", "moe_ffn_hidden_size", "moe_layer_freq",
        "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_score_function",
        "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
        "moe_router_topk_scaling_factor", "moe_router_dtype", "mtp_num_layers")} == dict(
        kv_channels=16, num_query_groups=2, rotary_percent=0.5, add_qkv_bias=True, add_bias_linear=False,
        qk_layernorm=True, norm_epsilon=1e-5, ffn_hidden_size=48, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1],
        moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=False, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32", mtp_num_layers=1)
    GPTConfig(**model)
    # GLM-4.5's own config.json (transformers 4.54): top-level rope_theta and partial_rotary_factor, head_dim 128
    real = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
            "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 5120, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 12288,
            "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1536,
            "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
            "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
            "num_hidden_layers": 92, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05,
            "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": True, "vocab_size": 151552}
    m = model_from_hf(real)[1]
    assert (m["kv_channels"], m["rotary_percent"], m["rotary_base"], m["moe_layer_freq"][:4], m["num_experts"]) == \
        (128, 0.5, 1e6, [0, 0, 0, 1], 160) and "moe_router_num_groups" not in m
    GPTConfig(**m)
    # no partial_rotary_factor anywhere: transformers' default 0.5; GLM-4.6's 0.5 inside rope_parameters
    del real["partial_rotary_factor"]
    assert model_from_hf(real)[1]["rotary_percent"] == 0.5
    base = _config_json_of()
    assert hf_from_model(family, {**model, "moe_router_dtype": None}, base) == base
    assert hf_from_model(family, {k: v for k, v in model.items() if k != "mtp_num_layers"}, base) == base  # MTP off


@pytest.mark.parametrize("overrides,match", [
    (dict(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
    (dict(n_routed_experts=8, num_experts_per_tok=3), "topk_group=1 is not supported; transformers scores a group "
                                                       "by its 2 best"),
    (dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
    (dict(first_k_dense_replace=2), "first_k_dense_replace=2 is not supported"),
    (dict(hidden_act="relu"), "hidden_act='relu' is not supported"),
    (dict(num_mtp_layers=2), "num_mtp_layers=2 is not supported; it differs from num_nextn_predict_layers"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config={'quant_method': 'fp8'} is not "
                                                        "supported; quantized weights are not converted"),
    (dict(sliding_window=8), "sliding_window=8 is not supported"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_parameters.rope_type='dynamic'"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_unsupported_fields_are_refused_in_one_line(overrides, match):
    with pytest.raises(ConvertError) as e:
        model_from_hf({**_config_json_of(), **overrides})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config.json: ") and match in msg, msg


def test_transformers_saved_directory_loads_with_mtp_off_and_equals_transformers(glm, capsys):
    hf_model, hf_dir, toks, ref, tmp = glm
    assert hf_models.config_json(hf_dir)["num_nextn_predict_layers"] == 1  # transformers' default, no tensor saved
    ours = hf_to_ours(hf_dir, str(tmp / "ours_tp1"))
    assert capsys.readouterr().out.count("multi-token-prediction layer(s) (num_nextn_predict_layers) but the files "
                                         "hold none, as transformers saves them: loading the main model with MTP "
                                         "off") == 1
    for path in (hf_dir, ours):
        model = ds_megatron.from_pretrained(path, dtype=torch.float64, seq_length=SEQ, **F64).eval()
        assert model.config.mtp_num_layers is None and model.config.rotary_percent == 0.5
        with torch.no_grad():
            assert hf_models.max_relative_error(model(toks)[..., :VOCAB], ref) < 1e-10, path
    assert capsys.readouterr().out.count("loading the main model with MTP off") == 1  # the HF directory's, once
    off = ds_megatron.from_pretrained(hf_dir, dtype=torch.float64, mtp_num_layers=0, **F64)
    assert off.config.mtp_num_layers is None and "MTP off" not in capsys.readouterr().out  # asked: no line
    with pytest.raises(ConvertError, match=r"^mtp_num_layers=1: \S+ declares 1 multi-token-prediction layer\(s\) "
                                           r"and its files hold none .* \(fresh MTP layers are not built\)$"):
        ds_megatron.from_pretrained(hf_dir, mtp_num_layers=1)
    bias = model.layers[1].mlp.router.expert_bias
    assert torch.equal(bias.double(), hf_model.model.layers[1].mlp.gate.e_score_correction_bias)
    with torch.no_grad():  # the bias is in play: without it other experts are chosen
        bias.zero_()
        assert hf_models.max_relative_error(model(toks)[..., :VOCAB], ref) > 1e-3
    hf_models.assert_round_trip(hf_dir, ours, str(tmp / "back_tp1"))


# tp, pp, ep, sequence parallel, context parallel ("p2p" / "a2a": CP=2 with that exchange), read from
LAYOUTS = [(2, 1, 1, True, None, "hf"), (4, 1, 1, True, None, "ours"), (1, 1, 2, False, None, "ours"),
           (1, 2, 2, False, None, "hf"), (2, 1, 1, False, "p2p", "ours"), (1, 1, 2, False, "a2a", "hf")]



def _logits_of_layouts(cases, hf_dir, toks):
    """Our logits at each (layout, path) of ``cases``, one layout after the other in this job: on the last stage's
    ranks, None on the others."""
    out = []
    for (tp, pp, ep, sp, cp, _), path in cases:
        state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, pp=pp, ep=ep,
                                                   cp=2 if cp else 1))
        config = HFSource(hf_dir).gpt_config(sequence_parallel=sp, seq_length=SEQ, cp_comm_type=cp or "p2p", **F64)
        stages = [list(r) for r in stage_layer_ranges(stage_layer_counts(config.num_layers, pp, "uniform", None,
                                                                         None))]
        try:
            out.append(hf_models.layout_logits(config, state, path, stages, toks))
        finally:
            state.destroy()
    return out


def test_every_layout_equals_transformers_and_round_trips(glm):
    _, hf_dir, toks, ref, tmp = glm
    cases = []
    for i, lay in enumerate(LAYOUTS):
        tp, pp, ep, _, _, via = lay
        ours = str(tmp / f"ours_{i}")
        cases.append((lay, hf_to_ours(hf_dir, ours, tp=tp, pp=pp, ep=ep) if via == "ours" else hf_dir))
    per_rank = run_on_ranks(4, _logits_of_layouts, cases, hf_dir, toks)
    for i, (lay, path) in enumerate(cases):
        results = [r[i] for r in per_rank if r[i] is not None]
        assert results
        for got in results:
            err = hf_models.max_relative_error(got, ref)
            assert err < 1e-10, (lay, err)
        if path != hf_dir:
            hf_models.assert_round_trip(hf_dir, path, str(tmp / f"back_{i}"))


# -- multi-token prediction present ----------------------------------------------------------------------------------
# As for DeepSeek-V3 (tests/convert/test_hf_deepseek_v3.py): a 3-layer transformers model whose layer 2 is the MTP
# layer's block, run as a one-layer Glm4MoeModel (its final norm: shared_head.norm) after eh_proj([enorm(embedding of
# the tokens one ahead); hnorm(the main model's last hidden state after its norm)]), and the shared output head.

@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory):
    """(a GLM-4.5 directory with one MTP layer, inputs, labels, the float64 reference loss, a directory)."""
    import transformers as T
    tmp = tmp_path_factory.mktemp("glm4_moe_mtp")
    whole = hf_models.make_glm4_moe(num_hidden_layers=3, num_nextn_predict_layers=0)
    return (*hf_models.mtp_checkpoint(tmp, whole, hf_models.make_glm4_moe, T.Glm4MoeConfig, T.Glm4MoeModel,
                                      hf_models.GLM4_MOE, "Glm4MoeForCausalLM"), tmp)


def test_the_mtp_layer_converts_and_gives_the_mtp_loss(glm_mtp, capsys):
    hf_dir, inputs, labels, ref, tmp = glm_mtp
    ours = hf_to_ours(hf_dir, str(tmp / "ours_pp2_ep2"), pp=2, ep=2)
    model = ds_megatron.from_pretrained(hf_dir, dtype=torch.float64, seq_length=SEQ, **F64).eval()
    assert model.config.mtp_num_layers == 1 and "MTP off" not in capsys.readouterr().out
    with torch.no_grad():
        got = float(model(inputs, labels))
    assert abs(got - float(ref)) < 1e-10 * float(ref), (got, float(ref))
    hf_models.assert_round_trip(hf_dir, ours, str(tmp / "back_pp2_ep2"))
    # asked off: the MTP tensors are left unread, the main model loads
    off = ds_megatron.from_pretrained(hf_dir, dtype=torch.float64, seq_length=SEQ, mtp_num_layers=0, **F64)
    assert off.config.mtp_num_layers is None
    # `ds-megatron plan` counts the parameters the model has (q/k/v biases, q/k norms, the MTP layer)
    from ds_megatron.planning import gpt_param_counts
    for m in (model, off):
        assert gpt_param_counts(m.config, 1).total == sum(p.numel() for p in m.parameters())


def test_mtp_layers_without_the_embedding_and_head_copies_round_trip(glm_mtp, tmp_path):
    """GLM-4.6's files hold the MTP layer without ``embed_tokens`` / ``shared_head.head``: it loads, and exports
    without them."""
    hf_dir = glm_mtp[0]
    lean = tmp_path / "lean"
    lean.mkdir()
    sd = {k: v for k, v in hf_models.directory_tensors(hf_dir).items() if not k.endswith(("layers.2.embed_tokens.weight",
                                                                          "layers.2.shared_head.head.weight"))}
    save_file(sd, str(lean / "model.safetensors"), metadata={"format": "pt"})
    (lean / "config.json").write_text(json.dumps(hf_models.config_json(hf_dir)))
    hf_models.assert_round_trip(str(lean), hf_to_ours(str(lean), str(tmp_path / "ours")), str(tmp_path / "back"))
