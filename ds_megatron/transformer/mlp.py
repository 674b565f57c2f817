"""The transformer MLP split as in the paper (Fig. 3a): column-parallel h -> ffn, activation, row-parallel ffn -> h.

The activation is applied to each rank's own slice of the first GEMM's output,
so no communication is needed between the two GEMMs; the row-parallel GEMM
ends in one all-reduce (or a reduce-scatter under sequence parallelism).

Gated linear units (``gated_linear_unit``, SwiGLU with ``activation "silu"``):
the first GEMM produces ``[gate; up]`` and the activation is
``act(gate) * up``.  As in Megatron, each TP rank's shard of that weight is
``[its gate rows; its up rows]``, so the pair stays on one rank; the full
``[gate; up]`` master is drawn once and laid out per rank before the split.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ..parallel_state import ParallelGroup
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear



def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)`` (Megatron's quick_gelu; gpt-oss's gate activation with its swiglu_alpha 1.702)."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
               "quick_gelu": quick_gelu}


def gated_rows_per_rank(master: torch.Tensor, parts: int) -> torch.Tensor:
    """``[gate; up]`` (dim 0) reordered as ``[gate_0; up_0; gate_1; up_1; ...]`` so a contiguous split in
    ``parts`` gives each part its own gate and up rows."""
    gate, up = master.chunk(2, dim=0)
    return torch.cat([torch.cat(pair) for pair in zip(gate.chunk(parts), up.chunk(parts))])


def activation_func(activation: str, gated: bool, clamp: Optional[float] = None, offset: float = 0.0):
    """The MLP's activation on the first GEMM's output (``[gate; up]`` halves along the last dim when gated);
    ``clamp`` (gpt-oss): gate clamped above and up on both sides at it first; ``offset`` added to up."""
    act = ACTIVATIONS[activation]
    if not gated:
        return act

    def glu(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        if clamp is not None:
            gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
        return act(gate) * (up + offset if offset else up)
    return glu


class ParallelMLP(torch.nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, tp: ParallelGroup, init_method, output_init_method,
                 sequence_parallel: bool = False, gated_linear_unit: bool = False, activation: str = "gelu",
                 bias: bool = True, clamp: Optional[float] = None, offset: float = 0.0):
        super().__init__()
        fc1_init: Optional[object] = init_method
        if gated_linear_unit:
            def fc1_init(master):
                init_method(master)
                with torch.no_grad():
                    master.copy_(gated_rows_per_rank(master, tp.size))
        self.dense_h_to_4h = ColumnParallelLinear(hidden_size, ffn_hidden_size * (2 if gated_linear_unit else 1), tp=tp,
                                                  bias=bias, gather_output=False, init_method=fc1_init,
                                                  sequence_parallel=sequence_parallel)
        self.dense_4h_to_h = RowParallelLinear(ffn_hidden_size, hidden_size, tp=tp, bias=bias,
                                               input_is_parallel=True, init_method=output_init_method,
                                               sequence_parallel=sequence_parallel)
        self.activation_func = activation_func(activation, gated_linear_unit, clamp, offset)

    def forward(self, hidden: torch.Tensor, packed_seq_params=None) -> torch.Tensor:
        """``packed_seq_params``: taken as every MLP of a layer takes it; a dense MLP acts per token."""
        intermediate, _ = self.dense_h_to_4h(hidden)
        out, _ = self.dense_4h_to_h(self.activation_func(intermediate))
        return out


def build_mlp(config, hidden_size: int, ffn_hidden_size: int, *, tp: ParallelGroup, init_method, output_init_method,
              sequence_parallel: bool) -> ParallelMLP:
    """A dense MLP with the model's activation, gating and biases."""
    return ParallelMLP(hidden_size, ffn_hidden_size, tp=tp, init_method=init_method,
                       output_init_method=output_init_method, sequence_parallel=sequence_parallel,
                       gated_linear_unit=config.gated_linear_unit, activation=config.activation,
                       bias=config.add_bias_linear, clamp=config.activation_func_clamp_value,
                       offset=config.glu_linear_offset)
