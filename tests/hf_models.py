"""Tiny random Hugging Face models of each family, and their float64 reference logits.

transformers computes RMSNorm and the MoE router's softmax (DeepSeek-V3: its whole
router) in float32 whatever the model's dtype; the reference runs those same formulas
in float64 instead (patched per module below), so that a float64 comparison can reach 1e-10.
RoPE tables stay transformers' own (float32, as ours are).  ``ROPE_SCALINGS``: a
``rope_parameters`` of each scaled type, sized so that the tiny models' frequencies
fall on both sides of (and inside) each type's bands.
"""
import json
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
    # Windows of 4 tokens in sequences of SEQ = 12, layer 0 sliding and layer 1 global, head_dim 16 != 32 / 4, a
    # softmax scale of its own, soft-caps that bend (scores and logits reach a few units); Gemma 3: the global
    # layers' RoPE scaled (linear, as Gemma 3 4B) on a base of their own, the local layers' plain on another.
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM,
               {"head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 3.0, "attn_implementation": "eager"}),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
               {"head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 24, "final_logit_softcapping": 3.0,
                "layer_types": ["sliding_attention", "full_attention"], "attn_implementation": "eager",
                "tie_word_embeddings": True,  # Gemma's own default: the capped logits of the tied output layer
                "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}}}),
}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
GEMMA = ("gemma2", "gemma3")
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


def _gemma_rms_f64(self, x):
    """Gemma's RMSNorm, ``(1 + w)`` applied (transformers: in float32) in float64."""
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)) * (1 + self.weight)


def _gemma_attention_f64(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                         **kwargs):
    """transformers' Gemma eager attention (soft-cap, then the mask) with its float32 softmax in float64 for float64
    inputs; other dtypes as transformers computes them, so the module-wide patch changes nothing else."""
    groups = module.num_key_value_groups
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    wide = torch.float64 if query.dtype == torch.float64 else torch.float32
    weights = torch.softmax(scores, dim=-1, dtype=wide).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _router_f64(self, x):
    x = x.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(x, self.weight)
    top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalizes
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, index


def _deepseek_v3_router_f64(self, x):
    """transformers' ``DeepseekV3TopkRouter.forward`` with float64 in place of its float32."""
    x = x.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(x, self.weight)
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias
    per_group = self.num_experts // self.num_group
    groups = choice.view(-1, self.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    kept = torch.zeros_like(groups).scatter_(1, torch.topk(groups, k=self.topk_group, dim=-1)[1], 1)
    mask = kept.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
    index = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), k=self.top_k, dim=-1)[1]
    weights = scores.gather(1, index)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, index


def float64_reference(model):
    """``model`` in float64, eval mode, norms and routers computing in float64."""
    model = model.double().eval()
    if type(model).__name__ in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        import importlib
        modeling = importlib.import_module(type(model).__module__)
        modeling.eager_attention_forward = _gemma_attention_f64  # looked up there at every call
    for module in model.modules():
        name = type(module).__name__
        if hasattr(module, "scalar_embed_scale"):  # sqrt(hidden) in the float64 model's dtype, as ours
            module.embed_scale.fill_(module.scalar_embed_scale)
        if name.endswith("RMSNorm"):
            gemma = not hasattr(module, "variance_epsilon")
            module.forward = types.MethodType(_gemma_rms_f64 if gemma else _rms_f64, module)
        elif name.endswith("TopKRouter") and name != "GptOssTopKRouter":  # gpt-oss's computes in the model's dtype
            module.forward = types.MethodType(_router_f64, module)
        elif name in ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter"):  # the same router
            module.forward = types.MethodType(_deepseek_v3_router_f64, module)
    return model


# A tiny DeepSeek-V3 with every part in play: query compression, YaRN with mscale / mscale_all_dim (factor 4 over an
# original 64 positions), 4 experts in 2 groups of which 1 is kept (top-2 inside it), a shared expert, scaled
# weights, layer 0 dense (intermediate_size) and layer 1 MoE (moe_intermediate_size).
DEEPSEEK_V3 = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=8, kv_lora_rank=12,
                   qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, n_routed_experts=4, n_shared_experts=1,
                   num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                   first_k_dense_replace=1, num_nextn_predict_layers=0, max_position_embeddings=256,
                   tie_word_embeddings=False, rope_interleave=True,
                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                    "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 10000.0})


def _random_model(cls, config, seed, dtype):
    """``cls(config)`` with every parameter drawn anew (transformers starts norms at 1 or 0 and routers at 0:
    ties): norms near 1, gpt-oss's sinks of the scores' size (a visible share of each row's softmax), the rest
    small; the routers' ``e_score_correction_bias`` too (fp32 values, as transformers keeps the buffer; of the size
    of the sigmoid scores' spread), so that it steers the choice of experts.  Experts run eagerly: the grouped-GEMM
    path has no float64 kernel."""
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else noise if name.endswith("sinks") else 0.05 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
    return model.to(dtype).eval()


