"""The transformer MLP split as in the paper (Fig. 3a): column-parallel h -> ffn, GELU, row-parallel ffn -> h.

GELU is applied to each rank's own slice of the first GEMM's output, so no
communication is needed between the two GEMMs; the row-parallel GEMM ends in
one all-reduce (or a reduce-scatter under sequence parallelism).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..parallel_state import ParallelGroup
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear


class ParallelMLP(torch.nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, tp: ParallelGroup, init_method, output_init_method,
                 sequence_parallel: bool = False):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(hidden_size, ffn_hidden_size, tp=tp,
                                                  gather_output=False, init_method=init_method,
                                                  sequence_parallel=sequence_parallel)
        self.dense_4h_to_h = RowParallelLinear(ffn_hidden_size, hidden_size, tp=tp,
                                               input_is_parallel=True, init_method=output_init_method,
                                               sequence_parallel=sequence_parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        intermediate, _ = self.dense_h_to_4h(hidden)
        out, _ = self.dense_4h_to_h(F.gelu(intermediate))
        return out
