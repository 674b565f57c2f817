"""The local experts of one MoE layer: ``SequentialMLP`` (one MLP per expert) and ``GroupedMLP``.

Each expert is ``fc2(act(fc1(x)) * prob)`` (the routing weight is applied before the
second GEMM, so un-permuting is a plain sum); with ``bias`` (gpt-oss) fc1 adds its bias and
fc2 adds ``prob x`` its bias, so the weighted sum is transformers' ``prob x (fc2(...) + b)``
(biases start at zero); under ETP fc1's bias is split with its rows and fc2's bias ``[h]`` over the hidden
columns, each rank adding its ``h / ETP`` columns, so that the dispatcher's ETP reduction adds every column's bias
once and each rank's piece is a distinct shard (gradient, norm, optimizer) like the weights; with
``gated_linear_unit`` fc1 gives ``[gate; up]`` and ``act`` is ``act(gate) * up``
(SwiGLU for Mixtral and Qwen-MoE), each ETP rank holding its gate and up rows.  Weights
are split over the expert-tensor-parallel (ETP) group like a column-parallel
fc1 and a row-parallel fc2; the dispatcher's ETP all-gather / reduce-scatter
does the communication, so the experts themselves never communicate.

Initialization does not depend on EP or ETP: every rank draws the full
master weights of ALL experts in a fixed order (expert 0 fc1, expert 0 fc2,
expert 1 fc1, ...) from the default RNG and keeps its local experts' ETP
slices.  Both implementations draw identically, so they hold the same model.

``GroupedMLP`` runs all local experts as one grouped GEMM per projection
(``torch._grouped_mm`` for fp32/bf16/fp16; a padded batched GEMM otherwise,
e.g. float64); ``SequentialMLP`` loops over experts.  ``launch/bench/bench_moe.py``
compares them; ``moe_grouped_gemm`` null (the default) picks the faster one for
the device: grouped with CUDA, sequential on CPU (see ``experts_class``).

With an fp8 recipe (``set_fp8``, which the model's ``attach_fp8`` calls) each expert's fc1 and fc2 have their
own scaling state (kind "expert": the delayed recipe agrees on it over ETP and expert-DP) and run their three GEMMs
in fp8 (``fp8.grouped``), in both implementations, their biases added in the activations' 16-bit dtype after
the GEMMs (as Transformer Engine adds a bias to the GEMM's output; ``fp8_param_gather`` keeps them 16-bit); with a
``WeightGradStore`` (ZB-H1) their weight-gradient GEMMs are deferred on the fp8 copies of X and dY, as the 16-bit
experts' are through ``deferrable``.

Expert params carry the expert marks (``tensor_parallel.params.mark_expert_param``):
their gradients are reduced over the expert-data-parallel group, not the
data-parallel one.
"""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..fp8 import FP8LinearState, FP8Recipe
from ..fp8.grouped import fp8_grouped_linear
from ..fp8.param import is_fp8_param
from ..parallel_state import ParallelGroup
from ..tensor_parallel.init import InitMethod, init_method_normal
from ..tensor_parallel.params import mark_expert_param
from ..tensor_parallel.utils import divide
from ..tensor_parallel.weight_grad_store import WeightGradStore, deferrable, linear, weight_grad_or_defer
from ..transformer.mlp import activation_func

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def draw_expert_master_weights(num_experts: int, hidden_size: int, ffn_hidden_size: int,
                               init_method: InitMethod, output_init_method: InitMethod, gated: bool = False):
    """Full (fc1 [ffn (x2 gated: [gate; up]), h], fc2 [h, ffn]) float32 masters of every expert, in the fixed order."""
    for _ in range(num_experts):
        fc1 = torch.empty(ffn_hidden_size * (2 if gated else 1), hidden_size)
        init_method(fc1)
        fc2 = torch.empty(hidden_size, ffn_hidden_size)
        output_init_method(fc2)
        yield fc1, fc2