def make_deepseek_v3(seed=0, dtype=torch.float64, **overrides):
    """A tiny random ``DeepseekV3ForCausalLM`` (``DEEPSEEK_V3`` with ``overrides``, ``_random_model``)."""
    return _random_model(T.DeepseekV3ForCausalLM, T.DeepseekV3Config(**{**DEEPSEEK_V3, **overrides}), seed, dtype)


# A tiny GLM-4.5 (transformers' defaults where not set: partial_rotary_factor 0.5, one MTP layer declared and, as
# transformers saves it, absent): head_dim 16 (not hidden / heads) of which 8 channels rotate, q/k/v biases, q/k norms,
# 2 query groups, 4 experts in 2 groups of which 1 is kept (top-2 inside it), a shared expert, scaled weights, layer 0
# dense (intermediate_size) and layer 1 MoE.
GLM4_MOE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4, n_shared_experts=1,
                num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                attention_bias=True, use_qk_norm=True, max_position_embeddings=64, tie_word_embeddings=False)


def make_glm4_moe(seed=0, dtype=torch.float64, **overrides):
    """A tiny random ``Glm4MoeForCausalLM`` (``GLM4_MOE`` with ``overrides``, ``_random_model``)."""
    return _random_model(T.Glm4MoeForCausalLM, T.Glm4MoeConfig(**{**GLM4_MOE, **overrides}), seed, dtype)


# A tiny gpt-oss: head_dim 16 (not hidden / heads), 2 query groups, windows of 4 tokens in sequences of SEQ = 12
# (layer 0 sliding, layer 1 full), gpt-oss's default yarn RoPE (truncate false), 4 experts (top 2), swiglu_limit 0.3,
# below the gate and up values' spread so that the clamp bites; every weight and bias random, the sinks of the size
# of the scores so that they take a visible share of each row's softmax.
GPT_OSS = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
               swiglu_limit=0.3, tie_word_embeddings=False, attn_implementation="eager")


def make_gpt_oss(seed=0, dtype=torch.float64, **overrides):
    """A tiny random ``GptOssForCausalLM`` (``GPT_OSS`` with ``overrides``, ``_random_model``: sinks and biases
    included)."""
    return _random_model(T.GptOssForCausalLM, T.GptOssConfig(**{**GPT_OSS, **overrides}), seed, dtype)


def make_model(family, seed=0, dtype=torch.float64, rope=None, **overrides):
    """A tiny random ``family`` model; ``rope``: a key of ``ROPE_SCALINGS`` (its context: 4x the original 64)."""
    cls_config, cls_model, extra = FAMILIES[family]
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    kw.update(extra)
    if rope is not None:
        kw.update(rope_parameters=dict(ROPE_SCALINGS[rope]), max_position_embeddings=256)
    kw.update(overrides)
    return _random_model(cls_model, cls_config(**kw), seed, dtype)


def save(model, directory):
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def directory_tensors(directory):
    """Every tensor of a Hugging Face directory's safetensors files, by name."""
    from safetensors.torch import load_file
    return {k: v for f in sorted(os.listdir(directory)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(directory, f)).items()}


def config_json(directory):
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


def assert_round_trip(hf_dir, ours, back):
    """``ours`` (a converted directory) exported to ``back`` equals ``hf_dir`` bit for bit, config.json too."""
    from ds_megatron.convert.checkpoint import ours_to_hf
    ours_to_hf(ours, back)
    before, after = directory_tensors(hf_dir), directory_tensors(back)
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert config_json(back) == config_json(hf_dir)


def hf_config_json(config_class, base, architecture, **overrides):
    """A family's config.json as transformers writes it: ``config_class(**base, **overrides)``, with its
    architecture."""
    cfg = json.loads(config_class(**{**base, **overrides}).to_json_string())
    cfg["architectures"] = [architecture]
    return cfg


def saved_family(make, tmp):
    """(the transformers model ``make()``, its directory as transformers saved it under ``tmp``, tokens, float64
    logits, ``tmp``): what each family's module fixture holds."""
    model = make()
    hf_dir = save(model, str(tmp / "hf"))
    toks = tokens()
    return model, hf_dir, toks, reference_logits(model, toks), tmp


