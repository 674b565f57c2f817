"""Hugging Face ``config.json`` <-> our ``model`` section (pure Python, no torch).

``model_from_hf(hf)`` returns ``(family, GPTConfig keyword arguments)`` for the
families we reproduce exactly (``FAMILIES``; DeepSeek-V3 by ``_deepseek_v3``, GLM-4.5 by ``_glm4_moe``, Gemma by
``_gemma``, gpt-oss by ``_gpt_oss``, each opened by ``_reader`` with transformers' defaults), RoPE scaling
of types default, linear, llama3 and yarn included; anything that would change the model's
arithmetic in a way we do not implement (other RoPE scalings, sliding windows
shorter than the sequence, an unknown field)
raises ``ConvertError`` naming ``config.json`` and the field.  ``hf_from_model``
is the way back: the original ``config.json`` with the architecture fields
written from the model section.  ``model_of_checkpoint`` reads a directory, multi-token-prediction layers
that ``config.json`` declares but the files lack (as transformers saves them) left off (``resolve_mtp``).
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..errors import ConvertError
from .model import GPTConfig

# The file that marks a directory ``ds-megatron convert`` wrote: family, model section, layout, the original
# config.json (``convert.checkpoint.write_metadata``).
METADATA = "ds_megatron_checkpoint.json"

# architecture (config.json "architectures"[0]) -> family
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",  # Kimi K2 too (model_type kimi_k2, the same architecture)
    "Glm4MoeForCausalLM": "glm4_moe",  # GLM-4.5, GLM-4.5-Air, GLM-4.6
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",  # the text model (model_type gemma3_text)
    "GptOssForCausalLM": "gpt_oss",
}
ARCHITECTURES = {family: arch for arch, family in FAMILIES.items()}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")
# Families whose checkpoints may hold multi-token-prediction layers (model.layers.{num_hidden_layers + k})
MTP_FAMILIES = ("deepseek_v3", "glm4_moe")

# Fields that never change the forward pass (ids, caching, bookkeeping, training-only switches).
_NEUTRAL = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "output_router_logits",
    "router_aux_loss_coef", "pretraining_tp", "max_window_layers", "attention_dropout", "tie_word_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "sliding_window", "use_sliding_window",
    "layer_types", "head_dim", "rms_norm_eps", "hidden_act", "num_key_value_heads", "max_position_embeddings",
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "attention_bias", "mlp_bias", "qkv_bias", "num_experts", "num_local_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "router_jitter_noise", "output_attentions", "output_hidden_states", "return_dict",
    "is_encoder_decoder", "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "tokenizer_class",
    "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params", "finetuning_task",
    "attn_implementation", "_attn_implementation_autoset", "quantization_config_disabled", "cross_attention_hidden_size",
    "add_cross_attention", "tf_legacy_loss", "use_bfloat16", "torchscript", "pruned_heads", "is_decoder",
}


def _fail(field: str, value: Any, fix: str) -> ConvertError:
    return ConvertError(f"config.json: {field}={value!r} is not supported; {fix}")


# The rope_parameters keys each rope_type reads (transformers' modeling_rope_utils), besides rope_type / type,
# rope_theta and partial_rotary_factor.
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
}


def _rope(hf: Dict[str, Any]) -> Dict[str, Any]:
    """The RoPE fields of our model section from ``rope_parameters`` (or the older ``rope_scaling``, with ``type``
    or ``rope_type``), reading each key as transformers does; a type or key we do not reproduce is refused."""
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(hf.get(name) or {})
    other = "rope_parameters" if name == "rope_scaling" else "rope_scaling"
    if hf.get(other) and hf[other] != params:
        # transformers lets rope_scaling win; two different dicts are more likely a mistake than intended
        raise _fail(other, hf[other], f"it differs from {name}; keep one of the two")
    if "type" in params and "rope_type" in params and params["type"] != params["rope_type"]:
        raise _fail(f"{name}.type", params["type"], f"it differs from {name}.rope_type; keep one of the two")
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in _ROPE_KEYS:
        raise _fail(f"{name}.rope_type", kind, "ds_megatron reproduces exactly the RoPE types "
                    f"{', '.join(_ROPE_KEYS)}: convert a model with one of them")
    for key in params:
        if key not in _ROPE_KEYS[kind] + ("rope_type", "type", "rope_theta", "partial_rotary_factor"):
            raise _fail(f"{name}.{key}", params[key], f"rope_type {kind!r} does not read it here: remove it if "
                        "it does not change the model")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    out: Dict[str, Any] = dict(
        rotary_base=float(theta),
        rotary_percent=float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))))
    if kind == "default":
        return out

    def need(key):
        if params.get(key) is None:
            raise _fail(f"{name}.{key}", params.get(key), f"rope_type {kind!r} needs it; set it")
        return params[key]

    def original() -> int:
        # transformers falls back to max_position_embeddings when the key is absent
        value = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(f"{name}.original_max_position_embeddings", value, "give the pretraining context length "
                        "as an integer")
        return value

    out["rope_scaling_type"] = kind
    if kind == "linear":
        out["rope_scaling_factor"] = float(need("factor"))
    elif kind == "llama3":
        out.update(rope_scaling_factor=float(need("factor")), rope_low_freq_factor=float(need("low_freq_factor")),
                   rope_high_freq_factor=float(need("high_freq_factor")), original_max_position_embeddings=original())
    else:  # yarn
        orig = original()
        factor = params.get("factor")
        if factor is None:  # transformers: the context extension itself
            if not hf.get("max_position_embeddings"):
                raise _fail(f"{name}.factor", None, "set the YaRN factor")
            factor = hf["max_position_embeddings"] / orig
        out.update(rope_scaling_factor=float(factor), original_max_position_embeddings=orig,
                   # transformers reads `beta or default`: a 0 is the default too
                   yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                   yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                   yarn_correction_range_round_to_int=bool(params.get("truncate", True)))
        if params.get("attention_factor") is not None:
            out["yarn_attention_factor"] = float(params["attention_factor"])
        elif params.get("mscale") and params.get("mscale_all_dim"):
            out.update(yarn_mscale=float(params["mscale"]), yarn_mscale_all_dim=float(params["mscale_all_dim"]))
        # else transformers uses 0.1 ln(factor) + 1 (mscale alone is ignored): our defaults 1 and 0
    return out


def _rope_parameters(model: Dict[str, Any]) -> Dict[str, Any]:
    """The ``rope_parameters`` of ``config.json`` for our model section (the way back of ``_rope``)."""
    g = GPTConfig(**model)
    out: Dict[str, Any] = {"rope_type": g.rope_scaling_type or "default", "rope_theta": float(g.rotary_base)}
    kind = g.rope_scaling_type
    if kind is not None:
        out["factor"] = g.rope_scaling_factor
    if kind in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = g.original_max_position_embeddings
    if kind == "llama3":
        out.update(low_freq_factor=g.rope_low_freq_factor, high_freq_factor=g.rope_high_freq_factor)
    if kind == "yarn":
        out.update(beta_fast=g.yarn_beta_fast, beta_slow=g.yarn_beta_slow)
        if not g.yarn_correction_range_round_to_int:
            out["truncate"] = False
        if g.yarn_attention_factor is not None:
            out["attention_factor"] = g.yarn_attention_factor
        elif (g.yarn_mscale, g.yarn_mscale_all_dim) != (1.0, 0.0):
            # transformers reads them only both non-zero; other pairs come back different and are refused
            out.update(mscale=g.yarn_mscale, mscale_all_dim=g.yarn_mscale_all_dim)
    return out


def model_from_hf(hf: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """(family, GPTConfig kwargs) of a Hugging Face config; ConvertError for what we cannot reproduce."""
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in FAMILIES:
        raise _fail("architectures", archs, f"supported: {', '.join(FAMILIES)}")
    family = FAMILIES[archs[0]]
    if family == "deepseek_v3":
        return family, _deepseek_v3(hf)
    if family == "glm4_moe":
        return family, _glm4_moe(hf)
    if family in GEMMA_FAMILIES:
        return family, _gemma(family, hf)
    if family == "gpt_oss":
        return family, _gpt_oss(hf)
    for key in hf:
        if key not in _NEUTRAL:
            raise _fail(key, hf[key], "ds_megatron does not know what this field changes: remove it if it does not "
                        "change the model, or convert a supported model")
    if hf.get("hidden_act") not in ("silu", "gelu"):
        raise _fail("hidden_act", hf.get("hidden_act"), "use silu (SwiGLU) or gelu")
    if hf.get("router_jitter_noise", 0.0):
        raise _fail("router_jitter_noise", hf["router_jitter_noise"], "set it to 0 (training noise not implemented)")
    if any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise _fail("layer_types", hf["layer_types"], "only full attention in every layer is supported")
    rope = _rope(hf)
    h, n = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or h // n
    seq_length = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3") or family in MOE_FAMILIES and "use_sliding_window" in hf:
        window = window if hf.get("use_sliding_window") else None
    if window:
        # Full causal attention equals sliding-window attention on sequences no longer than the window.
        seq_length = min(seq_length, window)
    if family == "llama":
        if bool(hf.get("attention_bias")) != bool(hf.get("mlp_bias")):
            raise _fail("attention_bias", hf.get("attention_bias"), "attention_bias and mlp_bias must be equal "
                        "(add_bias_linear covers both)")
        bias_linear, qkv_bias = bool(hf.get("attention_bias")), False
    elif family == "qwen2":
        bias_linear, qkv_bias = False, True
    elif family == "qwen2_moe":
        bias_linear, qkv_bias = False, bool(hf.get("qkv_bias", True))
    elif family in ("qwen3", "qwen3_moe"):
        if hf.get("attention_bias"):
            # Qwen3 biases q, k, v and o_proj but not the MLP: add_bias_linear would bias the MLP too
            raise _fail("attention_bias", hf["attention_bias"], f"{family} with attention_bias biases o_proj without "
                        "the MLP, which ds_megatron does not express: convert a model with attention_bias false")
        bias_linear, qkv_bias = False, False
    else:
        bias_linear, qkv_bias = False, False
    model: Dict[str, Any] = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=h, num_attention_heads=n,
        num_query_groups=hf.get("num_key_value_heads") or n,
        kv_channels=head_dim if head_dim * n != h else None, ffn_hidden_size=hf["intermediate_size"],
        seq_length=seq_length, vocab_size=hf["vocab_size"], hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)), init_method_std=hf.get("initializer_range", 0.02),
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), position_embedding_type="rope", **rope,
        normalization="RMSNorm", gated_linear_unit=True,
        activation=hf["hidden_act"], add_bias_linear=bias_linear, add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        qk_layernorm=family in ("qwen3", "qwen3_moe"))
    if family in MOE_FAMILIES:
        experts = hf.get("num_local_experts") or hf.get("num_experts")
        pattern = _moe_layer_pattern(family, hf)
        if not all(pattern):  # dense layers (MLP of intermediate_size) between the MoE layers: Megatron's list form
            model["moe_layer_freq"] = pattern
        model.update(num_experts=experts, moe_router_topk=hf["num_experts_per_tok"],
                     moe_ffn_hidden_size=hf["intermediate_size"] if family == "mixtral" else hf["moe_intermediate_size"],
                     # Mixtral renormalizes the top-k softmax (= softmax over the k chosen logits); Qwen does when
                     # norm_topk_prob, else it keeps the softmax over all experts (Megatron's pre-softmax).
                     moe_router_pre_softmax=family != "mixtral" and not hf.get("norm_topk_prob", False),
                     moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
        if family == "qwen2_moe" and hf.get("shared_expert_intermediate_size"):
            model.update(moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                         moe_shared_expert_gate=True)
    return family, model


def _moe_layer_pattern(family: str, hf: Dict[str, Any]) -> list:
    """One 0 (dense MLP) or 1 (MoE) per layer, as transformers builds the layers: in Qwen2-MoE / Qwen3-MoE layer i
    is sparse when ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``; Mixtral's are all sparse."""
    step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if family == "mixtral":
        if step != 1 or only:  # transformers' Mixtral reads neither: more likely a mistake than intended
            raise _fail("decoder_sparse_step" if step != 1 else "mlp_only_layers", step if step != 1 else only,
                        "Mixtral's layers are all MoE and transformers ignores it: remove it")
        return [1] * hf["num_hidden_layers"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise _fail("decoder_sparse_step", step, "use a positive integer (every step-th layer is MoE)")
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise _fail("mlp_only_layers", only, "use a list of layer indices")
    pattern = [int(i not in only and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]
    if not any(pattern):
        raise _fail("decoder_sparse_step", step, f"with mlp_only_layers={only!r} no layer is MoE; convert it as a "
                    "dense model or mark MoE layers")
    return pattern


# The families read field by field (DeepSeek-V3, GLM-4.5, Gemma, gpt-oss): what they share ----------------------------
# Fields that never change the forward pass, in any family.
_BOOKKEEPING = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "output_router_logits", "pretraining_tp",
    "output_attentions", "output_hidden_states", "return_dict", "is_encoder_decoder", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "finetuning_task", "attn_implementation", "_attn_implementation_autoset",
    "cross_attention_hidden_size", "add_cross_attention", "tf_legacy_loss", "use_bfloat16", "torchscript",
    "pruned_heads", "is_decoder",
    "auto_map", "ep_size",  # the original remote code's class names and its inference expert-parallel size
}


def _int(field: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _fail(field, value, f"use an integer >= {low}")
    return value


def _reader(family: str, hf: Dict[str, Any], defaults: Dict[str, Any], fields: Set[str],
            dequantized: Optional[str] = None) -> Callable[[str], Any]:
    """How a family read field by field opens its ``config.json``: a field outside ``_BOOKKEEPING``, ``defaults``
    (transformers' config class's) and ``fields`` (read without a default) is refused, and so are quantized weights
    unless their ``quant_method`` is ``dequantized`` (the one the family dequantizes on load).  Returns ``get``: a
    field's value, else transformers' default."""
    for key in hf:
        if key not in _BOOKKEEPING and key not in defaults and key not in fields and key != "quantization_config":
            raise _fail(key, hf[key], f"ds_megatron does not know what this field changes in {family}: remove it if "
                        "it does not change the model")
    quant = hf.get("quantization_config")
    if quant and dequantized is None:
        raise _fail("quantization_config", quant, "quantized weights are not converted: dequantize the checkpoint "
                    "to bf16 or fp32 first")
    if quant and (not isinstance(quant, dict) or quant.get("quant_method") != dequantized):
        raise _fail("quantization_config", quant, f"only {family}'s {dequantized.upper()} experts are dequantized on "
                    f"load: convert a checkpoint in bf16 / fp32 or with quant_method {dequantized}")

    def get(key):
        return hf[key] if key in hf else defaults[key]
    return get


def _gqa_decoder(get: Callable[[str], Any], hf: Dict[str, Any], head_dim: Optional[int]) -> Dict[str, Any]:
    """The model section's fields GLM-4.5, Gemma and gpt-oss read alike: the sizes, grouped-query heads of
    ``head_dim`` channels (None: hidden / heads), RoPE (its keys are each family's), RMSNorm, a gated MLP."""
    layers, h, n = (_int(k, get(k), 1) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads"))
    return dict(
        num_layers=layers, hidden_size=h, num_attention_heads=n,
        num_query_groups=_int("num_key_value_heads", get("num_key_value_heads"), 1),
        kv_channels=head_dim if head_dim and head_dim * n != h else None,
        ffn_hidden_size=_int("intermediate_size", get("intermediate_size"), 1),
        seq_length=get("max_position_embeddings"), vocab_size=get("vocab_size"), hidden_dropout=0.0,
        attention_dropout=float(get("attention_dropout") or 0.0), init_method_std=hf.get("initializer_range", 0.02),
        norm_epsilon=float(get("rms_norm_eps")), position_embedding_type="rope", normalization="RMSNorm",
        gated_linear_unit=True)


def _layer_types(hf: Dict[str, Any], layers: int, every: int) -> List[str]:
    """``layer_types`` (transformers' default when absent: every ``every``-th layer full, the others sliding)."""
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if (not isinstance(types, list) or len(types) != layers
            or any(t not in ("sliding_attention", "full_attention") for t in types)):
        raise _fail("layer_types", types, f"give {layers} (num_hidden_layers) of sliding_attention / full_attention")
    return types


def _windows(types: List[str], get: Callable[[str], Any]) -> Dict[str, Any]:
    """The window keys of layers of ``types``: ``window_size`` from ``sliding_window`` and, when full layers are
    mixed in, which layers it applies to."""
    if "sliding_attention" not in types:
        return {}
    window = _int("sliding_window", get("sliding_window"), 1)
    keys: Dict[str, Any] = {"window_size": [window - 1, 0]}  # transformers: query i sees key j iff i - j < window
    if "full_attention" in types:
        keys["window_attn_skip_freq"] = [int(t == "sliding_attention") for t in types]
    return keys


# DeepSeek-V3 (transformers' DeepseekV3ForCausalLM; Kimi K2 is the same architecture) ---------------------------
# transformers' DeepseekV3Config defaults: a field config.json leaves out is read as transformers reads it.
_DEEPSEEK_V3_DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": None, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True,
    "attention_bias": False, "attention_dropout": 0.0,
    # the original remote code's (DeepSeek-V3, Kimi K2 config.json): transformers reads none of them
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "seq_aux": True, "aux_loss_alpha": 0.0,
}
# and the fields it reads without a default
_DEEPSEEK_V3_FIELDS = {"rope_theta", "rope_scaling", "rope_parameters", "head_dim", "qk_head_dim",
                       "num_nextn_predict_layers", "num_mtp_layers"}


def _deepseek_v3(hf: Dict[str, Any]) -> Dict[str, Any]:
    """Our model section of a DeepSeek-V3 ``config.json`` (multi-latent attention, sigmoid group-limited routing with
    the expert bias, a shared expert, dense first layers), read as transformers' ``DeepseekV3ForCausalLM`` does."""
    get = _reader("deepseek_v3", hf, _DEEPSEEK_V3_DEFAULTS, _DEEPSEEK_V3_FIELDS)
    for key, only, fix in (
            ("scoring_func", "sigmoid", "DeepSeek-V3 scores experts with a sigmoid: convert a model with 'sigmoid'"),
            ("topk_method", "noaux_tc", "ds_megatron routes DeepSeek-V3's way (expert bias, group-limited): "
                                        "convert a model with 'noaux_tc'"),
            ("moe_layer_freq", 1, "transformers makes every layer from first_k_dense_replace on MoE: set it to 1"),
            ("rope_interleave", True, "ds_megatron's multi-latent attention rotates DeepSeek's interleaved channel "
                                      "pairs: convert a model with rope_interleave true"),
            ("attention_bias", False, "it biases the attention projections without the MLP, which ds_megatron does "
                                      "not express: convert a model with attention_bias false"),
            ("rms_norm_eps", 1e-6, "transformers fixes the latent norms' eps at 1e-6 and ds_megatron uses one "
                                   "norm_epsilon for every norm: convert a model with rms_norm_eps 1e-6")):
        if get(key) != only or isinstance(get(key), bool) != isinstance(only, bool):
            raise _fail(key, get(key), fix)
    depth = _mtp_depth(hf)
    if get("hidden_act") not in ("silu", "gelu"):
        raise _fail("hidden_act", get("hidden_act"), "use silu (SwiGLU) or gelu")
    layers, h, n = (_int(k, get(k), 1) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads"))
    if get("num_key_value_heads") not in (None, n):  # MLA's k and v have every head; transformers would repeat them
        raise _fail("num_key_value_heads", get("num_key_value_heads"), f"set it to num_attention_heads ({n})")
    nope, pos, v = (_int(k, get(k), 1) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    for key, derived in (("qk_head_dim", nope + pos), ("head_dim", pos)):  # transformers derives them
        if hf.get(key) not in (None, derived):
            raise _fail(key, hf[key], f"transformers derives it as {derived} from qk_nope_head_dim and "
                        "qk_rope_head_dim: set that or remove it")
    q_lora = get("q_lora_rank")
    if q_lora is not None:
        _int("q_lora_rank", q_lora, 1)
    moe = _sigmoid_topk_moe(get, layers)
    rope = _rope(hf)
    if rope["rotary_percent"] != 1.0:
        raise _fail("partial_rotary_factor", rope["rotary_percent"], "DeepSeek-V3 rotates all qk_rope_head_dim "
                    "channels: remove it")
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if rope.get("rope_scaling_type") == "yarn" and params.get("mscale_all_dim"):
        # transformers multiplies MLA's softmax scale by m(factor, mscale_all_dim)^2 whatever mscale is, and scales
        # cos and sin by attention_factor, else m(factor, mscale) / m(factor, mscale_all_dim) when mscale is set,
        # else m(factor, 1) (m(s, k) = 0.1 k ln(s) + 1)
        if params.get("factor") is None:
            raise _fail("rope_parameters.factor", None, "transformers' DeepSeek-V3 reads it with mscale_all_dim: "
                        "set it")
        rope["yarn_mscale_all_dim"] = float(params["mscale_all_dim"])
        if "yarn_attention_factor" not in rope and not params.get("mscale"):
            factor = rope["rope_scaling_factor"]
            rope["yarn_attention_factor"] = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    model: Dict[str, Any] = dict(
        num_layers=layers, hidden_size=h, num_attention_heads=n, ffn_hidden_size=_int(
            "intermediate_size", get("intermediate_size"), 1), seq_length=get("max_position_embeddings"),
        vocab_size=get("vocab_size"), hidden_dropout=0.0, attention_dropout=float(get("attention_dropout") or 0.0),
        init_method_std=hf.get("initializer_range", 0.02), norm_epsilon=float(get("rms_norm_eps")),
        position_embedding_type="rope", **rope, normalization="RMSNorm", gated_linear_unit=True,
        activation=get("hidden_act"), add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not get("tie_word_embeddings"),
        multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=_int("kv_lora_rank", get("kv_lora_rank"), 1),
        qk_head_dim=nope, qk_pos_emb_head_dim=pos, v_head_dim=v, **moe,
        # the original code's sequence-wise balancing loss (seq_aux) of weight aux_loss_alpha; transformers has none
        moe_router_load_balancing_type="seq_aux_loss" if get("seq_aux") else "aux_loss",
        moe_aux_loss_coeff=float(get("aux_loss_alpha") or 0.0))
    if depth:
        model["mtp_num_layers"] = depth
    return model


def _mtp_depth(hf: Dict[str, Any]) -> int:
    """The multi-token-prediction layers ``config.json`` declares: transformers' two names of one field (its default:
    1); the layers follow the decoder's as model.layers.{num_hidden_layers + k} (transformers neither builds nor
    runs them, nor saves them)."""
    mtp = ({k: hf[k] for k in ("num_nextn_predict_layers", "num_mtp_layers") if k in hf}
           or {"num_nextn_predict_layers": 1})
    depths = {_int(key, value, 0) for key, value in mtp.items()}
    if len(depths) > 1:
        raise _fail("num_mtp_layers", hf.get("num_mtp_layers"), "it differs from num_nextn_predict_layers: keep one")
    return depths.pop()


def _sigmoid_topk_moe(get, layers: int) -> Dict[str, Any]:
    """The MoE of DeepSeek-V3 and GLM-4.5 (transformers' ``TopkRouter``): sigmoid scores, the expert bias added for
    the choice only, groups of experts of which ``topk_group`` are kept, the chosen scores renormalized
    (``norm_topk_prob``) and scaled (``routed_scaling_factor``), shared experts, the first k layers dense."""
    experts, topk = _int("n_routed_experts", get("n_routed_experts"), 1), _int("num_experts_per_tok",
                                                                              get("num_experts_per_tok"), 1)
    groups, group_topk = _int("n_group", get("n_group"), 1), _int("topk_group", get("topk_group"), 1)
    if experts % groups or group_topk > groups:  # transformers views the experts as n_group equal groups
        raise _fail("n_group", groups, f"use a divisor of n_routed_experts ({experts}) of at least topk_group "
                    f"({group_topk})")
    if group_topk < groups and topk // group_topk != 2:
        # transformers scores a group by its best 2 experts, Megatron (and ds_megatron) by its best k / topk_group
        raise _fail("topk_group", group_topk, f"transformers scores a group by its 2 best experts and ds_megatron by "
                    f"its num_experts_per_tok // topk_group = {topk // group_topk}: use num_experts_per_tok = 2 x "
                    "topk_group (or topk_group = n_group)")
    if bool(get("norm_topk_prob")) != (topk > 1):
        # ds_megatron (as Megatron) renormalizes the chosen sigmoid scores exactly when more than one is chosen
        raise _fail("norm_topk_prob", get("norm_topk_prob"), "ds_megatron renormalizes the chosen sigmoid scores "
                    "when num_experts_per_tok > 1 and not for 1: convert a model with norm_topk_prob "
                    f"{str(topk > 1).lower()}")
    shared = _int("n_shared_experts", get("n_shared_experts"), 1)
    dense = _int("first_k_dense_replace", get("first_k_dense_replace"), 0)
    if dense >= layers:
        raise _fail("first_k_dense_replace", dense, f"every one of the {layers} layers is dense: convert it as a "
                    "dense model or lower it")
    moe_ffn = _int("moe_intermediate_size", get("moe_intermediate_size"), 1)
    model: Dict[str, Any] = dict(
        num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
        moe_shared_expert_intermediate_size=shared * moe_ffn, moe_shared_expert_gate=False,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(get("routed_scaling_factor")),
        # transformers keeps the gate and the bias in fp32 and routes in fp32 whatever the model's dtype
        moe_router_dtype="fp32")
    if group_topk < groups:  # all groups kept (or one group) is plain top-k
        model.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    if dense:
        model["moe_layer_freq"] = [0] * dense + [1] * (layers - dense)
    return model


# GLM-4.5 / 4.6 (transformers' Glm4MoeForCausalLM) ------------------------------------------------------------------
# transformers' Glm4MoeConfig defaults (partial_rotary_factor: 0.5 when config.json gives none)
_GLM4_MOE_DEFAULTS = {
    "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
    "num_attention_heads": 96, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "use_qk_norm": False,
}
_GLM4_MOE_FIELDS = {"rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "head_dim",
                    "num_nextn_predict_layers", "num_mtp_layers"}


def _glm4_moe(hf: Dict[str, Any]) -> Dict[str, Any]:
    """Our model section of a GLM-4.5 ``config.json``, read as transformers' ``Glm4MoeForCausalLM`` does: grouped-query
    attention with q/k/v biases (``attention_bias``, o_proj unbiased), optional per-head q/k RMSNorm before RoPE,
    RoPE on the first ``partial_rotary_factor`` of each head's channels (rotate-half pairs), DeepSeek-V3's routing."""
    get = _reader("glm4_moe", hf, _GLM4_MOE_DEFAULTS, _GLM4_MOE_FIELDS)
    if get("hidden_act") not in ("silu", "gelu"):
        raise _fail("hidden_act", get("hidden_act"), "use silu (SwiGLU) or gelu")
    depth = _mtp_depth(hf)
    # transformers' attention and RoPE both fall back to hidden / heads without head_dim
    model: Dict[str, Any] = _gqa_decoder(get, hf, hf.get("head_dim"))
    model.update(
        **_rope({**hf, "partial_rotary_factor": hf.get("partial_rotary_factor", 0.5)}), activation=get("hidden_act"),
        add_bias_linear=False, add_qkv_bias=bool(get("attention_bias")), qk_layernorm=bool(get("use_qk_norm")),
        untie_embeddings_and_output_weights=not get("tie_word_embeddings"),
        **_sigmoid_topk_moe(get, model["num_layers"]))
    if depth:
        model["mtp_num_layers"] = depth
    return model


def hf_tensor_names(path: str) -> Set[str]:
    """The tensor names of a Hugging Face directory: its index's ``weight_map``, else ``model.safetensors``'s header
    (no tensor read, no torch); empty when it has neither (the loader names what is missing)."""
    index, single = os.path.join(path, "model.safetensors.index.json"), os.path.join(path, "model.safetensors")
    try:
        if os.path.isfile(index):
            with open(index) as f:
                return set(json.load(f).get("weight_map", {}))
        if os.path.isfile(single):
            with open(single, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                return set(json.loads(f.read(size))) - {"__metadata__"}
    except (OSError, struct.error, ValueError) as e:
        raise ConvertError(f"{path}: cannot read the tensor names ({e})") from None
    return set()


def resolve_mtp(model: Dict[str, Any], names: Set[str], requested: Optional[int], where: str) -> Optional[str]:
    """Sets ``model["mtp_num_layers"]`` (``config.json``'s count) to what the checkpoint ``where`` with tensors
    ``names`` gives, and returns the line to print when it differs from what ``config.json`` declares.

    ``requested`` None: the declared layers when the files hold them; when they hold none (transformers declares one
    and never saves it) MTP is off, as transformers runs the model: fresh layers would add a loss term the user did
    not ask for.  0: off.  k > 0: the files must hold exactly those k layers."""
    declared = model.get("mtp_num_layers") or 0
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 0):
        raise ConvertError(f"mtp_num_layers={requested!r} is not an integer >= 0; use 0 (off) or leave it unset")
    present = bool(declared) and any(n.startswith(f"model.layers.{model['num_layers']}.") for n in names)
    if requested and not present:
        raise ConvertError(f"mtp_num_layers={requested}: {where} declares {declared} multi-token-prediction layer(s) "
                           "and its files hold none (transformers never saves them); use 0 or leave it unset (fresh "
                           "MTP layers are not built)")
    if requested and requested != declared:
        raise ConvertError(f"mtp_num_layers={requested}: {where} holds {declared} multi-token-prediction layer(s); "
                           f"use 0 (off), {declared} or leave it unset")
    if requested == 0 or not present:
        model.pop("mtp_num_layers", None)
    if requested is None and declared and not present:
        return (f"{where}: config.json declares {declared} multi-token-prediction layer(s) (num_nextn_predict_layers) "
                "but the files hold none, as transformers saves them: loading the main model with MTP off, as "
                "transformers runs it")
    return None


# Gemma 2 and Gemma 3 text (transformers' Gemma2ForCausalLM, Gemma3ForCausalLM) ------------------------------------
GEMMA_FAMILIES = ("gemma2", "gemma3")
# transformers' Gemma2Config / Gemma3TextConfig defaults: a field config.json leaves out is read as transformers does
_GEMMA_DEFAULTS = {
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
    "attention_dropout": 0.0, "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0, "use_bidirectional_attention": None,
}
_GEMMA3_DEFAULTS = dict(_GEMMA_DEFAULTS, vocab_size=262208, max_position_embeddings=131072,
                        final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False)
_GEMMA_FIELDS = {"rope_theta", "rope_scaling", "rope_parameters", "layer_types", "hidden_act",
                 "cache_implementation", "sliding_window_pattern", "_sliding_window_pattern", "rope_local_base_freq"}


def _gemma_rope(family: str, hf: Dict[str, Any]) -> Dict[str, Any]:
    """RoPE of the global layers (``rotary_*``, its scaling) and Gemma 3's local base (``local_rotary_base``): from
    ``rope_parameters`` per layer type (transformers 5), or the older ``rope_theta`` / ``rope_scaling`` /
    ``rope_local_base_freq``."""
    params = hf.get("rope_parameters") or {}
    per_type = isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params)
    if family == "gemma2":
        if per_type:
            raise _fail("rope_parameters", params, "Gemma 2 turns every layer alike: give one rope_parameters")
        return _rope(hf)
    theta = {"full_attention": hf.get("rope_theta", 1_000_000.0),
             "sliding_attention": hf.get("rope_local_base_freq", 10_000.0)}
    if per_type:
        for key in params:
            if key not in theta:
                raise _fail(f"rope_parameters.{key}", params[key], "Gemma 3 has full_attention and "
                            "sliding_attention layers: remove it")
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full, local = dict(hf.get("rope_scaling") or params or {}), {}
    full.setdefault("rope_theta", theta["full_attention"])
    local.setdefault("rope_theta", theta["sliding_attention"])
    if local.get("rope_type", local.get("type", "default")) != "default" or set(local) - {"rope_type", "type",
                                                                                           "rope_theta"}:
        raise _fail("rope_parameters.sliding_attention", local, "ds_megatron turns the windowed layers by plain "
                    "RoPE of their own base: remove the scaling")
    rope = _rope({"rope_parameters": full, "max_position_embeddings": hf.get("max_position_embeddings")})
    if rope["rotary_percent"] != 1.0:  # the sliding layers would turn only as many channels
        raise _fail("rope_parameters.full_attention.partial_rotary_factor", rope["rotary_percent"], "Gemma 3 turns "
                    "every channel: remove it")
    rope["local_rotary_base"] = float(local["rope_theta"])
    return rope


def _gemma(family: str, hf: Dict[str, Any]) -> Dict[str, Any]:
    """Our model section of a Gemma 2 / Gemma 3 text ``config.json``, read as transformers reads it: (1 + w)
    RMSNorms before and after attention and MLP, embeddings x sqrt(hidden), GeGLU with tanh GELU, softmax scale
    1 / sqrt(query_pre_attn_scalar), sliding windows by ``layer_types``, soft-capping, Gemma 3's QK norm and local
    RoPE base."""
    get = _reader(family, hf, _GEMMA_DEFAULTS if family == "gemma2" else _GEMMA3_DEFAULTS, _GEMMA_FIELDS)
    if get("hidden_activation") != "gelu_pytorch_tanh":
        raise _fail("hidden_activation", get("hidden_activation"), f"{family}'s GeGLU is built with "
                    "gelu_pytorch_tanh: convert a model with it")
    if hf.get("hidden_act") not in (None, "gelu_pytorch_tanh"):  # transformers reads hidden_activation only
        raise _fail("hidden_act", hf["hidden_act"], "transformers ignores it for hidden_activation: remove it")
    if get("attention_bias"):
        raise _fail("attention_bias", get("attention_bias"), f"{family} with attention_bias biases the attention "
                    "without the MLP, which ds_megatron does not express: convert a model with attention_bias false")
    if get("use_bidirectional_attention"):
        raise _fail("use_bidirectional_attention", get("use_bidirectional_attention"), "ds_megatron trains causal "
                    "language models: convert a model with it false")
    if family == "gemma3" and get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 attention never passes it on: the model it runs has none
        raise _fail("attn_logit_softcapping", get("attn_logit_softcapping"), "transformers' Gemma 3 ignores it: "
                    "set it to null")
    model: Dict[str, Any] = _gqa_decoder(get, hf, _int("head_dim", get("head_dim"), 1))
    # transformers' default layer_types: Gemma 2 alternates from a sliding layer, Gemma 3 by its pattern
    every = 2 if family == "gemma2" else hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    types = _layer_types(hf, model["num_layers"], every)
    scalar = get("query_pre_attn_scalar")
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not scalar > 0:
        raise _fail("query_pre_attn_scalar", scalar, "use a number > 0 (the softmax scale is its inverse root)")
    model.update(
        **_gemma_rope(family, hf), layernorm_zero_centered_gamma=True, post_sublayer_norms=True,
        apply_embedding_scaling=True, activation="gelu_tanh", add_bias_linear=False,
        add_qkv_bias=False, untie_embeddings_and_output_weights=not get("tie_word_embeddings"),
        qk_layernorm=family == "gemma3", softmax_scale=float(scalar) ** -0.5, **_windows(types, get))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(key) is not None:
            model[key] = float(get(key))
    if "sliding_attention" not in types:
        model.pop("local_rotary_base", None)
    return model


# gpt-oss (transformers' GptOssForCausalLM) ------------------------------------------------------------------------
# transformers' GptOssConfig defaults: a field config.json leaves out is read as transformers reads it
_GPT_OSS_DEFAULTS = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "attention_dropout": 0.0, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001, "attention_bias": True,
}
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_GPT_OSS_FIELDS = {"rope_theta", "rope_scaling", "rope_parameters", "layer_types"}


def _gpt_oss(hf: Dict[str, Any]) -> Dict[str, Any]:
    """Our model section of a gpt-oss ``config.json``, read as transformers' ``GptOssForCausalLM`` does: attention
    sinks, sliding (``sliding_window``) and full layers by ``layer_types``, q/k/v/o biases (``attention_bias``),
    yarn RoPE, a biased router (top-k, then softmax over the k), biased experts with the clamped GLU
    ``(up.clamp(-limit, limit) + 1) * quick_gelu(gate.clamp(max=limit))``.  MXFP4 expert weights
    (``quantization_config`` quant_method mxfp4) are dequantized on load (``convert.fused_experts``)."""
    get = _reader("gpt_oss", hf, _GPT_OSS_DEFAULTS, _GPT_OSS_FIELDS, dequantized="mxfp4")
    if get("hidden_act") != "silu":  # transformers' gpt-oss never reads it: a different value is likely a mistake
        raise _fail("hidden_act", get("hidden_act"), "gpt-oss's experts use swiglu_alpha, not hidden_act: set silu")
    if get("swiglu_alpha") != 1.702:
        raise _fail("swiglu_alpha", get("swiglu_alpha"), "ds_megatron builds gpt-oss's gate activation "
                    "x * sigmoid(1.702 x) (Megatron's quick_gelu): convert a model with swiglu_alpha 1.702")
    limit = get("swiglu_limit")
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise _fail("swiglu_limit", limit, "use a number > 0")
    model: Dict[str, Any] = _gqa_decoder(get, hf, _int("head_dim", get("head_dim"), 1))
    types = _layer_types(hf, model["num_layers"], 2)  # transformers' default: alternating, from a sliding layer
    rope_hf = dict(hf)
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        rope_hf["rope_parameters"] = dict(_GPT_OSS_ROPE)
    params = rope_hf.get("rope_scaling") or rope_hf["rope_parameters"]
    rope_hf["rope_theta"] = params.get("rope_theta", hf.get("rope_theta", 150000.0))  # gpt-oss's default base
    bias = bool(get("attention_bias"))
    model.update(
        **_rope(rope_hf), activation="quick_gelu",
        activation_func_clamp_value=float(limit), glu_linear_offset=1.0, softmax_type="learnable",
        add_bias_linear=bias, add_qkv_bias=bias, untie_embeddings_and_output_weights=not get("tie_word_embeddings"),
        num_experts=_int("num_local_experts", get("num_local_experts"), 1),
        moe_router_topk=_int("num_experts_per_tok", get("num_experts_per_tok"), 1),
        moe_ffn_hidden_size=get("intermediate_size"), moe_router_pre_softmax=False, moe_add_bias_linear=True,
        moe_aux_loss_coeff=float(get("router_aux_loss_coef") or 0.0), **_windows(types, get))
    return model


def model_of_checkpoint(path: str, mtp_num_layers: Optional[int] = None,
                        notices: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
    """The model section of a checkpoint directory: ours (``METADATA``) or a Hugging Face one (``config.json``, its
    multi-token prediction by ``resolve_mtp``, whose line goes to ``notices``); None when ``path`` holds neither."""
    if os.path.isfile(os.path.join(path, METADATA)):
        with open(os.path.join(path, METADATA)) as f:
            model = dict(json.load(f)["model"])
        if mtp_num_layers is not None and mtp_num_layers != (model.get("mtp_num_layers") or 0):
            raise ConvertError(f"mtp_num_layers={mtp_num_layers}: {path} was converted with "
                               f"{model.get('mtp_num_layers') or 0} multi-token-prediction layer(s); leave it unset "
                               "(or export it to Hugging Face and load that)")
        return model
    if os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            model = model_from_hf(json.load(f))[1]
        notice = resolve_mtp(model, hf_tensor_names(path), mtp_num_layers, path)
        if notice and notices is not None:
            notices.append(notice)
        return model
    return None


def hf_from_model(family: str, model: Dict[str, Any], base: Dict[str, Any]) -> Dict[str, Any]:
    """``base`` (the config.json the model came from) with the architecture fields of ``model`` written back.

    The model section must still be the one ``model_from_hf(base)`` gives (training changes weights, not shapes):
    anything else is refused, since the fields we do not map would no longer describe it."""
    _, expected = model_from_hf(base)
    for key, value in expected.items():
        if key in ("seq_length", "attention_dropout", "hidden_dropout", "moe_aux_loss_coeff", "init_method_std",
                   "moe_router_dtype", "mtp_loss_scaling_factor"):
            continue  # training settings, not the architecture
        if key == "mtp_num_layers" and not model.get(key):
            continue  # MTP off: the declared layers absent from the files, as transformers saves them
        if model.get(key, value) != value:
            raise ConvertError(f"model.{key}={model.get(key)!r} differs from the Hugging Face model it came from "
                               f"({value!r}); export a model with the original architecture")
    if ARCHITECTURES.get(family) != (base.get("architectures") or [None])[0]:
        raise ConvertError(f"family {family!r} does not match config.json architectures {base.get('architectures')}")
    out = dict(base)
    if family == "gpt_oss":
        out.pop("quantization_config", None)  # MXFP4 experts were dequantized on load; exported in the model's dtype
    return out


# Families a job trained from scratch may be exported as (train.export_hf_family): the dense ones.
EXPORT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# Model fields that are training settings, not the architecture: never compared.
RUNTIME_FIELDS = ("seq_length", "hidden_dropout", "attention_dropout", "sequence_parallel", "recompute_granularity",
                  "recompute_modules", "recompute_method", "recompute_num_layers", "mlp_sequence_tiles",
                  "loss_sequence_tiles",
                  "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_token_dispatcher_type", "moe_grouped_gemm",
                  "moe_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
                  "init_method_std", "label_smoothing", "make_vocab_size_divisible_by", "layernorm_epsilon",
                  "moe_shared_expert_ffn_hidden_size", "moe_router_dtype", "cp_comm_type", "mtp_loss_scaling_factor")


def hf_config_from_model(family: str, model: Dict[str, Any], field: str = "train.export_hf_family",
                         eos_token_id: Any = None) -> Dict[str, Any]:
    """The ``config.json`` of a ``family`` model equal to ``model`` (a from-scratch job's section), or ConvertError.

    Built forward, then checked backward: ``model_from_hf`` of the result must give back every architecture
    field of ``model``, so that a model the family cannot express (LayerNorm, GELU without gating, learned
    positions, biases the family lacks, MoE, ...) is refused naming the first field that differs."""
    if family not in EXPORT_FAMILIES:
        raise ConvertError(f"{field}={family!r} is not supported; use one of: {', '.join(EXPORT_FAMILIES)} "
                           "(a model trained from scratch exports as a dense family)")
    h, n = model["hidden_size"], model["num_attention_heads"]
    hf: Dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]], "model_type": _MODEL_TYPES[family],
        "vocab_size": model["vocab_size"], "hidden_size": h, "intermediate_size": model.get("ffn_hidden_size") or 4 * h,
        "num_hidden_layers": model["num_layers"], "num_attention_heads": n,
        "num_key_value_heads": model.get("num_query_groups") or n,
        "head_dim": model.get("kv_channels") or h // n, "max_position_embeddings": model["seq_length"],
        "rms_norm_eps": model.get("norm_epsilon", 1e-5), "hidden_act": model.get("activation", "gelu"),
        "rope_parameters": _rope_parameters(model),
        "tie_word_embeddings": not model.get("untie_embeddings_and_output_weights", False),
        "initializer_range": model.get("init_method_std", 0.02), "attention_dropout": 0.0,
    }
    if family == "llama":
        bias = bool(model.get("add_bias_linear", True))
        hf.update(attention_bias=bias, mlp_bias=bias)
    if family in ("mistral", "qwen2", "qwen3"):
        hf["sliding_window"] = None
    if family == "qwen3":
        hf["attention_bias"] = False
    if eos_token_id is not None:
        hf["eos_token_id"] = eos_token_id
    if model.get("rotary_percent", 1.0) != 1.0:
        raise ConvertError(f"model.rotary_percent={model['rotary_percent']!r} cannot be exported as {family!r} "
                           f"(it rotates every channel); set rotary_percent 1.0 or remove {field}")
    ours, expected = GPTConfig(**model), GPTConfig(**model_from_hf(hf)[1])
    for key, value in vars(expected).items():
        if key not in RUNTIME_FIELDS and getattr(ours, key) != value:
            raise ConvertError(f"model.{key}={getattr(ours, key)!r} cannot be exported as {family!r}, whose models "
                               f"have {value!r}; change model.{key} or remove {field}")
    return hf
