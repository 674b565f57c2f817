"""DeepSeek-V3 (transformers' ``DeepseekV3ForCausalLM``) through the converter, in float64 against transformers.

One tiny random model per module (``hf_models.make_deepseek_v3``: query compression, YaRN with mscale /
mscale_all_dim, 2 expert groups of which 1 is kept, a shared expert, routed_scaling_factor 2.5, a dense first
layer, and a random non-zero ``e_score_correction_bias`` that changes which experts are chosen).  Our logits equal
transformers' (``hf_models.float64_reference``: its fp32 router in float64) to 1e-10 at TP=1 in this process and,
in one 4-rank gloo job, at TP=2 with SP, EP=2, EP=4 x ETP=1 (TP=2), EP=2 x ETP=2 (TP=2, SP), PP=2 (EP=2) and CP=2 (the ring
at TP=2 x EP=2, all-to-all at EP=2), each
read straight from the Hugging Face directory (``--load-hf``) and from the directory ``ds-megatron convert``
wrote; ``ds_megatron.from_pretrained`` at TP=1 and TP=2.  HF -> ours -> HF is bit-exact for every tensor at each
layout, and through a model's own buffers (``save_weights``), with config.json unchanged.  Refusals: one line
naming config.json and the field.

Multi-token prediction (``model.layers.{num_hidden_layers}``, which transformers neither builds nor runs): our loss
equals DeepSeek's, built from transformers' own decoder layer and norms, to 1e-10 at TP=1 (from HF and from ours) and
TP=2 with SP; HF -> ours (PP=2 x EP=2, the MTP layer on the last stage) -> HF bit-exact, the embedding and head
copies included; a copy that differs from the main model's is refused.  A directory transformers saved with its
default config (one MTP layer declared, none saved) loads the main model with MTP off and says so in one line.

The mapped model routes in fp32 (``moe_router_dtype``, as transformers does); the float64 runs set it to null.
"""
import json
import os

import pytest
import torch
import torch.distributed as dist

import hf_models
from harness import run_on_ranks
import ds_megatron
from ds_megatron.config.hf_config import hf_from_model, model_from_hf
from ds_megatron.config.model import GPTConfig
from ds_megatron.config.pipeline import stage_layer_counts, stage_layer_ranges
from ds_megatron.convert.checkpoint import HFSource, hf_to_ours, main as convert_main
from ds_megatron.convert.model_io import load_weights, save_weights
from ds_megatron.convert.safetensors_io import DTYPES
from ds_megatron.errors import ConvertError
from ds_megatron.models import GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState

F64 = dict(moe_router_dtype=None)  # our router in the activations' float64, as the reference's
LAYOUTS = [  # tp, pp, ep, etp, sequence parallel, context parallel ("p2p" / "a2a": CP=2 with that exchange)
    (2, 1, 1, None, True, None), (1, 1, 2, None, False, None), (2, 1, 4, 1, False, None), (2, 1, 2, 2, True, None),
    (1, 2, 2, None, False, None), (2, 1, 2, None, False, "p2p"), (1, 1, 2, None, False, "a2a"),
]


def _name(tp, pp, ep, etp, sp, cp):
    return f"tp{tp}-pp{pp}-ep{ep}-etp{etp or tp}{'-sp' if sp else ''}{f'-cp2-{cp}' if cp else ''}"


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(the transformers model, its directory, tokens, transformers' float64 logits, a directory for ours)."""
    return hf_models.saved_family(hf_models.make_deepseek_v3, tmp_path_factory.mktemp("deepseek_v3"))


def _convert(hf_dir, dst, tp=1, pp=1, ep=1, etp=None):
    argv = [hf_dir, dst, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep)] + (["--etp", str(etp)] if etp else [])
    assert convert_main(argv) == 0
    return dst


def test_config_maps_every_field():
    family, model = model_from_hf(_config_json_of())
    assert family == "deepseek_v3"
    assert {k: model[k] for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                  "qk_pos_emb_head_dim", "v_head_dim", "ffn_hidden_size", "moe_ffn_hidden_size",
                                  "moe_layer_freq", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                                  "moe_router_score_function", "moe_router_enable_expert_bias",
                                  "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
                                  "moe_router_dtype", "rope_scaling_type", "rope_scaling_factor", "yarn_mscale",
                                  "yarn_mscale_all_dim", "norm_epsilon")} == dict(
        multi_latent_attention=True, q_lora_rank=8, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4,
        v_head_dim=5, ffn_hidden_size=48, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1],
        moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=False, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32", rope_scaling_type="yarn",
        rope_scaling_factor=4.0, yarn_mscale=0.707, yarn_mscale_all_dim=1.0, norm_epsilon=1e-6)
    GPTConfig(**model)
    assert model_from_hf(_config_json_of(q_lora_rank=None))[1]["q_lora_rank"] is None
    # all groups kept is plain top-k; mscale_all_dim alone: cos / sin by transformers' default 0.1 ln(4) + 1, the
    # softmax by m(4, 1)^2
    one_group = model_from_hf(_config_json_of(n_group=1, topk_group=1))[1]
    assert "moe_router_num_groups" not in one_group
    rope = dict(hf_models.DEEPSEEK_V3["rope_parameters"], mscale=None)
    alone = model_from_hf(_config_json_of(rope_parameters=rope))[1]
    assert alone["yarn_mscale_all_dim"] == 1.0 and abs(alone["yarn_attention_factor"] - 1.1386294361) < 1e-9
    base = _config_json_of()
    assert hf_from_model(family, {**model, "moe_router_dtype": None}, base) == base


