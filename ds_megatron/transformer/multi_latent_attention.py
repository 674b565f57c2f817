"""Multi-latent attention (MLA, DeepSeek-V2/V3), with its heads split across TP ranks.

Per token ``x [h]`` (names: transformers' DeepSeek-V3; sizes: megatron-core's config):

* q: ``q_b_proj(norm(q_a_proj(x)))`` (``q_lora_rank``; null: one ``q_proj``), per head
  ``qk_head_dim`` channels without position and ``qk_pos_emb_head_dim`` channels RoPE turns;
* ``kv_a_proj_with_mqa(x)`` = ``[latent (kv_lora_rank); k_pos (qk_pos_emb_head_dim)]``;
  ``kv_b_proj(norm(latent))`` gives per head ``qk_head_dim`` key and ``v_head_dim`` value channels;
  ``k_pos`` is one key per token, shared by every head;
* RoPE turns only the positional channels, in DeepSeek's interleaved layout: channel pairs
  (0, 1), (2, 3), ... of the weights are one frequency each, so the channels are reordered (evens,
  then odds) before the rotate-half rotation, as transformers' ``rope_interleave`` and megatron-core do;
* causal softmax attention scaled by ``1 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``, times
  ``m(s, yarn_mscale_all_dim)^2`` with YaRN (``m(s, k) = 0.1 k ln(s) + 1``), DeepSeek's correction
  of the YaRN factor its cos and sin already carry; ``o_proj`` back to h.

Tensor parallelism: the up-projections (``q_b_proj`` or ``q_proj``, ``kv_b_proj``) are
column-parallel by heads, ``o_proj`` row-parallel; the down-projections ``q_a_proj`` and
``kv_a_proj_with_mqa``, the two latent norms and ``k_pos`` are replicated.  ``x`` enters once through
the paper's *f* (under sequence parallelism the all-gather of the sequence, whose backward
reduce-scatters), and nothing after it reduces over TP until ``o_proj``: each rank computes the
replicated part for its own heads only, so the gradients of the replicated parameters are partial
sums over TP (with or without sequence parallelism: each rank sees the whole sequence but only its
heads) and are marked like sequence-parallel ones, summed once per step over TP
(``allreduce_tp_partial_grads``); the input gradient is summed by *f*'s backward.

Context parallelism: the rank's tokens are its zigzag chunks (RoPE turns them by their positions) and
the core is ``context_parallel_attention`` with every exchange type; keys are ``qk_head_dim +
qk_pos_emb_head_dim`` wide and values ``v_head_dim``, and the cores carry the two widths as they are
(V is not padded to K's width: no wasted bytes on the wire).

FP8: every projection runs its three GEMMs in fp8 by the layer's recipe, the down-projections too (megatron-core
builds them as Transformer Engine linears, which run in fp8 under its autocast); the norms, RoPE and the core stay
16-bit.  A down-projection's output gradient is this rank's partial sum over its heads: it is quantized per rank.

Weights are drawn in the same order and from the same full tensors whatever the TP size.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from ..parallel_state import ParallelGroup
from ..tensor_parallel import (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear,
                               copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                               mark_sequence_parallel)
from ..tensor_parallel.random import checkpoint
from ..tensor_parallel.utils import divide
from ..tensor_parallel.weight_grad_store import linear
from .context_parallel import context_parallel_attention, rank_positions
from .norm import build_norm
from .packed_seq_params import PackedSeqParams, document_attention
from .rotary import RotaryEmbedding, yarn_attention_factor


def mla_softmax_scale(config) -> float:
    """``1 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``, times ``m(s, yarn_mscale_all_dim)^2`` under YaRN."""
    scale = (config.qk_head_dim + config.qk_pos_emb_head_dim) ** -0.5
    if config.rope_scaling_type == "yarn" and config.yarn_mscale_all_dim:
        # m(s, k) / m(s, 0) = m(s, k); multiplied twice in this order, as transformers does
        m = yarn_attention_factor(config.rope_scaling_factor, config.yarn_mscale_all_dim, 0.0)
        scale = scale * m * m
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Channels (0, 1), (2, 3), ... -> evens then odds: DeepSeek's pairs become rotate-half's (i, i + d/2)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLASelfAttention(torch.nn.Module):
    """``config``: a ``GPTConfig`` with ``multi_latent_attention`` (the same call as ``ParallelAttention``)."""

    def __init__(self, config, *, tp: ParallelGroup, init_method, output_init_method, rng_tracker=None,
                 cp: Optional[ParallelGroup] = None, hierarchical_cp=None):
        super().__init__()
        self.cp = cp if cp is not None else ParallelGroup.single("cp")
        self.hierarchical_cp = hierarchical_cp
        self.cp_comm_type = config.cp_comm_type
        n, h = config.num_attention_heads, config.hidden_size
        self.tp = tp
        self.heads = divide(n, tp.size)
        self.qk_head_dim, self.pos_dim, self.v_head_dim = (config.qk_head_dim, config.qk_pos_emb_head_dim,
                                                           config.v_head_dim)
        self.kv_lora_rank = config.kv_lora_rank
        self.sequence_parallel = config.sequence_parallel and tp.size > 1
        self.attention_dropout = config.attention_dropout
        self.rng_tracker = rng_tracker
        # Not under CP, whose cores keep only their output and log-sum-exp (as ParallelAttention's).
        self.recompute_core = (config.recompute_granularity == "selective"
                               and "core_attn" in (config.recompute_modules or ()) and self.cp.size == 1)
        self.softmax_scale = mla_softmax_scale(config)
        bias = config.add_bias_linear  # transformers' attention_bias: the down-projections and o_proj
        q_width = n * (self.qk_head_dim + self.pos_dim)

        def up(width_in, width_out):  # its input is the replicated latent (or x, already through f)
            return ColumnParallelLinear(width_in, width_out, tp=tp, bias=False, gather_output=False,
                                        init_method=init_method)

        replicated = []
        if config.q_lora_rank is None:
            self.q_proj = up(h, q_width)
        else:
            self.q_a_proj = ReplicatedLinear(h, config.q_lora_rank, bias, init_method, tp=tp)
            # model.norm_epsilon (megatron-core's); transformers' DeepSeek-V3 fixes these two norms' eps at 1e-6
            self.q_a_layernorm = build_norm(config, config.q_lora_rank)
            self.q_b_proj = up(config.q_lora_rank, q_width)
            replicated += [self.q_a_proj, self.q_a_layernorm]
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.pos_dim, bias, init_method,
                                                   tp=tp)
        self.kv_a_layernorm = build_norm(config, self.kv_lora_rank)
        self.kv_b_proj = up(self.kv_lora_rank, n * (self.qk_head_dim + self.v_head_dim))
        replicated += [self.kv_a_proj_with_mqa, self.kv_a_layernorm]
        if tp.size > 1:
            for module in replicated:  # each rank's gradient covers its heads only: summed over TP
                mark_sequence_parallel(module)
        self.rotary = RotaryEmbedding.from_config(config)  # over qk_pos_emb_head_dim (GPTConfig.rotary_dim)
        self.o_proj = RowParallelLinear(n * self.v_head_dim, h, tp=tp, bias=bias, input_is_parallel=True,
                                        init_method=output_init_method, sequence_parallel=config.sequence_parallel)

    @staticmethod
    def _up(layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
        """The column-parallel up-projection without its own *f*: ``x`` went through it once already (in fp8 by the
        layer's recipe when it has one, as its own forward would)."""
        return linear(x, layer.weight, None, layer.weight_grad_store, layer.fp8)

    def _qkv(self, hidden: torch.Tensor, packed: Optional[PackedSeqParams]):
        """q, k [b, heads, s, qk_head_dim + qk_pos_emb_head_dim] and v [b, heads, s, v_head_dim] of this rank."""
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(hidden, self.tp, tensor_parallel_output_grad=True)
        else:
            x = copy_to_tensor_model_parallel_region(hidden, self.tp)
        s, b = x.shape[0], x.shape[1]
        if hasattr(self, "q_proj"):
            q = self._up(self.q_proj, x)
        else:
            q = self._up(self.q_b_proj, self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(s, b, self.heads, self.qk_head_dim + self.pos_dim).permute(1, 2, 0, 3)
        latent, k_pos = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.pos_dim], dim=-1)
        kv = self._up(self.kv_b_proj, self.kv_a_layernorm(latent))
        kv = kv.view(s, b, self.heads, self.qk_head_dim + self.v_head_dim).permute(1, 2, 0, 3)
        k_nope, v = torch.split(kv, [self.qk_head_dim, self.v_head_dim], dim=-1)
        q_nope, q_pos = torch.split(q, [self.qk_head_dim, self.pos_dim], dim=-1)
        # packed: each token's place in its document; with CP: this rank's tokens (its two zigzag chunks)
        positions = packed.local_position_ids if packed is not None else rank_positions(s, self.cp, q.device)
        q_pos = self.rotary(deinterleave(q_pos), positions)
        k_pos = self.rotary(deinterleave(k_pos.permute(1, 0, 2).unsqueeze(1)), positions)  # [b, 1, s, pos]
        q = torch.cat((q_nope, q_pos), dim=-1)
        k = torch.cat((k_nope, k_pos.expand(-1, self.heads, -1, -1)), dim=-1)
        return q, k, v

    def forward(self, hidden: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        # hidden: [s, b, h] (or this rank's [s/tp, b, h] under sequence parallelism) -> the same shape
        packed = packed_seq_params
        q, k, v = self._qkv(hidden, packed)
        if self.cp.size > 1:  # k as wide as q, v narrower: the CP cores carry both widths
            ctx = context_parallel_attention(q, k, v, self.cp, self.cp_comm_type, softmax_scale=self.softmax_scale,
                                             hierarchical=self.hierarchical_cp,
                                             places=None if packed is None else packed.cp_places)
        elif self.recompute_core and self.training and torch.is_grad_enabled():
            ctx = checkpoint(self._core, self.rng_tracker, q, k, v, packed)
        else:
            ctx = self._core(q, k, v, packed)
        s, b = ctx.size(2), ctx.size(0)
        out, _ = self.o_proj(ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v_head_dim))
        return out

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              packed: Optional[PackedSeqParams] = None) -> torch.Tensor:
        dropout = self.attention_dropout if self.training else 0.0
        fork = self.rng_tracker.fork() if (dropout > 0 and self.rng_tracker is not None) else contextlib.nullcontext()
        # On a CPU, torch's flash kernel takes one head width for q, k and v; narrower values would send the
        # core to the math kernel, which keeps the s x s softmax per head for backward.  Zero channels appended
        # to v add zero channels to the output, which are dropped.
        pad = q.size(-1) - v.size(-1) if q.device.type == "cpu" else 0
        v = F.pad(v, (0, pad)) if pad else v
        with fork:
            if packed is not None:
                out = document_attention(q, k, v, packed, scale=self.softmax_scale, dropout_p=dropout)
            else:
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                     scale=self.softmax_scale)
        return out[..., :v.size(-1) - pad] if pad else out

    def extra_repr(self) -> str:
        return f"heads_per_partition={self.heads}, softmax_scale={self.softmax_scale:.6g}"


__all__ = ["MLASelfAttention", "mla_softmax_scale", "deinterleave"]
