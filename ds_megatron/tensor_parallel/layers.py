"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, VocabParallelEmbedding.

``Y = X A + b`` with ``A`` stored torch-style as ``weight [out, in]``:

* ColumnParallelLinear splits the output features: ``weight [out/tp, in]``,
  bias split too.  Its input enters through the paper's *f* (identity forward,
  all-reduce of the input gradient backward); with sequence parallelism the
  input is ``[s/tp, b, h]`` and is all-gathered along the sequence instead
  (its gradient reduce-scattered).
* RowParallelLinear splits the input features: ``weight [out, in/tp]``.  Its
  partial products leave through the paper's *g* (all-reduce forward); with
  sequence parallelism they are reduce-scattered along the sequence instead.
  Its bias is full-size and replicated and is added once, after that
  reduction.

* ReplicatedLinear is held whole by every TP rank (Megatron's "duplicated" Transformer Engine linear, MLA's
  down-projections); its caller decides what its gradients are partial over.

Column followed by Row (MLP, attention) needs no communication in between.
Both ``forward`` return ``(output, output_bias)``: ``output_bias`` is the bias
when ``skip_bias_add`` (the caller fuses the add, e.g. bias-GeLU or
bias-dropout-add), else None.

``attach_fp8`` gives the linears (replicated ones too, as Transformer Engine runs a duplicated linear in fp8) an fp8
scaling state (``ds_megatron.fp8``): their three GEMMs then run in fp8, the input quantized after the
sequence-parallel gather; ``fp8_states`` collects every state of a model, the
experts' included.

Weights are initialized independently of the TP size (see ``init.py``); biases
start at zero.  The TP group is always passed in (``tp``, a ``ParallelGroup``;
``ParallelGroup.single("tp")`` means no tensor parallelism).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..fp8 import FP8LinearState, FP8Recipe
from ..parallel_state import ParallelGroup

from .init import InitMethod, init_method_normal, initialize_affine_weight_cpu
from .mappings import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_tensor_model_parallel_region)
from .params import set_tensor_model_parallel_attributes
from .utils import divide, vocab_range_from_global_vocab_size
from .weight_grad_store import WeightGradStore, linear

# Megatron's default init_method_std.
DEFAULT_INIT_STD = 0.02


def _default_init(init_method: Optional[InitMethod]) -> InitMethod:
    return init_method if init_method is not None else init_method_normal(DEFAULT_INIT_STD)