def _config_json_of(**overrides):
    import transformers as T
    return hf_models.hf_config_json(T.DeepseekV3Config, hf_models.DEEPSEEK_V3, "DeepseekV3ForCausalLM", **overrides)


def test_kimi_k2_and_the_original_remote_code_config_load_as_the_same_model():
    """Kimi K2's config.json (and DeepSeek-V3's own, remote code): model_type kimi_k2, rope_scaling with "type",
    the original code's routing fields; the same architecture, the seq_aux balancing loss's weight mapped."""
    ours = model_from_hf(_config_json_of())[1]
    kimi = {k: v for k, v in _config_json_of().items() if k not in ("rope_parameters", "head_dim", "qk_head_dim")}
    rope = dict(hf_models.DEEPSEEK_V3["rope_parameters"])
    kimi.update(model_type="kimi_k2", rope_scaling={("type" if k == "rope_type" else k): v for k, v in rope.items()
                                                    if k != "rope_theta"},
                rope_theta=rope["rope_theta"], scoring_func="sigmoid", topk_method="noaux_tc", seq_aux=True,
                aux_loss_alpha=0.001, moe_layer_freq=1, ep_size=1, torch_dtype="bfloat16",
                auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    family, model = model_from_hf(kimi)
    assert family == "deepseek_v3" and model == {**ours, "moe_aux_loss_coeff": 0.001}
    assert model["moe_router_load_balancing_type"] == "seq_aux_loss"


@pytest.mark.parametrize("overrides,match", [
    (dict(num_nextn_predict_layers=1, num_mtp_layers=2), "num_mtp_layers=2 is not supported; it differs from "
                                                          "num_nextn_predict_layers"),
    (dict(rope_interleave=False), "rope_interleave=False is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
    (dict(n_routed_experts=8, num_experts_per_tok=3), "topk_group=1 is not supported; transformers scores a group "
                                                       "by its 2 best"),
    (dict(n_group=3), "n_group=3 is not supported"),
    (dict(first_k_dense_replace=2), "first_k_dense_replace=2 is not supported"),
    (dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 is not supported"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05 is not supported"),
    (dict(hidden_act="relu"), "hidden_act='relu' is not supported"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    (dict(topk_method="group_limited_greedy"), "topk_method='group_limited_greedy' is not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config={'quant_method': 'fp8'} is not "
                                                        "supported; quantized weights are not converted"),
    (dict(qk_head_dim=9), "qk_head_dim=9 is not supported; transformers derives it as 10"),
    (dict(sliding_window=8), "sliding_window=8 is not supported"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_parameters.rope_type='dynamic'"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_unsupported_fields_are_refused_in_one_line(overrides, match):
    cfg = {**_config_json_of(), **overrides}
    if not {"num_nextn_predict_layers", "num_mtp_layers"} & set(overrides):
        cfg.pop("num_nextn_predict_layers")
        cfg["num_mtp_layers"] = 0  # transformers' other name of the field
    with pytest.raises(ConvertError) as e:
        model_from_hf(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config.json: ") and match in msg, msg


def test_tp1_equals_transformers_from_both_directories_and_from_pretrained(deepseek):
    hf_model, hf_dir, toks, ref, tmp = deepseek
    ours = _convert(hf_dir, str(tmp / "ours_tp1"))
    config = HFSource(hf_dir).gpt_config(seq_length=hf_models.SEQ, **F64)
    state = ParallelState.single()
    for path in (hf_dir, ours):
        model = GPTModel(config, state).double().eval()
        load_weights(model, path, state, [list(range(config.num_layers))])
        with torch.no_grad():
            assert hf_models.max_relative_error(model(toks)[..., :hf_models.VOCAB], ref) < 1e-10, path
        pretrained = ds_megatron.from_pretrained(path, dtype=torch.float64, seq_length=hf_models.SEQ, **F64)
        with torch.no_grad():
            assert hf_models.max_relative_error(pretrained.eval()(toks)[..., :hf_models.VOCAB], ref) < 1e-10, path
    bias = model.layers[1].mlp.router.expert_bias
    assert torch.equal(bias.double(), hf_model.model.layers[1].mlp.gate.e_score_correction_bias)
    assert bias.abs().min() > 0
    with torch.no_grad():  # the bias is in play: without it other experts are chosen
        bias.zero_()
        assert hf_models.max_relative_error(model(toks)[..., :hf_models.VOCAB], ref) > 1e-3
    hf_models.assert_round_trip(hf_dir, ours, str(tmp / "back_tp1"))



def _logits(paths, hf_dir, tp, pp, ep, etp, sp, cp, toks):
    """The logits of our model read from each of ``paths`` at one layout (built once): on the last stage's ranks,
    None on the others."""
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, pp=pp, ep=ep, etp=etp,
                                               cp=2 if cp else 1))
    config = HFSource(hf_dir).gpt_config(sequence_parallel=sp, seq_length=hf_models.SEQ, cp_comm_type=cp or "p2p",
                                         **F64)
    stages = [list(r) for r in stage_layer_ranges(stage_layer_counts(config.num_layers, pp, "uniform", None, None))]

    try:
        return [hf_models.layout_logits(config, state, path, stages, toks) for path in paths]
    finally:
        state.destroy()


def _from_pretrained_and_save(hf_dir, ours_tp2, toks, save_dir):
    """from_pretrained at TP=2 (from ours, and from HF with SP); then a model's own buffers written back
    (``save_weights``) at TP=2 x EP=2 x ETP=2."""
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=2))
    try:
        out = [hf_models.gather_logits(ds_megatron.from_pretrained(path, state, dtype=torch.float64, sequence_parallel=sp,
                                                         **F64).eval()(toks), state)
               for path, sp in ((ours_tp2, False), (hf_dir, True))]
    finally:
        state.destroy()
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=2, ep=2, etp=2))
    try:
        source = HFSource(hf_dir)
        model = GPTModel(source.gpt_config(), state)  # float32 parameters, as a job's; the weights are float64
        model.double()
        stages = [list(range(model.config.num_layers))]
        load_weights(model, hf_dir, state, stages)
        save_weights(model, save_dir, state, stages, source.family, source.hf_config,
                     {n: DTYPES[dt] for n, (_, dt, _) in source.table.items()})
    finally:
        state.destroy()
    return out


def test_every_layout_equals_transformers_and_round_trips(deepseek):
    _, hf_dir, toks, ref, tmp = deepseek
    ours = {lay: _convert(hf_dir, str(tmp / f"ours_{_name(*lay)}"), *lay[:4]) for lay in LAYOUTS}
    for lay in LAYOUTS:
        paths = (hf_dir, ours[lay])
        per_rank = run_on_ranks(4, _logits, paths, hf_dir, *lay, toks)
        for i, path in enumerate(paths):
            results = [r[i] for r in per_rank if r[i] is not None]
            assert results
            for got in results:
                err = hf_models.max_relative_error(got, ref)
                assert err < 1e-10, (_name(*lay), path, err)
        hf_models.assert_round_trip(hf_dir, ours[lay], str(tmp / f"back_{_name(*lay)}"))
    save_dir = str(tmp / "saved_tp2_ep2_etp2")
    for logits in run_on_ranks(4, _from_pretrained_and_save, hf_dir, ours[LAYOUTS[0]], toks, save_dir):
        assert all(hf_models.max_relative_error(got, ref) < 1e-10 for got in logits)
    hf_models.assert_round_trip(hf_dir, save_dir, str(tmp / "back_saved"))


# -- multi-token prediction ------------------------------------------------------------------------------------------
# transformers neither builds nor runs DeepSeek-V3's MTP layer (model.layers.{num_hidden_layers}), so the reference is
# built from its parts: a 3-layer transformers model whose layer 2 is the MTP layer's transformer block, run as a
# one-layer DeepseekV3Model (its final norm: shared_head.norm), after eh_proj([enorm(embedding of the tokens one
# ahead); hnorm(the main model's last hidden state after its norm)]) (the order vLLM serves DeepSeek-V3's MTP with),
# and the shared output head.

@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory):
    """(a Hugging Face DeepSeek-V3 directory with one MTP layer, the float64 reference loss of its tokens)."""
    import transformers as T
    tmp = tmp_path_factory.mktemp("deepseek_v3_mtp")
    whole = hf_models.make_deepseek_v3(num_hidden_layers=3)  # layer 2 becomes the MTP layer's block
    return (*hf_models.mtp_checkpoint(tmp, whole, hf_models.make_deepseek_v3, T.DeepseekV3Config,
                                      T.DeepseekV3Model, hf_models.DEEPSEEK_V3, "DeepseekV3ForCausalLM"), tmp)


