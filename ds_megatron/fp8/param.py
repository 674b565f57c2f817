"""FP8 parameters (Megatron's ``fp8_param_gather``): an fp8 layer's weight kept as E4M3 bytes with its scale, and
the cast of the fp32 main params into them after each optimizer step.

``make_fp8_param`` points a weight at its bytes (a view of the distributed optimizer's uint8 param buffer, as
``float8_e4m3fn``) and keeps its 16-bit value until the optimizer has taken its main params from it.  The forward's
fp8 GEMM then reads the bytes and ``param.fp8_scale_inv`` as they are (``linear``: no quantization of W); its
weight gradient goes straight into ``param.main_grad`` (an fp8 ``.grad`` would round it away).

``FP8ParamCast`` is the tensorwise recipe done on shards: each rank holds only some elements of a weight (a
DP shard of a bucket cuts params anywhere), and a TP rank only its split of it, but the scale must be the whole
weight's.  So every rank computes the amax of what it owns of each fp8 weight of its buffers (0 where it owns
nothing), agrees on them with one all-reduce (MAX) over the DP group and one over TP, and casts its pieces with
the agreed scale.  The experts' weights are cast the same way over expert-DP and ETP (never EP: its ranks hold
other experts), a grouped experts' weight with one scale per expert, as their GEMMs take it (``grouped``).
Each main shard is first rounded to the params' 16-bit dtype, as Megatron does: the bytes are then exactly those
the layer makes from its 16-bit weight without ``fp8_param_gather`` (the max of a rounded tensor is the rounded
max, and the cast is elementwise): both runs do the same arithmetic, but for the gradient norm, summed over DP
shards that the fp8 buffer moves (with gradient clipping they part by rounding).  Bytes and scales are written in
place (``copy_``): a captured CUDA graph's GEMMs read them at the addresses of the capture.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ..parallel_state import ParallelGroup
from ..utils import collectives
from .quantize import cast, scale_from_amax
from .recipe import FP8Recipe

FP8_PARAM_DTYPE = torch.float8_e4m3fn  # weights are E4M3 in both formats ("hybrid" makes only gradients E5M2)


def is_fp8_param(param: torch.Tensor) -> bool:
    return param.dtype == FP8_PARAM_DTYPE


def make_fp8_param(param: torch.nn.Parameter, data: torch.Tensor, recipe: FP8Recipe) -> None:
    """Point ``param`` at ``data`` (its slot of a uint8 buffer) as fp8; its 16-bit value stays in
    ``param.fp8_init_value`` until ``release_init_value`` (its dtype in ``param.fp8_model_dtype``, which the
    main params are rounded to before each cast).  The scale is NaN until ``FP8ParamCast`` sets it, so
    a forward before the first cast makes NaNs (the job's non-finite guard stops it) rather than a wrong loss."""
    if recipe.recipe != "tensorwise":
        raise ValueError(f"fp8_param_gather casts weights with the \"tensorwise\" recipe; this layer's is "
                         f"{recipe.recipe!r}")
    param.fp8_init_value, param.fp8_model_dtype = param.data, param.dtype
    param.data = data.view(FP8_PARAM_DTYPE).view(param.shape)
    param.fp8_recipe = recipe
    # A grouped experts' weight [experts, ., .] holds one expert per index of dim 0, each with its own scale.
    shape = (param.size(0),) if param.dim() == 3 else ()
    param.fp8_scale_inv = torch.full(shape, float("nan"), dtype=torch.float32, device=data.device)


def release_init_value(param: torch.nn.Parameter) -> None:
    if hasattr(param, "fp8_init_value"):
        del param.fp8_init_value


class FP8ParamCast:
    """The cast of the fp8 weights whose DP shards and splits span the same groups: ``groups`` (a DP group, then
    the model-parallel group that splits the weights: DP and TP for the dense layers, expert-DP and ETP for the
    experts), ``params`` every such weight of the rank's buffers, in the same order on every rank of ``groups``.
    ``add`` registers one of this rank's main shards; ``cast`` runs after each step (see the module docstring)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], groups: Sequence[ParallelGroup]):
        self.params, self.groups = list(params), list(groups)
        # a weight's scales: one (2-D), or one per expert along dim 0 (a grouped experts' [experts, ., .] weight)
        self._first = [0]
        for p in self.params:
            self._first.append(self._first[-1] + p.fp8_scale_inv.numel())
        self._index = {p: i for i, p in enumerate(self.params)}
        self._mains: List[torch.Tensor] = []
        self._pieces: List[List[Tuple[int, int, int, torch.Tensor]]] = []  # per shard: (scale, lo, hi, out piece)

    def add(self, param: torch.nn.Parameter, start: int, main: torch.Tensor, out: torch.Tensor) -> None:
        """``main``: elements ``start ..`` of ``param`` (flattened), fp32; ``out``: their fp8 slot in the buffer."""
        i = self._index[param]
        per_scale = param.numel() // param.fp8_scale_inv.numel()
        end, pieces = start + main.numel(), []
        for k in range(start // per_scale, -(-end // per_scale) if end > start else 0):
            lo, hi = max(start, k * per_scale) - start, min(end, (k + 1) * per_scale) - start
            pieces.append((self._first[i] + k, lo, hi, out[lo:hi]))
        self._mains.append(main)
        self._pieces.append(pieces)

    @torch.no_grad()
    def cast(self) -> None:
        if not self.params:
            return
        rounded = [m.to(self.params[0].fp8_model_dtype) for m in self._mains]
        amaxes = torch.zeros(self._first[-1], dtype=torch.float32, device=self.params[0].device)
        for r, pieces in zip(rounded, self._pieces):
            for k, lo, hi, _ in pieces:
                amaxes[k] = torch.maximum(amaxes[k], r[lo:hi].abs().amax().float())
        for group in self.groups:
            collectives.all_reduce(amaxes, group, op=collectives.MAX)
        recipe = self.params[0].fp8_recipe
        scales = scale_from_amax(amaxes, recipe.fp8_max("weight"), recipe.margin)
        for i, p in enumerate(self.params):
            p.fp8_scale_inv.copy_((1.0 / scales[self._first[i]:self._first[i + 1]]).view(p.fp8_scale_inv.shape))
        for r, pieces in zip(rounded, self._pieces):
            for k, lo, hi, out in pieces:
                out.copy_(cast(r[lo:hi], scales[k], FP8_PARAM_DTYPE))


__all__ = ["FP8_PARAM_DTYPE", "FP8ParamCast", "is_fp8_param", "make_fp8_param", "release_init_value"]
