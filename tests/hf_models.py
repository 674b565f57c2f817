"""Tiny random Hugging Face models of each family, and their float64 reference logits.

transformers computes RMSNorm and the MoE router's softmax in float32 whatever
the model's dtype; the reference runs those same formulas in float64 instead
(patched per module below), so that a float64 comparison can reach 1e-10.
RoPE tables stay transformers' own (float32, as ours are).  ``ROPE_SCALINGS``: a
``rope_parameters`` of each scaled type, sized so that the tiny models' frequencies
fall on both sides of (and inside) each type's bands.
"""
import os
import types

import torch
import transformers as T

FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 16}),  # head_dim != hidden / heads
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 24}),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 16,
                   "norm_topk_prob": True}),
}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
# With theta 10000, 8 or 16 channels per head and an original context of 64, llama3 keeps, blends and divides
# (wavelengths 6, 63, 628, ... against 16 and 64) and yarn ramps between pairs 0 and 2 or 3.
ROPE_SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 4.0, "truncate": False, "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
}
VOCAB, SEQ = 100, 12


def _rms_f64(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _router_f64(self, x):
    x = x.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(x, self.weight)
    top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalizes
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, index


def float64_reference(model):
    """``model`` in float64, eval mode, norms and routers computing in float64."""
    model = model.double().eval()
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_f64, module)
        elif name.endswith("TopKRouter"):
            module.forward = types.MethodType(_router_f64, module)
    return model


def make_model(family, seed=0, dtype=torch.float64, rope=None, **overrides):
    """A tiny random ``family`` model; ``rope``: a key of ``ROPE_SCALINGS`` (its context: 4x the original 64)."""
    cls_config, cls_model, extra = FAMILIES[family]
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **extra)
    if rope is not None:
        kw.update(rope_parameters=dict(ROPE_SCALINGS[rope]), max_position_embeddings=256)
    kw.update(overrides)
    config = cls_config(**kw)
    config._experts_implementation = "eager"  # the grouped-GEMM path has no float64 kernel
    torch.manual_seed(seed)
    model = cls_model(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # random everything (HF starts norms at 1 and Qwen's router at 0: ties)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return model.to(dtype).eval()


def save(model, directory):
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def tokens(batch=2, seed=3):
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def reference_logits(model, toks):
    with torch.no_grad():
        return float64_reference(model)(toks).logits


def max_relative_error(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())