def _mtp_loss(path, tp, sp, inputs, labels):
    """Our model of the MTP checkpoint at TP = ``tp`` (every rank: the whole loss)."""
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp))
    try:
        model = ds_megatron.from_pretrained(path, state, dtype=torch.float64, sequence_parallel=sp,
                                            seq_length=hf_models.SEQ, **F64).eval()
        with torch.no_grad():
            return model(inputs, labels)
    finally:
        state.destroy()


def test_the_mtp_layer_converts_and_gives_deepseeks_mtp_loss(deepseek_mtp):
    hf_dir, inputs, labels, ref, tmp = deepseek_mtp
    assert model_from_hf(hf_models.config_json(hf_dir))[1]["mtp_num_layers"] == 1
    for path in (hf_dir, _convert(hf_dir, str(tmp / "ours_tp1"))):
        got = run_on_ranks(1, _mtp_loss, path, 1, False, inputs, labels)[0]
        assert abs(float(got) - float(ref)) < 1e-10 * float(ref), (path, float(got), float(ref))
    for got in run_on_ranks(2, _mtp_loss, hf_dir, 2, True, inputs, labels):
        assert abs(float(got) - float(ref)) < 1e-10 * float(ref), float(got)
    # The MTP layer (MoE) on the last stage's files; back to Hugging Face with the embedding and head copies.
    hf_models.assert_round_trip(hf_dir, _convert(hf_dir, str(tmp / "ours_pp2_ep2"), pp=2, ep=2), str(tmp / "back_pp2_ep2"))


