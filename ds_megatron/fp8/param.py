"""FP8 parameters (Megatron's ``fp8_param_gather``): an fp8 layer's weight kept as E4M3 bytes with its scale, and
the cast of the fp32 main params into them after each optimizer step.

``make_fp8_param`` points a weight at its bytes (a view of the distributed optimizer's uint8 param buffer, as
``float8_e4m3fn``) and keeps its 16-bit value until the optimizer has taken its main params from it.  The forward's
fp8 GEMM then reads the bytes and ``param.fp8_scale_inv`` as they are (``linear``: no quantization of W); its
weight gradient goes straight into ``param.main_grad`` (an fp8 ``.grad`` would round it away).

``cast_main_shards`` is the tensorwise recipe done on shards: each rank holds only some elements of a weight (a
DP shard of a bucket cuts params anywhere), and a TP rank only its split of it, but the scale must be the whole
weight's.  So every rank computes the amax of what it owns of each fp8 weight of its buffers (0 where it owns
nothing), agrees on them with one all-reduce (MAX) over the DP group and one over TP, and casts its pieces with
the agreed scale.  Each main shard is first rounded to the params' 16-bit dtype, as Megatron does: the bytes are
then exactly those the layer makes from its 16-bit weight without ``fp8_param_gather`` (the max of a rounded
tensor is the rounded max, and the cast is elementwise): both runs do the same arithmetic, but for the gradient
norm, summed over DP shards that the fp8 buffer moves (with gradient clipping they part by rounding).
"""
from __future__ import annotations

from typing import Sequence

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
    main params are rounded to before each cast).  The scale is NaN until ``cast_main_shards`` sets it, so
    a forward before the first cast makes NaNs (the job's non-finite guard stops it) rather than a wrong loss."""
    if recipe.recipe != "tensorwise":
        raise ValueError(f"fp8_param_gather casts weights with the \"tensorwise\" recipe; this layer's is "
                         f"{recipe.recipe!r}")
    param.fp8_init_value, param.fp8_model_dtype = param.data, param.dtype
    param.data = data.view(FP8_PARAM_DTYPE).view(param.shape)
    param.fp8_recipe = recipe
    param.fp8_scale_inv = torch.full((), float("nan"), dtype=torch.float32, device=data.device)


def release_init_value(param: torch.nn.Parameter) -> None:
    if hasattr(param, "fp8_init_value"):
        del param.fp8_init_value


@torch.no_grad()
def cast_main_shards(params: Sequence[torch.nn.Parameter], owner: Sequence[int], mains: Sequence[torch.Tensor],
                     outs: Sequence[torch.Tensor], dtype: torch.dtype, groups: Sequence[ParallelGroup]) -> None:
    """Cast each fp32 main shard ``mains[i]`` (of fp8 weight ``params[owner[i]]``) into ``outs[i]``, its fp8 slot
    in the param buffer, with the whole weight's tensorwise scale agreed over ``groups`` (see the module docstring).
    ``params``: every fp8 weight of the rank's buffers, in the same order on every rank of ``groups``."""
    if not params:
        return
    rounded = [m.to(dtype) for m in mains]
    amaxes = torch.zeros(len(params), dtype=torch.float32, device=params[0].device)
    for i, r in zip(owner, rounded):
        if r.numel():
            amaxes[i] = torch.maximum(amaxes[i], r.abs().amax().float())
    for group in groups:
        collectives.all_reduce(amaxes, group, op=collectives.MAX)
    scales = [scale_from_amax(a, p.fp8_recipe.fp8_max("weight"), p.fp8_recipe.margin) for a, p in zip(amaxes, params)]
    for p, s in zip(params, scales):
        p.fp8_scale_inv.copy_(1.0 / s)
    for i, r, out in zip(owner, rounded, outs):
        out.copy_(cast(r, scales[i], FP8_PARAM_DTYPE))


__all__ = ["FP8_PARAM_DTYPE", "cast_main_shards", "is_fp8_param", "make_fp8_param",
           "release_init_value"]