def mtp_checkpoint(tmp, whole, make, config_class, model_class, base, architecture):
    """A directory holding ``whole``'s first two layers as the decoder and its third as one multi-token-prediction
    layer (random ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``; embedding and head copied), as
    DeepSeek-V3 and GLM-4.5 save it; and the float64 reference of its loss, LM + 0.1 x MTP, computed with
    transformers' own blocks: (directory, inputs, labels, loss).  ``make(**overrides)``: the family's maker."""
    from safetensors.torch import save_file
    h, eps = whole.config.hidden_size, whole.config.rms_norm_eps
    g = torch.Generator().manual_seed(11)
    sd = directory_tensors(save(whole, str(tmp / "whole")))  # the checkpoint's names (experts one by one)
    extra = {"enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
             "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
             "eh_proj.weight": 0.05 * torch.randn(h, 2 * h, generator=g),
             "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    sd.update({f"model.layers.2.{k}": v.double() for k, v in extra.items()})
    sd["model.layers.2.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd["model.layers.2.shared_head.head.weight"] = sd["lm_head.weight"].clone()
    hf_dir = tmp / "hf"
    hf_dir.mkdir()
    save_file(sd, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads(whole.config.to_json_string())
    cfg.update(num_hidden_layers=2, num_nextn_predict_layers=1, architectures=[architecture])
    (hf_dir / "config.json").write_text(json.dumps(cfg))

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    toks = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(5))
    inputs, labels = toks[:, :-1], toks[:, 1:]
    main = make(num_hidden_layers=2)
    main.load_state_dict({k: v for k, v in whole.state_dict().items() if not k.startswith("model.layers.2.")})
    block_config = config_class(**{**base, "num_hidden_layers": 1, "first_k_dense_replace": 0})
    block_config._experts_implementation = "eager"
    block = model_class(block_config).double()
    block.layers[0].load_state_dict(whole.model.layers[2].state_dict())
    block.norm.weight.data.copy_(extra["shared_head.norm.weight"])
    main, block = float64_reference(main), float64_reference(block)
    with torch.no_grad():
        hidden = main.model(inputs).last_hidden_state  # after the final norm
        lm = torch.nn.functional.cross_entropy(main.lm_head(hidden).flatten(0, 1), labels.flatten())
        ahead = torch.cat((inputs[:, 1:], torch.zeros_like(inputs[:, :1])), dim=1)
        x = torch.cat((rms(main.model.embed_tokens(ahead), extra["enorm.weight"].double()),
                       rms(hidden, extra["hnorm.weight"].double())), dim=-1) @ extra["eh_proj.weight"].double().t()
        mtp_logits = main.lm_head(block(inputs_embeds=x).last_hidden_state)[:, :-1]  # the last position: no label
        mtp = torch.nn.functional.cross_entropy(mtp_logits.flatten(0, 1), labels[:, 1:].flatten())
    return str(hf_dir), inputs, labels, lm + 0.1 * mtp


def tokens(batch=2, seed=3):
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def reference_logits(model, toks):
    with torch.no_grad():
        return float64_reference(model)(toks).logits


def gather_logits(logits, state, vocab=VOCAB):
    """A rank's logits ``[b, s, vocab]`` (its CP zigzag chunks, its TP share of the padded vocabulary) -> the whole
    sequence and the real ``vocab``."""
    import torch.distributed as dist
    from ds_megatron.transformer.context_parallel import zigzag_unsplit
    if state.cp.size > 1:  # this rank's zigzag chunks -> the whole sequence
        parts = [torch.empty_like(logits) for _ in range(state.cp.size)]
        dist.all_gather(parts, logits.contiguous(), group=state.cp.group)
        logits = zigzag_unsplit(parts, seq_dim=1)
    if state.tp.size > 1:
        parts = [torch.empty_like(logits) for _ in range(state.tp.size)]
        dist.all_gather(parts, logits.contiguous(), group=state.tp.group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab]


def layout_logits(config, state, path, stages, toks):
    """The float64 logits of our model built at ``state``'s layout and loaded from ``path`` (a converted or a
    Hugging Face directory): on the last stage's ranks, None on the others (PP 2: the first stage sends its
    hidden states)."""
    import torch.distributed as dist
    from ds_megatron.convert.model_io import load_weights
    from ds_megatron.models import GPTModel
    if state.pp.size == 1:
        model = GPTModel(config, state).double().eval()
        load_weights(model, path, state, stages)
        with torch.no_grad():
            return gather_logits(model(toks), state, config.vocab_size)
    from ds_megatron.integration.pipeline import GPTPipelineModule
    model = GPTPipelineModule(config, state).double().eval()
    try:
        load_weights(model, path, state, stages)
        pipe = state.pp
        with torch.no_grad():
            if model.is_first_stage:
                dist.send(model(toks).contiguous(), pipe.ranks[pipe.rank + 1])
                return None
            seq = toks.size(1) // (state.tp.size if config.sequence_parallel else 1)
            hidden = torch.empty(seq, toks.size(0), config.hidden_size, dtype=torch.float64)
            dist.recv(hidden, pipe.ranks[pipe.rank - 1])
            return gather_logits(model(hidden).transpose(0, 1), state, config.vocab_size)
    finally:
        model.destroy_process_groups()


def max_relative_error(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())
