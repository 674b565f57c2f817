"""Gemma 2 / Gemma 3 beyond the shared logits tests (``test_hf_logits.py``, ``test_hf_packed.py``,
``test_convert_files.py``): context parallelism (windows and Gemma 2's soft-capped scores exact in every comm
type), config.json read as transformers reads it (its older form too), refusals in one line, the
(1 + w) RMSNorm against transformers' in bf16 and against autograd in float64, the embedding scale rounded as
transformers rounds it, recomputation, and ``plan``'s parameter count."""
import json

import pytest
import torch
import torch.distributed as dist
import transformers as T

import hf_models
from harness import run_on_ranks
from ds_megatron.config import ConfigError
from ds_megatron.config.hf_config import model_from_hf
from ds_megatron.config.model import GPTConfig
from ds_megatron.convert.checkpoint import HFSource
from ds_megatron.convert.model_io import load_weights
from ds_megatron.errors import ConvertError
from ds_megatron.models import GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.planning.param_counts import gpt_param_counts
from ds_megatron.transformer.context_parallel import zigzag_unsplit
from ds_megatron.transformer.norm import RMSNorm

COMM_TYPES = ("p2p", "all_gather", "a2a")


def _cp_logits(hf_dir, comm_types, toks):
    """Our model of ``hf_dir`` at CP = 2 with each comm type: the whole sequence's logits (zigzag chunks gathered)."""
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), cp=2))
    try:
        out = []
        for comm in comm_types:
            config = HFSource(hf_dir).gpt_config(seq_length=hf_models.SEQ, cp_comm_type=comm)
            model = GPTModel(config, state).double().eval()
            load_weights(model, hf_dir, state, [list(range(config.num_layers))])
            with torch.no_grad():
                mine = model(toks)[..., :config.vocab_size].contiguous()
            parts = [torch.empty_like(mine) for _ in range(state.cp.size)]
            dist.all_gather(parts, mine, group=state.cp.group)
            out.append(zigzag_unsplit(parts, seq_dim=1))
        return out
    finally:
        state.destroy()


@pytest.mark.parametrize("family", hf_models.GEMMA)
def test_windows_and_soft_caps_under_context_parallelism_equal_transformers(tmp_path, family):
    """Windows of 4 over zigzag chunks of 3 tokens: the cores mask each block by the tokens' global positions, and
    (Gemma 2) soft-cap its scores before the log-sum-exp merge."""
    hf = hf_models.make_model(family)
    hf_dir = hf_models.save(hf, str(tmp_path / "hf"))
    toks = hf_models.tokens()
    ref = hf_models.reference_logits(hf, toks)
    for rank in run_on_ranks(2, _cp_logits, hf_dir, COMM_TYPES, toks):
        for comm, got in zip(COMM_TYPES, rank):
            assert hf_models.max_relative_error(got, ref) < 1e-10, comm


def _hf_config(family, **overrides):
    """The config.json transformers writes for ``hf_models``' tiny ``family`` model."""
    cls, _, extra = hf_models.FAMILIES[family]
    kw = dict(vocab_size=hf_models.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    kw.update({k: v for k, v in extra.items() if k != "attn_implementation"})
    kw.update(overrides)
    out = json.loads(cls(**kw).to_json_string(use_diff=False))
    out["architectures"] = [{"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[family]]
    return out


def test_config_json_reads_as_transformers_builds_the_layers():
    _, gemma2 = model_from_hf(_hf_config("gemma2", num_hidden_layers=4))
    assert gemma2["window_size"] == [3, 0] and gemma2["window_attn_skip_freq"] == [1, 0, 1, 0]
    assert gemma2["softmax_scale"] == 24 ** -0.5 and gemma2["final_logit_softcapping"] == 3.0
    # transformers 5 rewrites the older Gemma 3 fields (a pattern of 6, rope_theta, rope_local_base_freq,
    # rope_scaling) into layer_types and per-type rope_parameters: both forms give the same model section
    old = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=100, hidden_size=32,
               intermediate_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               sliding_window=512, sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=16,
               cache_implementation="hybrid", hidden_activation="gelu_pytorch_tanh")
    _, ours = model_from_hf(old)
    new = json.loads(T.Gemma3TextConfig(**{k: v for k, v in old.items() if k != "architectures"}).to_json_string())
    new["architectures"] = old["architectures"]
    assert model_from_hf(new)[1] == ours
    assert ours["window_attn_skip_freq"] == [1, 1, 1, 1, 1, 0, 1, 1] and ours["window_size"] == [511, 0]
    assert (ours["rotary_base"], ours["local_rotary_base"]) == (1_000_000.0, 10_000.0)
    assert (ours["rope_scaling_type"], ours["rope_scaling_factor"]) == ("linear", 8.0)
    # Megatron's integer form picks the same layers: every 6th (1-based) full
    config = GPTConfig(**{**ours, "window_attn_skip_freq": 6})
    assert [config.attention_window(i) for i in range(8)] == [511] * 5 + [None] + [511] * 2


@pytest.mark.parametrize("family,field,value,match", [
    ("gemma3", "attn_logit_softcapping", 50.0, "transformers' Gemma 3 ignores it"),
    ("gemma3", "use_bidirectional_attention", True, "causal language models"),
    ("gemma2", "hidden_activation", "gelu", "gelu_pytorch_tanh"),
    ("gemma2", "attention_bias", True, "attention_bias false"),
    ("gemma3", "rope_parameters", {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
     "remove the scaling"),
    ("gemma3", "rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1e6,
                                                      "partial_rotary_factor": 0.5}}, "turns every channel"),
    ("gemma2", "attention_multiplier", 0.5, "does not know what this field changes in gemma2"),
])
def test_what_is_not_built_is_refused_naming_the_field(family, field, value, match):
    hf = _hf_config(family)
    hf[field] = value
    with pytest.raises(ConvertError, match=match) as e:
        model_from_hf(hf)
    assert str(e.value).startswith(f"config.json: {field}") and "\n" not in str(e.value)


@pytest.mark.parametrize("keys,match", [
    (dict(window_size=[3, 1]), r"model.window_size=\[3, 1\]: keys after the query"),
    (dict(window_size=[3, 0], window_attn_skip_freq=[1, 0, 1]), "must be a list of 2 \\(num_layers\\)"),
    (dict(window_attn_skip_freq=2), "model.window_attn_skip_freq is set but model.window_size is null"),
    (dict(local_rotary_base=100.0, position_embedding_type="learned_absolute"), "it is RoPE's base"),
    (dict(layernorm_zero_centered_gamma=True, normalization="LayerNorm"), "RMSNorm only"),
    (dict(softmax_scale=0.0), "model.softmax_scale must be a number > 0"),
])
def test_model_keys_that_do_not_fit_are_refused_in_one_line(keys, match):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, position_embedding_type="rope",
                normalization="RMSNorm")
    with pytest.raises(ConfigError, match=match) as e:
        GPTConfig(**{**base, **keys})
    assert "\n" not in str(e.value)