class _ContiguousGrad(torch.autograd.Function):
    # torch._grouped_mm's backward refuses expanded (stride-0) gradients such as those of .sum().
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_gemm(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: Sequence[int],
                 use_grouped_mm: Optional[bool] = None, counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [N, k]`` in expert-contiguous groups times ``weights [L, k, n]`` (group g uses ``weights[g]``).

    ``tokens_per_expert``: the group sizes as host integers; ``counts``: the same
    sizes as a tensor on ``x``'s device when the caller has one (the dispatcher
    does), so that no host-to-device copy (a stream sync on a GPU) is needed.
    ``use_grouped_mm``: None picks ``torch._grouped_mm`` on CUDA only; on CPU its kernel
    was erratic under load here (0.85x down to 0.03x of SequentialMLP, launch/bench/bench_moe.py)
    and the padded ``bmm`` steadier."""
    if x.size(0) == 0:
        return x @ weights[0]
    if use_grouped_mm is None:
        use_grouped_mm = x.is_cuda
    if counts is None:
        counts = torch.tensor(list(tokens_per_expert), device=x.device)
    if use_grouped_mm and x.dtype in _GROUPED_MM_DTYPES and hasattr(torch, "_grouped_mm"):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, weights.to(x.dtype), offs=offs))
    # One padded batched GEMM: [L, C, k] @ [L, k, n], C the largest group.
    num_groups = len(tokens_per_expert)
    expert_of_row = torch.repeat_interleave(torch.arange(num_groups, device=x.device), counts,
                                            output_size=x.size(0))
    starts = torch.cumsum(counts, 0) - counts
    row_in_group = torch.arange(x.size(0), device=x.device) - starts[expert_of_row]
    padded = x.new_zeros(num_groups, max(tokens_per_expert), x.size(1))
    padded = padded.index_put((expert_of_row, row_in_group), x)
    return torch.bmm(padded, weights.to(x.dtype))[expert_of_row, row_in_group]


def experts_class(grouped: Optional[bool]):
    """``moe_grouped_gemm``: True GroupedMLP, False SequentialMLP, None the faster one for the device
    (GroupedMLP with CUDA; SequentialMLP on CPU, where it measured ~1.4x the padded grouped GEMM
    and ~1.2x torch._grouped_mm, one thread, launch/bench/bench_moe.py)."""
    if grouped is None:
        grouped = torch.cuda.is_available()
    return GroupedMLP if grouped else SequentialMLP


def _cumsum(values: Sequence[int]):
    total = 0
    for v in values:
        total += v
        yield total


class _ExpertsBase(torch.nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, *, ep: ParallelGroup,
                 etp: ParallelGroup, init_method: Optional[InitMethod] = None,
                 output_init_method: Optional[InitMethod] = None, params_dtype: torch.dtype = torch.float32,
                 gated_linear_unit: bool = False, activation: str = "gelu", bias: bool = False,
                 clamp: Optional[float] = None, offset: float = 0.0):
        super().__init__()
        self.activation_func = activation_func(activation, gated_linear_unit, clamp, offset)
        self.has_bias = bias
        ep_size, ep_rank, etp_size, etp_rank = ep.size, ep.rank, etp.size, etp.rank
        self.num_experts = num_experts
        self.num_local_experts = divide(num_experts, ep_size, what="num_experts")
        self.local_expert_indices = list(range(ep_rank * self.num_local_experts,
                                               (ep_rank + 1) * self.num_local_experts))
        self.ffn_per_partition = divide(ffn_hidden_size, etp_size, what="moe_ffn_hidden_size")
        # fc2's bias columns this ETP rank adds (all of them at ETP 1)
        h_part = divide(hidden_size, etp_size, what="hidden_size") if bias else hidden_size
        self.hidden_size, self.bias2_cols = hidden_size, slice(etp_rank * h_part, (etp_rank + 1) * h_part)
        self.ep_size, self.etp, self.etp_rank = ep_size, etp, etp_rank
        self.params_dtype = params_dtype
        init_method = init_method or init_method_normal(0.02)
        output_init_method = output_init_method or init_method
        f = self.ffn_per_partition
        cols = slice(etp_rank * f, (etp_rank + 1) * f)
        self._local_masters = []  # (fc1 slice [f, h], fc2 slice [h, f]) of each local expert
        for e, (fc1, fc2) in enumerate(draw_expert_master_weights(num_experts, hidden_size, ffn_hidden_size,
                                                                  init_method, output_init_method, gated_linear_unit)):
            if e in self.local_expert_indices:
                fc1 = torch.cat([half[cols] for half in fc1.chunk(2)]) if gated_linear_unit else fc1[cols]
                self._local_masters.append((fc1.clone(), fc2[:, cols].clone()))

    def _activation(self, intermediate: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return self.activation_func(intermediate) * probs.unsqueeze(-1).to(intermediate.dtype)

    def _fc2_bias(self, out: torch.Tensor, bias_rows: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``out`` plus ``probs x`` fc2's bias rows ``[N, h / ETP]`` in this rank's columns (see the module doc)."""
        term = probs.unsqueeze(-1).to(out.dtype) * bias_rows
        if term.size(-1) != out.size(-1):
            term = torch.nn.functional.pad(term, (self.bias2_cols.start, self.hidden_size - self.bias2_cols.stop))
        return out + term

    def _new_bias(self, *shape: int) -> torch.nn.Parameter:
        bias = torch.nn.Parameter(torch.zeros(*shape, dtype=self.params_dtype))
        mark_expert_param(bias, self.ep_size, 0)
        return bias

    def _fp8_states(self, recipe: FP8Recipe, fc1: torch.Tensor, fc2: torch.Tensor) -> Tuple[FP8LinearState, ...]:
        """fc1's and fc2's states of one expert (weights ``[out, in]``), their amaxes agreed over ETP."""
        return tuple(FP8LinearState(recipe, self.etp, w.size(1), w.size(0), device=w.device, kind="expert")
                     for w in (fc1, fc2))


