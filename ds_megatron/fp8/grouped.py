"""The MoE experts' grouped GEMMs in fp8: each local expert's projection is its own fp8 linear over that expert's
tokens, as in Transformer Engine's ``GroupedLinear``: one scaling state per expert weight, and each expert's input
and output gradient quantized over its own token slice (TE splits the grouped input and quantizes every split with
that GEMM's quantizer).  Tensorwise agrees on all experts' amaxes in one all-reduce over the states' amax group (the
expert-tensor-parallel group, which splits the weights, fc1's output gradient and fc2's input); never over EP,
whose ranks hold other experts and, after the dispatch, all of their own experts' tokens.

Each expert's group of tokens is padded with zero rows to a multiple of ``alignment`` (16, as Megatron's
``moe_router_padding_for_fp8`` and TE's ``Fp8Padding``: the weight gradient's reduction dimension is the tokens,
and cuBLASLt's fp8 GEMM takes multiples of 16; 128 for blockwise, whose weight gradient tiles the tokens by 128).
Zero rows change no amax and no product: their outputs are dropped, and their output gradients are zero.

With ``fp8_param_gather`` the weights arrive as fp8 bytes with one scale per expert (``param``) and are used as
they are.  As in ``linear.py``: the delayed recipe records the amaxes of the passes that train only (not an
evaluation under ``no_grad``), and the experts' weight-gradient GEMMs can be deferred (ZB-H1's W pass,
``weight_grad``): they then run later on the fp8 copies of X and dY the B pass made.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..utils import collectives
from .quantize import cast, quantize_128x128, quantize_1x128, scale_from_amax, scaled_gemm
from .recipe import BLOCK, FP8LinearState, FP8Recipe

ALIGN = 16  # cuBLASLt's fp8 GEMM: the reduction dimension (the weight gradient's tokens) a multiple of 16


def alignment(recipe: FP8Recipe) -> int:
    """Rows each expert's token group is padded to a multiple of."""
    return BLOCK if recipe.recipe == "blockwise" else ALIGN


def _amax(t: torch.Tensor) -> torch.Tensor:
    # An expert may receive no tokens: its amax is 0 (and its scale 1).
    return t.detach().abs().amax().float() if t.numel() else torch.zeros((), device=t.device)