def test_a_directory_saved_by_transformers_with_its_default_mtp_config_loads_the_main_model(deepseek, tmp_path,
                                                                                             capsys):
    """transformers' DeepseekV3Config declares one MTP layer and save_pretrained writes none: the main model loads
    with MTP off (one line says so), equals transformers, exports with config.json unchanged and loads in
    transformers; mtp_num_layers 1 (fresh MTP layers) is refused in one line."""
    import transformers as T
    model, _, toks, ref, _ = deepseek
    hf = hf_models.make_deepseek_v3(num_nextn_predict_layers=1)
    hf_dir = hf_models.save(hf, str(tmp_path / "hf"))
    assert hf_models.config_json(hf_dir)["num_nextn_predict_layers"] == 1
    assert not any(n.startswith("model.layers.2.") for n in hf_models.directory_tensors(hf_dir))
    ours = ds_megatron.from_pretrained(hf_dir, dtype=torch.float64, seq_length=hf_models.SEQ, **F64).eval()
    assert ours.config.mtp_num_layers is None
    assert capsys.readouterr().out == (f"{hf_dir}: config.json declares 1 multi-token-prediction layer(s) "
                                       "(num_nextn_predict_layers) but the files hold none, as transformers saves "
                                       "them: loading the main model with MTP off, as transformers runs it\n")
    with torch.no_grad():
        assert hf_models.max_relative_error(ours(toks)[..., :hf_models.VOCAB], ref) < 1e-10
    converted = _convert(hf_dir, str(tmp_path / "ours"))
    hf_models.assert_round_trip(hf_dir, converted, str(tmp_path / "back"))
    reloaded = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float64)
    assert all(torch.equal(p, hf.state_dict()[n]) for n, p in reloaded.state_dict().items())
    with pytest.raises(ConvertError, match=r"^mtp_num_layers=1: \S+ declares 1 multi-token-prediction layer\(s\) and "
                                           r"its files hold none \(transformers never saves them\); use 0 or leave "
                                           r"it unset \(fresh MTP layers are not built\)$"):
        ds_megatron.from_pretrained(hf_dir, mtp_num_layers=1)


def test_an_mtp_copy_that_differs_from_the_main_models_is_refused(deepseek_mtp, tmp_path):
    from safetensors.torch import save_file
    hf_dir = deepseek_mtp[0]
    bad = tmp_path / "bad"
    bad.mkdir()
    sd = hf_models.directory_tensors(hf_dir)
    sd["model.layers.2.shared_head.head.weight"][0, 0] += 1
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text(json.dumps(hf_models.config_json(hf_dir)))
    with pytest.raises(ConvertError, match=r"tensor model.layers.2.shared_head.head.weight differs from "
                                           r"lm_head.weight, which ds_megatron's multi-token-prediction layer shares"):
        hf_to_ours(str(bad), str(tmp_path / "ours"))
    assert not os.path.exists(tmp_path / "ours")
