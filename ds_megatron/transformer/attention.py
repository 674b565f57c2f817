"""Causal self-attention with heads split across TP ranks (paper, Fig. 3b), with grouped-query attention and RoPE.

The fused QKV projection is column-parallel, so each rank owns
``num_heads / tp`` whole heads and computes their attention locally; the
output projection is row-parallel.  Attention-probability dropout happens
inside the TP region, so it runs under the model-parallel RNG tracker: each
TP rank drops different entries of its own heads.

Grouped-query attention (``num_query_groups`` g < heads n): the fused weight's
output rows are Megatron's, per query group ``[q heads of the group (n/g x d),
k (d), v (d)]``, groups in order; MHA is the case g = n (``[q, k, v]`` per head).
When TP divides g, a contiguous column split hands every rank whole groups
(``query_key_value``).  When g divides TP instead, each KV head is replicated on
``tp / g`` consecutive TP ranks: the rank holds its query heads
(``linear_q``, column-parallel) and its group's k and v (``linear_kv``).  Each
copy of ``linear_kv`` only sees the gradient of its rank's query heads, so the
copies' gradients are summed over the ranks sharing the group once per step,
with the other TP-partial gradients (``allreduce_tp_partial_grads``; one
all-reduce over TP of a [groups, ...] buffer in which each rank fills its
group's slot, so no process group beyond TP is needed): every copy applies the
full gradient and stays identical.
Norms count the copy of the first rank of each group once.

The full fused weight is drawn once from the default RNG whatever the layout,
so every TP size holds the same model.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..parallel_state import ParallelGroup
from ..tensor_parallel import (ColumnParallelLinear, RowParallelLinear, copy_to_tensor_model_parallel_region,
                               gather_from_sequence_parallel_region, mark_sequence_parallel, mark_tp_replica,
                               set_tensor_model_parallel_attributes)
from ..tensor_parallel.random import checkpoint
from ..tensor_parallel.utils import divide
from .context_parallel import Places, context_parallel_attention, rank_positions
from .norm import build_norm
from .packed_seq_params import PackedSeqParams, document_attention
from .rotary import RotaryEmbedding


class ReplicatedKV(torch.nn.Module):
    """One KV group's ``[k; v]`` projection, held by each of the ``replicas`` TP ranks sharing it.

    Each copy's gradient covers only this rank's query heads; the copies' gradients are summed over the
    ranks of the group once per step with the other TP-partial gradients (``mark_tp_replica``)."""

    def __init__(self, weight: torch.Tensor, bias: bool, tp: ParallelGroup, replicas: int, num_groups: int):
        super().__init__()
        self.group_index = tp.rank // replicas
        self.weight = torch.nn.Parameter(weight)
        self.bias = torch.nn.Parameter(torch.zeros(weight.size(0))) if bias else None
        for p in self.parameters():
            # Counted in norms on the first rank of the group only (the others hold copies).
            set_tensor_model_parallel_attributes(p, tp.rank % replicas == 0, 0)
            mark_tp_replica(p, self.group_index, num_groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ParallelAttention(torch.nn.Module):
    """``config``: a ``GPTConfig`` (heads, query groups, kv_channels, biases, RoPE, qk norm, dropout, SP)."""

    def __init__(self, config, *, tp: ParallelGroup, init_method, output_init_method, rng_tracker=None,
                 cp: Optional[ParallelGroup] = None, hierarchical_cp=None, layer_number: int = 0):
        """``cp``: the context-parallel group; with more than one rank the hidden states hold this rank's
        zigzag chunks of the sequence and the core attention is ``context_parallel_attention``.
        ``hierarchical_cp``: its (a2a, ring) groups for ``cp_comm_type "a2a+p2p"``.  ``layer_number``: the
        layer's index in the whole model (0-based), which decides its sliding window and RoPE base."""
        super().__init__()
        self.cp = cp if cp is not None else ParallelGroup.single("cp")
        self.hierarchical_cp = hierarchical_cp
        self.cp_comm_type = config.cp_comm_type
        n, g, d, h = config.num_attention_heads, config.query_groups, config.head_dim, config.hidden_size
        self.tp = tp
        self.head_dim = d
        self.num_heads_per_partition = divide(n, tp.size)
        self.q_per_group = n // g
        self.replicas = tp.size // g if tp.size > g else 1
        self.groups_per_partition = max(g // tp.size, 1)
        self.attention_dropout = config.attention_dropout
        self.window = config.attention_window(layer_number)  # None: full causal attention
        self.softmax_scale, self.softcap = config.softmax_scale, config.attn_logit_softcapping
        self.rng_tracker = rng_tracker
        # Selective recomputation of the core (softmax(QK^T)V and its dropout).  Not under context parallelism,
        # whose cores keep only their output and log-sum-exp already (a rerun would repeat their exchange).
        self.recompute_core = (config.recompute_granularity == "selective"
                               and "core_attn" in (config.recompute_modules or ()))
        self.sequence_parallel = config.sequence_parallel and tp.size > 1
        bias = config.qkv_bias
        master = torch.empty(g * (self.q_per_group + 2) * d, h)
        init_method(master)  # the full fused weight, in the order of every layout

        def take(rows):
            def init(weight):
                with torch.no_grad():
                    weight.copy_(rows)
            return init

        if self.replicas == 1:
            self.query_key_value = ColumnParallelLinear(h, master.size(0), tp=tp, bias=bias, gather_output=False,
                                                        init_method=take(master),
                                                        sequence_parallel=config.sequence_parallel)
        else:
            per_group = master.view(g, self.q_per_group + 2, d, h)
            self.linear_q = ColumnParallelLinear(h, n * d, tp=tp, bias=bias, gather_output=False,
                                                 init_method=take(per_group[:, :-2].reshape(n * d, h)),
                                                 sequence_parallel=config.sequence_parallel)
            kv = per_group[tp.rank // self.replicas, -2:].reshape(2 * d, h).clone()
            self.linear_kv = ReplicatedKV(kv, bias, tp, self.replicas, g)
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm, self.k_layernorm = build_norm(config, d), build_norm(config, d)
            if tp.size > 1:
                # Shared by all heads, each TP rank sees only its heads: the gradient is a partial sum over TP.
                mark_sequence_parallel(self.q_layernorm)
                mark_sequence_parallel(self.k_layernorm)
        self.rotary = None
        if config.position_embedding_type == "rope":
            local = self.window is not None and config.local_rotary_base is not None
            # Gemma 3: the windowed layers turn by a base of their own, without the global layers' scaling
            self.rotary = (RotaryEmbedding(config.rotary_dim, config.local_rotary_base) if local
                           else RotaryEmbedding.from_config(config))
        self.sinks = None
        if config.softmax_type == "learnable":
            # gpt-oss's attention sinks: this rank's heads' logits (zeros, so the draws above do not move)
            self.sinks = torch.nn.Parameter(torch.zeros(self.num_heads_per_partition))
            set_tensor_model_parallel_attributes(self.sinks, True, 0)
        self.dense = RowParallelLinear(n * d, h, tp=tp, bias=config.add_bias_linear, input_is_parallel=True,
                                       init_method=output_init_method, sequence_parallel=config.sequence_parallel)

    def _project(self, hidden: torch.Tensor):
        """q [s, b, heads, d], k and v [s, b, groups, d] of this rank."""
        s, b = hidden.shape[0] * (self.tp.size if self.sequence_parallel else 1), hidden.shape[1]
        d = self.head_dim
        if self.replicas == 1:
            qkv, _ = self.query_key_value(hidden)
            qkv = qkv.view(s, b, self.groups_per_partition, self.q_per_group + 2, d)
            # One split: its backward concatenates the three gradients; indexing would zero-fill a full
            # qkv-sized gradient per piece and add them up (4% of a CPU step at hidden 256).
            q, k, v = torch.split(qkv, [self.q_per_group, 1, 1], dim=3)
            return q.reshape(s, b, self.num_heads_per_partition, d), k.squeeze(3), v.squeeze(3)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(hidden, self.tp, tensor_parallel_output_grad=True)
        else:
            x = copy_to_tensor_model_parallel_region(hidden, self.tp)
        q = F.linear(x, self.linear_q.weight, self.linear_q.bias).view(s, b, self.num_heads_per_partition, d)
        kv = self.linear_kv(x).view(s, b, 1, 2, d)
        return q, kv[:, :, :, 0], kv[:, :, :, 1]

    def forward(self, hidden: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        # hidden: [s, b, h] (or this rank's [s/tp, b, h] under sequence parallelism; the projection gathers it)
        packed = packed_seq_params
        q, k, v = self._project(hidden)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        # -> [b, heads, s, d] for SDPA
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if self.rotary is not None:
            # packed: each token's place in its document; with CP: this rank's tokens (its two zigzag chunks)
            positions = packed.local_position_ids if packed is not None else rank_positions(q.size(2), self.cp,
                                                                                           q.device)
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if self.rotary is not None or self.q_layernorm is not None:
            # q and k are new tensors: v on its own lets the projection's output (their old storage) go, which
            # the core would otherwise keep alive through v, a view of it (2 of 3 [s, b, h] per layer for MHA).
            v = v.contiguous()
        if self.cp.size > 1:
            # GQA-aware: only the kv heads travel; no attention dropout here (refused at config time).
            ctx = context_parallel_attention(q, k, v, self.cp, self.cp_comm_type, softmax_scale=self.softmax_scale,
                                             hierarchical=self.hierarchical_cp, window=self.window,
                                             softcap=self.softcap, places=None if packed is None else packed.cp_places,
                                             sinks=self.sinks)
            return self._output(ctx)
        heads_per_kv = q.size(1) // k.size(1)
        if heads_per_kv > 1:
            k, v = k.repeat_interleave(heads_per_kv, dim=1), v.repeat_interleave(heads_per_kv, dim=1)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            # Selective recomputation ("core_attn"): keep q, k, v; rerun the core (its dropout replayed).
            ctx = checkpoint(self._core, self.rng_tracker, q, k, v, packed)
        else:
            ctx = self._core(q, k, v, packed)
        return self._output(ctx)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              packed: Optional[PackedSeqParams] = None) -> torch.Tensor:
        dropout = self.attention_dropout if self.training else 0.0
        fork = self.rng_tracker.fork() if (dropout > 0 and self.rng_tracker is not None) else contextlib.nullcontext()
        with fork:
            if self.window is not None or self.softcap is not None or self.sinks is not None:
                allowed = self._allowed(q.size(0), q.size(2), packed, q.device)
                if self.sinks is not None:
                    return sink_attention(q, k, v, allowed, self.softmax_scale, self.sinks, dropout)
                if self.softcap is None:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout,
                                                          scale=self.softmax_scale)
                return softcapped_attention(q, k, v, allowed, self.softmax_scale, self.softcap, dropout)
            if packed is not None:
                return document_attention(q, k, v, packed, scale=self.softmax_scale, dropout_p=dropout)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale)

    def _allowed(self, batch: int, s: int, packed: Optional[PackedSeqParams], device) -> torch.Tensor:
        """Which keys each query sees (``Places.allowed``, the one masking rule of every core): causal, within its
        document when packed, within the layer's window."""
        index = torch.arange(s, device=device)
        if packed is None:
            places = Places(index, window=self.window)
        else:
            places = Places(index.expand(batch, s), packed.segment_ids, batched=True, window=self.window)
        return places.allowed(places)

    def _output(self, ctx: torch.Tensor) -> torch.Tensor:
        """``ctx [b, heads, s, d]`` -> the row-parallel output projection, [s(/tp), b, h]."""
        s, b = ctx.size(2), ctx.size(0)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.num_heads_per_partition * self.head_dim)
        out, _ = self.dense(ctx)
        return out


