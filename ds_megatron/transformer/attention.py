"""Causal self-attention with heads split across TP ranks (paper, Fig. 3b).

The fused QKV projection is column-parallel, so each rank owns
``num_heads / tp`` whole heads and computes their attention locally; the
output projection is row-parallel.  Attention-probability dropout happens
inside the TP region, so it runs under the model-parallel RNG tracker: each
TP rank drops different entries of its own heads.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..parallel_state import ParallelGroup
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.utils import divide


class ParallelAttention(torch.nn.Module):
    def __init__(self, hidden_size: int, num_attention_heads: int, *, tp: ParallelGroup, init_method,
                 output_init_method, attention_dropout: float = 0.0, sequence_parallel: bool = False,
                 rng_tracker=None):
        super().__init__()
        self.num_heads_per_partition = divide(num_attention_heads, tp.size)
        self.head_dim = divide(hidden_size, num_attention_heads)
        self.attention_dropout = attention_dropout
        self.rng_tracker = rng_tracker
        # Output features are ordered [q | k | v] within each head, head-major, so a
        # contiguous column split hands every rank complete heads.
        self.query_key_value = ColumnParallelLinear(hidden_size, 3 * hidden_size, tp=tp,
                                                    gather_output=False, init_method=init_method,
                                                    sequence_parallel=sequence_parallel)
        self.dense = RowParallelLinear(hidden_size, hidden_size, tp=tp, input_is_parallel=True,
                                       init_method=output_init_method, sequence_parallel=sequence_parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [s, b, h] (the full sequence: sequence-parallel input was gathered by the QKV layer)
        qkv, _ = self.query_key_value(hidden)
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, self.num_heads_per_partition, 3, self.head_dim)
        # -> [b, heads, s, d] for SDPA
        q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))
        dropout = self.attention_dropout if self.training else 0.0
        fork = self.rng_tracker.fork() if (dropout > 0 and self.rng_tracker is not None) else contextlib.nullcontext()
        with fork:
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.num_heads_per_partition * self.head_dim)
        out, _ = self.dense(ctx)
        return out