class ColumnParallelLinear(torch.nn.Module):
    """Linear layer with the output features split over the TP group.

    ``gather_output=True`` all-gathers the output so every rank gets all
    ``output_size`` features; otherwise each rank returns its
    ``output_size / tp`` slice (the usual case, feeding a RowParallelLinear).
    With ``sequence_parallel`` the input is this rank's ``[s/tp, b, in]``
    slice of the sequence.
    """

    def __init__(self, input_size: int, output_size: int, *, tp: ParallelGroup,
                 bias: bool = True, gather_output: bool = False, init_method: Optional[InitMethod] = None,
                 skip_bias_add: bool = False, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None):
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with "
                             "sequence_parallel=True; gather the output yourself or turn one of them off")
        self.input_size = input_size
        self.output_size = output_size
        self.tp = tp
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.weight_grad_store: Optional[WeightGradStore] = None  # the zero-bubble schedule's deferred W
        world, rank = tp.size, tp.rank
        self.output_size_per_partition = divide(output_size, world, what="ColumnParallelLinear output_size")
        self.fp8: Optional[FP8LinearState] = None  # set by attach_fp8: the three GEMMs in fp8

        self.weight = torch.nn.Parameter(torch.empty(self.output_size_per_partition, input_size,
                                                     dtype=params_dtype, device=device))
        initialize_affine_weight_cpu(self.weight, (output_size, input_size), 0, rank, world,
                                     _default_init(init_method))
        set_tensor_model_parallel_attributes(self.weight, True, 0)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype,
                                                       device=device))
            set_tensor_model_parallel_attributes(self.bias, True, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp, tensor_parallel_output_grad=True)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp)
        bias = None if self.skip_bias_add else self.bias
        output = linear(x, self.weight, bias, self.weight_grad_store, self.fp8)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp)
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, "
                f"output_size_per_partition={self.output_size_per_partition}, bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(torch.nn.Module):
    """Linear layer with the input features split over the TP group.

    ``input_is_parallel=True`` takes this rank's ``in / tp`` slice of the
    input (the output of a ColumnParallelLinear); otherwise the full input is
    split here.  The output is the full ``output_size`` on every rank, or,
    with ``sequence_parallel``, this rank's ``[s/tp, b, out]`` slice.
    """

    def __init__(self, input_size: int, output_size: int, *, tp: ParallelGroup,
                 bias: bool = True, input_is_parallel: bool = False, init_method: Optional[InitMethod] = None,
                 skip_bias_add: bool = False, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires input_is_parallel=True "
                             "(its input must come from a ColumnParallelLinear)")
        self.input_size = input_size
        self.output_size = output_size
        self.tp = tp
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.weight_grad_store: Optional[WeightGradStore] = None  # the zero-bubble schedule's deferred W
        world, rank = tp.size, tp.rank
        self.input_size_per_partition = divide(input_size, world, what="RowParallelLinear input_size")
        self.fp8: Optional[FP8LinearState] = None  # set by attach_fp8: the three GEMMs in fp8

        self.weight = torch.nn.Parameter(torch.empty(output_size, self.input_size_per_partition,
                                                     dtype=params_dtype, device=device))
        initialize_affine_weight_cpu(self.weight, (output_size, input_size), 1, rank, world,
                                     _default_init(init_method))
        set_tensor_model_parallel_attributes(self.weight, True, 1)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, False, -1)
            # Added after the reduce-scatter, the bias sees only this rank's tokens:
            # its gradient is partial and is summed over TP (allreduce_tp_partial_grads).
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp)
        partial = linear(x, self.weight, None, self.weight_grad_store, self.fp8)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, self.tp)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, self.tp)
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, "
                f"input_size_per_partition={self.input_size_per_partition}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


def attach_weight_grad_store(module: torch.nn.Module, store: Optional[WeightGradStore]) -> int:
    """Give every module in ``module`` that declares a ``weight_grad_store`` (the column- and row-parallel
    linears, the experts, a model's tied output layer) the store (None detaches); returns how many took it."""
    count = 0
    for m in module.modules():
        if hasattr(m, "weight_grad_store"):
            m.weight_grad_store = store
            count += 1
    return count