def test_zero_centered_rmsnorm_is_transformers_in_bf16_and_its_backward_autograds_in_float64():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 48, generator=g), torch.randn(48, generator=g)
    theirs = T.models.gemma3.modeling_gemma3.Gemma3RMSNorm(48, eps=1e-6)
    ours, ours64 = (RMSNorm(48, eps=1e-6, zero_centered_gamma=True) for _ in range(2))
    with torch.no_grad():
        for norm in (theirs, ours, ours64):
            norm.weight.copy_(w)
    bf16 = x.to(torch.bfloat16)
    assert torch.equal(ours.to(torch.bfloat16)(bf16), theirs.to(torch.bfloat16)(bf16))
    ours = ours64.double()
    x64 = x.double().requires_grad_()
    ours(x64).pow(3).sum().backward()
    ref_x, ref_w = x.double().requires_grad_(), w.double().requires_grad_()
    (ref_x * torch.rsqrt(ref_x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + ref_w)).pow(3).sum().backward()
    assert torch.allclose(x64.grad, ref_x.grad, rtol=1e-12, atol=1e-12)
    assert torch.allclose(ours.weight.grad, ref_w.grad, rtol=1e-12, atol=1e-12)


def test_embeddings_are_scaled_by_sqrt_hidden_rounded_to_bf16_as_transformers():
    hf = hf_models.make_model("gemma2", dtype=torch.bfloat16)
    config = GPTConfig(**model_from_hf(_hf_config("gemma2"))[1])
    model = GPTModel(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.word_embeddings.weight[:hf_models.VOCAB].copy_(hf.model.embed_tokens.weight)
        toks = hf_models.tokens()
        ours = model.position_embeddings(model.word_embeddings(toks)).transpose(0, 1)
        assert torch.equal(ours, hf.model.embed_tokens(toks))


def _loss_and_grads(config, toks, **recompute):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**{**config, **recompute}), ParallelState.single()).double().train()
    loss = model(toks, labels=toks.roll(-1, dims=1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("family", hf_models.GEMMA)
def test_recomputation_gives_the_same_loss_and_gradients(family):
    config = dict(model_from_hf(_hf_config(family))[1], seq_length=hf_models.SEQ)
    toks = hf_models.tokens()
    loss, grads = _loss_and_grads(config, toks)
    for recompute in (dict(recompute_granularity="full"),
                      dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm"])):
        again, grads_again = _loss_and_grads(config, toks, **recompute)
        assert torch.equal(loss, again) and all(torch.allclose(a, b, rtol=0, atol=1e-14)
                                                for a, b in zip(grads, grads_again)), recompute


@pytest.mark.parametrize("family", hf_models.GEMMA)
def test_plan_counts_the_parameters_the_model_has(family):
    config = GPTConfig(**model_from_hf(_hf_config(family))[1])
    model = GPTModel(config)
    assert gpt_param_counts(config, tp=1).total == sum(p.numel() for p in model.parameters())