def soft_cap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """Gemma's soft-capping, ``cap * tanh(x / cap)`` (None: ``x``), of attention scores and of the final logits."""
    return x if cap is None else torch.tanh(x / cap) * cap


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                   scale: Optional[float], sinks: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """gpt-oss's core: the softmax over ``[mask(q k^T scale), sink of the head]`` without the sink's column, times
    ``v`` (``q, k, v [b, heads, s, d]``, k and v with q's heads; ``sinks [heads]``).  The scores in float32 for
    16-bit inputs, else in the inputs' dtype."""
    cdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scale = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    scores = (torch.matmul(q.to(cdt), k.to(cdt).transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))
    sink = sinks.to(cdt).view(1, -1, 1, 1).expand(scores.size(0), -1, scores.size(2), 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(v.dtype), v)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                         scale: Optional[float], cap: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Gemma 2's core: ``softmax(mask(cap * tanh(q k^T scale / cap))) v`` (``q, k, v [b, heads, s, d]``, k and v
    with q's heads; ``allowed`` the mask).  The scores in float32 for 16-bit inputs, else in the inputs' dtype."""
    cdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scale = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    scores = torch.matmul(q.to(cdt), k.to(cdt).transpose(-1, -2)) * scale
    scores = soft_cap(scores, cap)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(v.dtype), v)