def _fp8_weight_grad(store: Optional[WeightGradStore], param: torch.nn.Parameter,
                     to_param: Callable[[torch.Tensor], torch.Tensor]):
    """``fp8_grouped_linear``'s ``weight_grad`` for ``param`` given to it as a view (``to_param`` takes the view's
    gradient back): deferred into ``store`` while it defers (None: no store, computed at once).  An fp8 param's
    (``fp8_param_gather``) goes into its ``main_grad`` (deferred: through the store's ``accumulate``, which does)."""
    if not is_fp8_param(param):
        return None if store is None else functools.partial(weight_grad_or_defer, store, param, to_param=to_param)

    def into_main_grad(compute: Callable[[], torch.Tensor]) -> None:
        grad = weight_grad_or_defer(store, param, compute, to_param)
        if grad is not None:
            param.main_grad.add_(to_param(grad))
            param.grad_added_to_main_grad = True  # the buffer's hook then marks it ready
    return into_main_grad


def _scale_inv(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """An fp8 param's scales, one per expert it holds (``fp8_grouped_linear``'s ``scale_inv``); None if 16-bit."""
    return param.fp8_scale_inv.reshape(-1) if is_fp8_param(param) else None


class _ExpertLinear(torch.nn.Module):
    """A linear holding a given weight (``torch.nn.Linear`` would draw its own init from the RNG); its ``bias``
    (None, or set by the experts) is added by the experts, fc2's scaled by the routing weight."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.bias: Optional[torch.nn.Parameter] = None
        self.weight_grad_store: Optional[WeightGradStore] = None  # the zero-bubble schedule's deferred W
        self.fp8: Optional[FP8LinearState] = None  # set by the experts' set_fp8: the three GEMMs in fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8_grouped_linear(x, self.weight.unsqueeze(0), [x.size(0)], [self.fp8],
                                      _fp8_weight_grad(self.weight_grad_store, self.weight, lambda g: g.squeeze(0)),
                                      _scale_inv(self.weight))
        return linear(x, self.weight, None, self.weight_grad_store)


class SequentialMLP(_ExpertsBase):
    """Local experts as separate MLPs, run one after another."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.local_experts = torch.nn.ModuleList()
        for fc1, fc2 in self._local_masters:
            expert = torch.nn.Module()
            expert.linear_fc1 = _ExpertLinear(fc1.to(self.params_dtype))
            expert.linear_fc2 = _ExpertLinear(fc2.to(self.params_dtype))
            mark_expert_param(expert.linear_fc1.weight, self.ep_size, 0)
            mark_expert_param(expert.linear_fc2.weight, self.ep_size, 1)
            if self.has_bias:
                expert.linear_fc1.bias = self._new_bias(fc1.size(0))
                expert.linear_fc2.bias = self._new_bias(self.bias2_cols.stop - self.bias2_cols.start)
            self.local_experts.append(expert)
        del self._local_masters

    def set_fp8(self, recipe: Optional[FP8Recipe]) -> None:
        """Each expert's fc1 and fc2 their own fp8 scaling state (None: 16-bit GEMMs)."""
        for e in self.local_experts:
            fc1, fc2 = (None, None) if recipe is None else self._fp8_states(recipe, e.linear_fc1.weight,
                                                                             e.linear_fc2.weight)
            e.linear_fc1.fp8, e.linear_fc2.fp8 = fc1, fc2

    def forward(self, x: torch.Tensor, tokens_per_expert: List[int], probs: torch.Tensor,
                counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        outputs = []
        for expert, tokens, p in zip(self.local_experts, torch.split(x, list(tokens_per_expert)),
                                     torch.split(probs, list(tokens_per_expert))):
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            intermediate = fc1(tokens) if fc1.bias is None else fc1(tokens) + fc1.bias
            out = fc2(self._activation(intermediate, p))
            outputs.append(out if fc2.bias is None else self._fc2_bias(out, fc2.bias.expand(out.size(0), -1), p))
        return torch.cat(outputs, dim=0) if outputs else x.new_zeros(0, x.size(-1))

    def expert_weights(self, local_index: int):
        e = self.local_experts[local_index]
        out = {"linear_fc1.weight": e.linear_fc1.weight, "linear_fc2.weight": e.linear_fc2.weight}
        if self.has_bias:
            out.update({"linear_fc1.bias": e.linear_fc1.bias, "linear_fc2.bias": e.linear_fc2.bias})
        return out

    def fp8_weights(self) -> List[Tuple[torch.nn.Parameter, FP8Recipe]]:
        """(weight, recipe) of every fp8 projection: what ``fp8_param_gather`` keeps as fp8 bytes."""
        return [(linear.weight, linear.fp8.recipe) for e in self.local_experts
                for linear in (e.linear_fc1, e.linear_fc2) if linear.fp8 is not None]

    def expert_fp8_states(self, local_index: int):
        """Local expert ``local_index``'s fp8 states by projection (``expert_weights``' names less ``.weight``)."""
        e = self.local_experts[local_index]
        return {} if e.linear_fc1.fp8 is None else {"linear_fc1": e.linear_fc1.fp8, "linear_fc2": e.linear_fc2.fp8}


class GroupedMLP(_ExpertsBase):
    """Local experts as stacked weights, each projection one grouped GEMM over all of them.

    ``weight1 [L, h, ffn/etp]``, ``weight2 [L, ffn/etp, h]`` (the ``x @ W`` layout a
    grouped GEMM takes); ``weight1[l]`` is expert l's fc1 weight transposed.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight1 = torch.nn.Parameter(torch.stack([fc1.t() for fc1, _ in self._local_masters]).to(self.params_dtype))
        self.weight2 = torch.nn.Parameter(torch.stack([fc2.t() for _, fc2 in self._local_masters]).to(self.params_dtype))
        mark_expert_param(self.weight1, self.ep_size, 2)
        mark_expert_param(self.weight2, self.ep_size, 1)
        # [L, fc1 rows] and [L, h / ETP]: each local expert's biases (with ``bias``)
        self.bias1 = self._new_bias(self.weight1.size(0), self.weight1.size(2)) if self.has_bias else None
        self.bias2 = (self._new_bias(self.weight2.size(0), self.bias2_cols.stop - self.bias2_cols.start)
                      if self.has_bias else None)
        del self._local_masters
        self.weight_grad_store: Optional[WeightGradStore] = None  # the zero-bubble schedule's deferred W
        # set_fp8: every expert's fc1 state, then every expert's fc2 state
        self.fp8: Optional[Tuple[FP8LinearState, ...]] = None

    def set_fp8(self, recipe: Optional[FP8Recipe]) -> None:
        """Each expert's fc1 and fc2 their own fp8 scaling state (None: 16-bit GEMMs)."""
        if recipe is None:
            self.fp8 = None
            return
        pairs = [self._fp8_states(recipe, w1.t(), w2.t()) for w1, w2 in zip(self.weight1, self.weight2)]
        self.fp8 = tuple(p[0] for p in pairs) + tuple(p[1] for p in pairs)

    # None: torch._grouped_mm on CUDA, padded bmm elsewhere (see grouped_gemm); benchmarks force either.
    use_grouped_mm: Optional[bool] = None

    def forward(self, x: torch.Tensor, tokens_per_expert: List[int], probs: torch.Tensor,
                counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``counts``: ``tokens_per_expert`` as a device tensor, when the dispatcher has it (no host copy)."""
        store = self.weight_grad_store
        if self.fp8 is not None:
            L = self.num_local_experts

            def transposed(g: torch.Tensor) -> torch.Tensor:
                return g.transpose(1, 2)

            def fc(inputs: torch.Tensor, weight: torch.nn.Parameter, states) -> torch.Tensor:
                # [L, in, out] -> [L, out, in], the layout the fp8 GEMMs take (a view; its gradient transposed back)
                return fp8_grouped_linear(inputs, weight.transpose(1, 2), tokens_per_expert, states,
                                          _fp8_weight_grad(store, weight, transposed), _scale_inv(weight))
            fc1 = functools.partial(fc, weight=self.weight1, states=self.fp8[:L])
            fc2 = functools.partial(fc, weight=self.weight2, states=self.fp8[L:])
        else:
            def gemm(inputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
                return grouped_gemm(inputs, weights, tokens_per_expert, self.use_grouped_mm, counts)
            fc1, fc2 = (functools.partial(deferrable, gemm, weight=w, store=store)
                        for w in (self.weight1, self.weight2))
        intermediate = fc1(x)
        if self.bias1 is None:
            return fc2(self._activation(intermediate, probs))
        # the biases in the activations' dtype after the GEMMs (fp8 too: TE adds them to the GEMM's 16-bit output)
        if counts is None:
            counts = torch.tensor(list(tokens_per_expert), device=x.device)
        expert_of_row = torch.repeat_interleave(torch.arange(len(tokens_per_expert), device=x.device), counts,
                                                output_size=x.size(0))
        out = fc2(self._activation(intermediate + self.bias1[expert_of_row], probs))
        return self._fc2_bias(out, self.bias2[expert_of_row], probs)

    def expert_weights(self, local_index: int):
        """Views of local expert ``local_index``'s weights in ``SequentialMLP``'s layout and names."""
        out = {"linear_fc1.weight": self.weight1[local_index].t(), "linear_fc2.weight": self.weight2[local_index].t()}
        if self.has_bias:
            out.update({"linear_fc1.bias": self.bias1[local_index], "linear_fc2.bias": self.bias2[local_index]})
        return out

    def fp8_weights(self) -> List[Tuple[torch.nn.Parameter, FP8Recipe]]:
        """(weight, recipe) of both stacked projections when fp8 (``fp8_param_gather`` keeps them as fp8 bytes,
        one scale per expert)."""
        return [] if self.fp8 is None else [(self.weight1, self.fp8[0].recipe), (self.weight2, self.fp8[0].recipe)]

    def expert_fp8_states(self, local_index: int):
        """Local expert ``local_index``'s fp8 states by projection (``expert_weights``' names less ``.weight``)."""
        if self.fp8 is None:
            return {}
        return {"linear_fc1": self.fp8[local_index], "linear_fc2": self.fp8[self.num_local_experts + local_index]}