class ReplicatedLinear(torch.nn.Module):
    """A linear layer every rank of ``tp`` holds whole (``weight [out, in]``, drawn full from the default RNG).
    With an fp8 state its three GEMMs run in fp8; its amaxes are agreed over the state's group like the split
    linears' (its input and weight are the same on every TP rank; an output gradient that is a partial sum over TP
    is quantized per rank with the scale of the largest)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, init_method: InitMethod, *, tp: ParallelGroup):
        super().__init__()
        self.tp = tp
        weight = torch.empty(output_size, input_size)  # float32, as the TP layers draw their masters
        init_method(weight)
        self.weight = torch.nn.Parameter(weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size)) if bias else None
        for p in self.parameters():
            set_tensor_model_parallel_attributes(p, False, -1)
        self.fp8: Optional[FP8LinearState] = None  # set by attach_fp8: the three GEMMs in fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, None, self.fp8)


def attach_fp8(module: torch.nn.Module, recipe: Optional[FP8Recipe],
               amax_group: Optional[ParallelGroup] = None) -> int:
    """Give every column-, row-parallel and replicated linear in ``module`` its own fp8 scaling state from
    ``recipe`` (None: back to 16-bit GEMMs), and ``recipe`` to every module that declares ``set_fp8`` (the MoE
    experts, which make their own states); returns how many modules took it.  ``amax_group``: the ranks the
    linears' tensors are split over, whose amaxes they agree on (a model's TP x CP group: CP splits the sequence);
    None: each linear's TP group.  Quantization happens after the sequence-parallel gather, so the gathered input's
    amax is the same on every TP rank."""
    count = 0
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
            out_features, in_features = m.weight.shape
            m.fp8 = None if recipe is None else FP8LinearState(recipe, amax_group or m.tp, in_features,
                                                               out_features, device=m.weight.device)
            count += 1
        elif hasattr(m, "set_fp8"):
            m.set_fp8(recipe)
            count += 1
    return count


def fp8_states(module: torch.nn.Module) -> List[FP8LinearState]:
    """Every fp8 scaling state in ``module``, in module order: each column- and row-parallel linear's and each
    expert weight's (a module's ``fp8``: one state, or a tuple of them, as ``GroupedMLP`` holds).  Every rank of a
    stage gets its states in the same order (``fp8.update_delayed_scaling`` takes them)."""
    states: List[FP8LinearState] = []
    for m in module.modules():
        held = getattr(m, "fp8", None)
        states += [held] if isinstance(held, FP8LinearState) else list(held) if isinstance(held, tuple) else []
    return states


def fp8_weights(module: torch.nn.Module) -> List[Tuple[torch.nn.Parameter, FP8Recipe]]:
    """(weight, recipe) of ``module``'s fp8 column- and row-parallel linears in module order, and of the modules
    that declare ``fp8_weights`` (the MoE experts): what ``fp8_param_gather`` keeps as fp8.  A replicated linear's
    weight stays 16-bit (quantized at each use), as Megatron gathers only the split ones in fp8."""
    out: List[Tuple[torch.nn.Parameter, FP8Recipe]] = []
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.fp8 is not None:
            out.append((m.weight, m.fp8.recipe))
        elif hasattr(m, "fp8_weights"):
            out.extend(m.fp8_weights())
    return out


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by vocab rows: rank r owns ids ``[start_r, end_r)``.

    Each rank looks up the ids it owns (others give zero rows) and the partial
    results are summed over the TP group (the paper's *g*).  Output layout:

    * default: ``input_ids.shape + (embedding_dim,)``, full on every rank;
    * ``reduce_scatter_embeddings=True`` (sequence parallelism, Megatron's
      semantics): ``input_ids`` is ``[batch, seq]``; the output is transposed
      to ``[seq, batch, h]`` and reduce-scattered along seq, so each rank gets
      its ``[seq/tp, batch, h]`` slice, with no separate scatter needed.

    ``num_embeddings`` must be divisible by the TP size: pad it with
    ``pad_vocab_size`` first.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: ParallelGroup,
                 init_method: Optional[InitMethod] = None, params_dtype: torch.dtype = torch.float32,
                 reduce_scatter_embeddings: bool = False, device: Optional[torch.device] = None):
        super().__init__()
        world, rank = tp.size, tp.rank
        if num_embeddings % world != 0:
            raise ValueError(f"VocabParallelEmbedding: num_embeddings={num_embeddings} is not divisible by the "
                             f"tensor-parallel size {world}; pad it with pad_vocab_size(..., "
                             f"tensor_model_parallel_size={world})")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp = tp
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.vocab_start_index, self.vocab_end_index = vocab_range_from_global_vocab_size(num_embeddings, rank, world)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index

        self.weight = torch.nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                                     dtype=params_dtype, device=device))
        initialize_affine_weight_cpu(self.weight, (num_embeddings, embedding_dim), 0, rank, world,
                                     _default_init(init_method))
        set_tensor_model_parallel_attributes(self.weight, True, 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1:
            outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
            local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
            partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            partial = F.embedding(input_ids, self.weight)
        if self.reduce_scatter_embeddings:
            if input_ids.dim() != 2:
                raise ValueError(f"VocabParallelEmbedding with reduce_scatter_embeddings expects input_ids of "
                                 f"shape [batch, seq], got {tuple(input_ids.shape)}")
            partial = partial.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp)
        return reduce_from_tensor_model_parallel_region(partial, self.tp)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"vocab_range=[{self.vocab_start_index}, {self.vocab_end_index})")