def _per_tensor(states: Sequence[FP8LinearState], tensors: Sequence[Tuple[torch.Tensor, ...]],
                roles: Tuple[str, ...], record: bool) -> List[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """Tensorwise or delayed: (fp8 copy, scale_inv) of each expert's tensors.  Tensorwise agrees on every
    expert's amaxes in one all-reduce (MAX) over the amax group; delayed uses each state's scales and, when
    ``record``, folds its amaxes into the step's."""
    recipe = states[0].recipe
    amaxes = torch.stack([torch.stack([_amax(t) for t in ts]) for ts in tensors])  # [experts, roles]
    if recipe.recipe == "tensorwise":
        collectives.all_reduce(amaxes, states[0].amax_group, op=collectives.MAX)
        scales = [[scale_from_amax(a, recipe.fp8_max(r), recipe.margin) for a, r in zip(row, roles)]
                  for row in amaxes]
    else:
        for state, row in zip(states, amaxes):
            state.follow(row.device)
            for a, r in zip(row, roles):
                if record:
                    state.record_amax(r, a)
        scales = [[state.scale[r] for r in roles] for state in states]
    return [[(cast(t, s, recipe.dtype(r)), 1.0 / s) for t, s, r in zip(ts, row, roles)]
            for ts, row in zip(tensors, scales)]


def _tiles(recipe: FP8Recipe, t: torch.Tensor, role: str):
    return quantize_1x128(t, recipe.dtype(role), recipe.fp8_max(role), recipe.margin)


class _FP8GroupedLinear(torch.autograd.Function):
    """``x [N, k]`` (groups of ``counts`` rows, each a multiple of the alignment) times ``weight [L, n, k]``:
    group e's forward, data-gradient and weight-gradient GEMMs in fp8 by ``states[e]``."""

    @staticmethod
    def forward(ctx, x, weight, counts, states, record, weight_grad, scale_inv):
        r = states[0].recipe
        xs, ws = torch.split(x, counts), weight.unbind(0)
        if scale_inv is not None:  # fp8_param_gather: W comes quantized, with one scale per expert
            qx = [p[0] for p in _per_tensor(states, [(t,) for t in xs], ("input",), record)]
            qw = [(w.detach(), s) for w, s in zip(ws, scale_inv.unbind(0))]
            saved_x = qx
        elif r.recipe == "blockwise":
            qx = [_tiles(r, t, "input") for t in xs]
            qw = [quantize_128x128(w, r.dtype("weight"), r.fp8_max("weight"), r.margin) for w in ws]
            # The weight gradient reduces over the tokens: x tiled 1x128 along them (DeepSeek-V3's 128x1).
            saved_x = [_tiles(r, t.t(), "input") for t in xs] if ctx.needs_input_grad[1] else [(None, None)] * len(xs)
        else:
            pairs = _per_tensor(states, list(zip(xs, ws)), ("input", "weight"), record)
            qx, qw = [p[0] for p in pairs], [p[1] for p in pairs]
            saved_x = qx
        ys = [scaled_gemm(*a, *b, x.dtype) if c else x.new_zeros(0, weight.size(1))
              for a, b, c in zip(qx, qw, counts)]
        # an fp8 weight's gradient is computed in the input's dtype (and goes into its main_grad, not .grad)
        w_dtype = x.dtype if scale_inv is not None else weight.dtype
        ctx.counts, ctx.states, ctx.dtypes, ctx.k = counts, states, (x.dtype, w_dtype), x.size(1)
        ctx.weight_grad = weight_grad
        ctx.save_for_backward(*(t for pair in saved_x + qw for t in pair))
        return torch.cat(ys) if ys else x.new_zeros(0, weight.size(1))

    @staticmethod
    def backward(ctx, grad_output):
        counts, states, (x_dtype, w_dtype) = ctx.counts, ctx.states, ctx.dtypes
        r, n, k = states[0].recipe, grad_output.size(1), ctx.k
        saved = ctx.saved_tensors
        L = len(counts)
        qx = [(saved[2 * e], saved[2 * e + 1]) for e in range(L)]
        qw = [(saved[2 * (L + e)], saved[2 * (L + e) + 1]) for e in range(L)]
        dys = torch.split(grad_output.contiguous(), counts)
        # Each expert's dY quantized for its two GEMMs (blockwise: 1x128 along the features for the data gradient,
        # along the tokens for the weight gradient), so that a deferred W holds fp8 copies only.
        if r.recipe == "blockwise":
            qdys = [_tiles(r, dy, "grad_output") if c and ctx.needs_input_grad[0] else None
                    for dy, c in zip(dys, counts)]
            qdyts = [_tiles(r, dy.t(), "grad_output") if c and ctx.needs_input_grad[1] else None
                     for dy, c in zip(dys, counts)]
            dgrad_w = [(q.t(), s.t()) for q, s in qw]
        else:
            qdys = [p[0] for p in _per_tensor(states, [(dy,) for dy in dys], ("grad_output",), True)]
            qdyts, dgrad_w = [(q.t(), s) for q, s in qdys], [(q.t(), s) for q, s in qw]
            qx = [(q.t(), s) for q, s in qx]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.cat([scaled_gemm(*qdy, *w, x_dtype) if c else grad_output.new_zeros(0, k, dtype=x_dtype)
                                for qdy, w, c in zip(qdys, dgrad_w, counts)])
        if ctx.needs_input_grad[1]:
            device = grad_output.device  # not grad_output itself: a deferred W would keep the 16-bit dY alive

            def wgrad() -> torch.Tensor:
                return torch.stack([scaled_gemm(*qdyt, *qxt, w_dtype) if c else
                                    torch.zeros(n, k, dtype=w_dtype, device=device)
                                    for qdyt, qxt, c in zip(qdyts, qx, counts)])
            grad_w = ctx.weight_grad(wgrad)
        return grad_x, grad_w, None, None, None, None, None


def _now(compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    return compute()


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: Sequence[int],
                       states: Sequence[FP8LinearState],
                       weight_grad: Optional[Callable[[Callable[[], torch.Tensor]], Optional[torch.Tensor]]] = None,
                       scale_inv: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [N, k]`` in expert-contiguous groups of ``tokens_per_expert`` rows times ``weight [L, n, k]`` (expert
    e's weight in ``F.linear``'s layout) -> ``[N, n]``, each expert's GEMMs in fp8 by ``states[e]``; the groups
    are padded with zero rows to the recipe's alignment for the GEMMs and the padding's rows dropped after.
    ``weight_grad`` is handed the experts' weight-gradient GEMMs (a closure over the fp8 copies giving
    ``weight``'s gradient) and returns it, or None having deferred it; by default they run at once.
    ``scale_inv [L]``: ``weight`` is fp8 bytes already (``fp8_param_gather``), expert e's read with ``scale_inv[e]``;
    ``weight_grad`` must then put the gradient into the parameter's ``main_grad`` and return None (an fp8
    ``.grad`` would round it away)."""
    record, weight_grad = torch.is_grad_enabled(), weight_grad or _now
    counts = [int(c) for c in tokens_per_expert]
    align = alignment(states[0].recipe)
    padded = [-(-c // align) * align for c in counts]
    if padded == counts:
        return _FP8GroupedLinear.apply(x, weight, counts, tuple(states), record, weight_grad, scale_inv)
    starts = [sum(padded[:e]) for e in range(len(counts))]
    rows = torch.cat([torch.arange(s, s + c, device=x.device) for s, c in zip(starts, counts)])
    # index_copy / index_select: x's gradient is read from the real rows only, and the rows dropped here
    # receive a zero gradient, so the padding adds nothing to the weight gradient nor to dY's amax.
    x_padded = x.new_zeros(sum(padded), x.size(1)).index_copy(0, rows, x)
    return _FP8GroupedLinear.apply(x_padded, weight, padded, tuple(states), record, weight_grad,
                                  scale_inv).index_select(0, rows)


__all__ = ["ALIGN", "alignment", "fp8_grouped_linear"]
