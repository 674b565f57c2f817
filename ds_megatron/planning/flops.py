"""Floating-point operations of a GPT step, from the model config alone (pure, no torch).

A multiply-add is 2 FLOPs; a GEMM of [m, k] x [k, n] is ``2 m n k``.  Per transformer layer and sample of ``s``
tokens, forward:

* attention projections: QKV ``2 s h (n + 2 g) d`` (n heads, g KV groups of width d), the output projection
  ``2 s n d h``; multi-latent attention its down- and up-projections instead;
* the attention core: ``Q K^T`` and ``P V``, ``2 s^2 n (d_qk + d_v)``, **counted in full for causal attention**, as
  the published tables count it (Narayanan et al. 2021, Korthikanti et al. 2022; megatron-core's
  ``num_floating_point_operations`` has counted it at half since 2025): ``mfu`` and ``model_tflops_per_gpu`` use
  this convention.  The step-time model charges the kernel's own work instead (a causal flash kernel skips the
  masked half);
* the MLP: ``2 s h f`` per projection (3 with a gated unit); an MoE layer: the router ``2 s h E``, each token's
  ``moe_router_topk`` experts and the shared expert as MLPs;
* once per sample the output layer, ``2 s h V`` (V the padded vocabulary), and each multi-token-prediction depth
  its ``eh_proj`` (``2 s 2h h``), layer and output layer.

A step is forward + backward = 3x the forward (the backward's input- and weight-gradient GEMMs each match the
forward's); recomputation's extra forward is not model work (``planning.step_time`` charges its time).  For a
dense GPT-3 layer this is the
``24 s h^2 + 4 s^2 h`` of Narayanan et al., whose full-recomputation count ``narayanan_flops`` is kept as the
published formula.
"""
from __future__ import annotations

from typing import Dict

from ..config.model import pad_vocab_size


def _mlp(tokens: float, h: int, ffn: int, gated: bool) -> float:
    return 2 * tokens * h * ffn * (3 if gated else 2)


def layer_forward_flops(cfg, layer: int, samples: float = 1) -> Dict[str, float]:
    """Forward FLOPs of transformer layer ``layer`` for ``samples`` sequences of ``seq_length`` tokens, by part:
    ``qkv`` (every projection into the core), ``attention`` (the core, causal counted in full), ``proj``, ``mlp``
    (an MoE layer's router, routed experts and shared expert)."""
    s, h, n = cfg.seq_length, cfg.hidden_size, cfg.num_attention_heads
    tokens = samples * s
    qk, v = cfg.head_widths
    if cfg.multi_latent_attention:
        q_in = h if cfg.q_lora_rank is None else cfg.q_lora_rank
        down = h * (cfg.q_lora_rank or 0) + h * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim)
        up = q_in * n * qk + cfg.kv_lora_rank * n * (cfg.qk_head_dim + v)
        qkv = 2 * tokens * (down + up)
    else:
        qkv = 2 * tokens * h * (n + 2 * cfg.query_groups) * cfg.head_dim
    attention = 2 * samples * s * s * n * (qk + v)
    proj = 2 * tokens * n * v * h
    if cfg.is_moe_layer(layer):
        mlp = 2 * tokens * h * cfg.num_experts + cfg.moe_router_topk * _mlp(tokens, h, cfg.moe_ffn_hidden_size,
                                                                            cfg.gated_linear_unit)
        if cfg.moe_shared_expert_intermediate_size:
            mlp += _mlp(tokens, h, cfg.moe_shared_expert_intermediate_size, cfg.gated_linear_unit)
    else:
        mlp = _mlp(tokens, h, cfg.ffn_hidden_size, cfg.gated_linear_unit)
    return {"qkv": qkv, "attention": attention, "proj": proj, "mlp": mlp}


def logits_flops(cfg, samples: float = 1) -> float:
    """The output layer's forward (the padded vocabulary, as the model computes it)."""
    vocab = pad_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)
    return 2 * samples * cfg.seq_length * cfg.hidden_size * vocab


def forward_flops(cfg, samples: float = 1) -> float:
    """The whole model's forward for ``samples`` sequences: every layer, the output layer, MTP's depths."""
    total = sum(sum(layer_forward_flops(cfg, i, samples).values()) for i in range(cfg.num_layers))
    total += logits_flops(cfg, samples)
    h, tokens = cfg.hidden_size, samples * cfg.seq_length
    for k in range(cfg.mtp_num_layers or 0):
        total += 2 * tokens * 2 * h * h + sum(layer_forward_flops(cfg, cfg.num_layers + k, samples).values())
        total += logits_flops(cfg, samples)
    return total


def model_flops(cfg, samples: float) -> float:
    """Model FLOPs of a step over ``samples`` sequences: forward and backward (3x the forward), no
    recomputation: the numerator of ``mfu``."""
    return 3 * forward_flops(cfg, samples)


def narayanan_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. (SC21) eq. 3: a GPT step with full recomputation,
    ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
