"""Multi-latent attention (``MLASelfAttention``) in float64.

* TP=1 against transformers' ``DeepseekV3Attention`` (weights copied by name: ours are named as its), with and
  without query compression, plain RoPE and YaRN with mscale / mscale_all_dim, with and without biases.
* TP=2, alone and with sequence parallelism, against TP=1 in a two-layer GPT: the loss and every parameter's
  gradient put back together over TP, the replicated down-projections' after the TP sum the package does in a
  step (``allreduce_tp_partial_grads`` of ``tp_partial_params``, as ``finalize_model_grads``); the TP=2 model
  recomputes its layers whole.  The built parameters are the planned ones (``gpt_param_counts``).
* Refusals at config time, one line naming the field.
"""
import pytest
import torch
import torch.distributed as dist
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_mla

from harness import run_on_ranks
from ds_megatron.config import ConfigError
from ds_megatron.config.cuda_graph import CudaGraphConfig
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelGroup, ParallelState
from ds_megatron.planning.param_counts import gpt_param_counts
from ds_megatron.tensor_parallel import allreduce_tp_partial_grads, init_method_normal, tp_partial_params
from ds_megatron.transformer.multi_latent_attention import MLASelfAttention

MLA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64, hidden_dropout=0.0,
           attention_dropout=0.0, position_embedding_type="rope", rotary_base=500.0, normalization="RMSNorm",
           norm_epsilon=1e-6, make_vocab_size_divisible_by=8,
           multi_latent_attention=True, q_lora_rank=8, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4,
           v_head_dim=5)
YARN_HF = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4, beta_fast=32, beta_slow=1,
               mscale=0.7, mscale_all_dim=1.0)
YARN_OURS = dict(rope_scaling_type="yarn", rope_scaling_factor=4.0, original_max_position_embeddings=4,
                 yarn_mscale=0.7, yarn_mscale_all_dim=1.0)


def _rms_norm_in_input_dtype(self, x):
    # transformers' RMSNorm computes in float32 whatever the input; the reference keeps float64 (same formula).
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.mark.parametrize("q_lora_rank", [8, None], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_matches_transformers_deepseek_v3_attention(monkeypatch, q_lora_rank, yarn):
    monkeypatch.setattr(hf_mla.DeepseekV3RMSNorm, "forward", _rms_norm_in_input_dtype)
    bias = q_lora_rank is not None  # biases of the down-projections and o_proj in one case, none in the other
    rope = {**dict(rope_type="default"), **(YARN_HF if yarn else {}), "rope_theta": 500.0}
    hf = DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
                          kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, rope_parameters=rope,
                          rms_norm_eps=1e-6, attention_bias=bias, max_position_embeddings=16, rope_interleave=True)
    hf._attn_implementation = "sdpa"  # the eager path takes its softmax in float32
    ref = hf_mla.DeepseekV3Attention(hf, 0).double().eval()
    config = GPTConfig(**{**MLA, "q_lora_rank": q_lora_rank, "add_bias_linear": bias, **(YARN_OURS if yarn else {})})
    torch.manual_seed(0)
    ours = MLASelfAttention(config, tp=ParallelGroup.single("tp"), init_method=init_method_normal(0.3),
                            output_init_method=init_method_normal(0.3)).double().eval()
    theirs = dict(ref.named_parameters())
    assert set(theirs) == {name for name, _ in ours.named_parameters()}
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("bias") or "layernorm" in name:  # not their init values (zeros / ones)
                p.copy_(torch.randn_like(p))
            theirs[name].copy_(p)
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    cos, sin = hf_mla.DeepseekV3RotaryEmbedding(hf)(x, torch.arange(16)[None].expand(2, -1))
    expected = ref(x, (cos, sin), None)[0]
    got = ours(x.transpose(0, 1).contiguous()).transpose(0, 1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    if yarn:  # the YaRN softmax correction is in play: (0.1 ln 4 + 1)^2 / sqrt(10)
        assert abs(ours.softmax_scale - ref.scaling) < 1e-15 and abs(ours.softmax_scale - 10 ** -0.5) > 0.05


def _tokens():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)


def _gather(t, param, state):
    if not getattr(param, "tensor_model_parallel", False) or state.tp.size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(state.tp.size)]
    dist.all_gather(parts, t.contiguous(), group=state.tp.group)
    return torch.cat(parts, dim=param.partition_dim)


def _loss_and_grads(state, config, check_partial=False):
    torch.manual_seed(11)
    model = GPTModel(config, state).double().train()
    tokens, labels = _tokens()
    loss = model(tokens, labels)
    loss.backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    partial = tp_partial_params(model)
    allreduce_tp_partial_grads(partial, state.tp)  # what finalize_model_grads does in a step
    counts = (sum(p.numel() for p in model.parameters() if getattr(p, "tensor_model_parallel", False)),
              sum(p.numel() for p in model.parameters() if not getattr(p, "tensor_model_parallel", False)))
    grads = {n: _gather(p.grad, p, state) for n, p in model.named_parameters()}
    weights = {n: _gather(p.detach(), p, state) for n, p in model.named_parameters()}
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.grad)}
    return float(loss.detach()), grads, weights, counts, changed, {id(p) for p in partial}, dict(model.named_parameters())


def _tp2_against_tp1(sp, recompute):
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=2))
    try:
        ref_loss, ref_grads, ref_weights, *_ = _loss_and_grads(ParallelState.single(), GPTConfig(**MLA))
        config = GPTConfig(**MLA, sequence_parallel=sp, recompute_granularity="full" if recompute else None)
        loss, grads, weights, counts, changed, partial, params = _loss_and_grads(state, config)
        planned = gpt_param_counts(config, tp=2)
        assert counts == (planned.sharded, planned.replicated), (counts, planned)
        assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
        for name, g in ref_grads.items():
            assert torch.equal(weights[name], ref_weights[name]), f"init of {name} depends on TP"
            torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-13, msg=name)
        # Every replicated MLA parameter is TP-partial (with and without SP), and its sum was needed.
        mla = [n for n in params if any(k in n for k in ("q_a_", "kv_a_"))]
        assert mla and all(id(params[n]) in partial for n in mla)
        assert all(n in changed for n in mla if "weight" in n)
        return True
    finally:
        state.destroy()


@pytest.mark.parametrize("sp,recompute", [(False, False), (True, True)], ids=["tp2", "tp2-sp-recompute"])
def test_tp2_equals_tp1(sp, recompute):
    assert all(run_on_ranks(2, _tp2_against_tp1, sp, recompute))


@pytest.mark.parametrize("extra,message", [
    ({"multi_latent_attention": False}, "model.q_lora_rank=8 is only read with model.multi_latent_attention true"),
    ({"qk_layernorm": True}, "model.qk_layernorm=True is not supported with model.multi_latent_attention"),
    ({"kv_channels": 8}, "model.kv_channels=8 is not supported with model.multi_latent_attention"),
    ({"add_qkv_bias": True}, "model.add_qkv_bias=True is not supported with model.multi_latent_attention"),
    ({"rotary_percent": 0.5}, "model.rotary_percent=0.5 is not supported with model.multi_latent_attention"),
    ({"num_query_groups": 2}, "model.num_query_groups=2 with model.multi_latent_attention"),
    ({"position_embedding_type": "learned_absolute"}, "model.position_embedding_type='learned_absolute' with "
                                                      "model.multi_latent_attention"),
    ({"qk_pos_emb_head_dim": 3}, "model.qk_pos_emb_head_dim=3 is odd"),
    ({"kv_lora_rank": 0}, "model.kv_lora_rank must be a positive integer"),
    ({"recompute_granularity": "selective", "recompute_modules": ["mla_up_proj"]}, "entry 'mla_up_proj'"),
])
def test_refused_at_config_time_in_one_line(extra, message):
    with pytest.raises(ConfigError, match=message) as e:
        GPTConfig(**{**MLA, **extra})
    assert "\n" not in str(e.value)


def test_accepted_with_cuda_graphs():
    # Captured like standard attention (tests/cuda_graphs/test_partial_capture.py on CPU; test_cuda_graphs_gpu.py)
    CudaGraphConfig(impl="local").check_moe_settings(GPTConfig(**MLA))
    GPTConfig(**{**MLA, "q_lora_rank": None})  # null: no query compression
