"""Quantize to fp8 with a recipe's scales, and the scaled GEMM ``(a * a_scale_inv) @ (b * b_scale_inv)^T``.

A tensor is stored as ``q = fp8(x * scale)``, saturated to the format's range (a delayed scale may be stale), and
read back as ``q * scale_inv``.  Blockwise scales are powers of two (rounded down, so the block's amax still fits),
one per 1x128 tile along the last dimension (activations, gradients) or per 128x128 block (weights).  The GEMM runs
through ``torch._scaled_mm`` with one scale per tensor; other layouts (blockwise, or shapes the device's kernel
does not take) run as the exact emulation: dequantize in fp32 (exact: an fp8 value times a power of two or an fp32
scale is one fp32 rounding at most) and multiply in fp32.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .recipe import BLOCK


def amax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax().float()


def scale_from_amax(amax: torch.Tensor, fp8_max: float, margin: int = 0) -> torch.Tensor:
    """``fp8_max / amax / 2^margin``; 1 where amax is 0 (an all-zero tensor quantizes exactly with any scale)."""
    # A tensor numerator: ``float / tensor`` is a reciprocal and a multiply in torch, one rounding more.
    scale = torch.full_like(amax, fp8_max) / amax / (2.0 ** margin)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def pow2_scale_from_amax(amax: torch.Tensor, fp8_max: float, margin: int = 0) -> torch.Tensor:
    """The largest power of two not above ``scale_from_amax`` (DeepSeek-V3's block scales), read off the exponent
    (a rounded log2 could land on the power above)."""
    _, exponent = torch.frexp(scale_from_amax(amax, fp8_max, margin))
    return torch.ldexp(torch.ones_like(amax), exponent - 1)


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8(x * scale)`` saturated to the format's largest value (``float8_e4m3fn`` has no infinity)."""
    limit = torch.finfo(dtype).max
    # One fp32 copy, scaled and clamped in place: the cast's transient is 4 bytes an element (the plan counts it).
    return x.to(torch.float32, copy=True).mul_(scale).clamp_(-limit, limit).to(dtype)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """fp32 ``x`` with zero rows (to a multiple of ``rows``) and columns (of 128) appended: a partial tile's amax is
    its own elements' (DeepSeek-V3's kernels tile a width that is not a multiple of 128 so)."""
    pad_rows, pad_cols = -x.size(0) % rows, -x.size(1) % BLOCK
    x = x.float()
    return torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows)) if pad_rows or pad_cols else x


def quantize_1x128(x: torch.Tensor, dtype: torch.dtype, fp8_max: float, margin: int = 0
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [m, k]`` with one power-of-two scale per 1x128 tile (the last one partial where 128 does not divide k):
    (q [m, k], scale_inv [m, ceil(k/128)])."""
    m, k = x.shape
    width = -(-k // BLOCK) * BLOCK
    tiles = _padded(x, 1).reshape(m, width // BLOCK, BLOCK)
    scale = pow2_scale_from_amax(tiles.abs().amax(-1), fp8_max, margin)
    q = cast(tiles, scale.unsqueeze(-1), dtype).reshape(m, width)
    return (q[:, :k].clone() if width != k else q), 1.0 / scale  # a copy: a view would keep the padding


def quantize_128x128(w: torch.Tensor, dtype: torch.dtype, fp8_max: float, margin: int = 0
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``w [n, k]`` with one power-of-two scale per 128x128 block (partial at the edges where 128 does not divide n
    or k): (q [n, k], scale_inv [ceil(n/128), ceil(k/128)])."""
    n, k = w.shape
    padded = _padded(w, BLOCK)
    blocks = padded.reshape(padded.size(0) // BLOCK, BLOCK, padded.size(1) // BLOCK, BLOCK)
    scale = pow2_scale_from_amax(blocks.abs().amax(dim=(1, 3)), fp8_max, margin)
    q = cast(blocks, scale[:, None, :, None], dtype).reshape(padded.shape)
    return (q[:n, :k].clone() if padded.shape != w.shape else q), 1.0 / scale  # a copy: a view keeps the padding


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale_inv`` for a scalar, 1x128 ([m, ceil(k/128)]) or 128x128 ([ceil(m/128), ceil(k/128)])
    ``scale_inv``."""
    if scale_inv.dim() == 0:
        return q.float() * scale_inv
    rows = 1 if scale_inv.size(0) == q.size(0) else BLOCK  # 1x128 tiles or 128x128 blocks
    expanded = scale_inv.repeat_interleave(rows, 0).repeat_interleave(BLOCK, 1)
    return q.float() * expanded[:q.size(0), :q.size(1)]


def _kernel_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # cuBLASLt's fp8 GEMM needs k and n to be multiples of 16 (the CPU kernel takes any shape).
    return a.device.type == "cpu" or (a.size(1) % 16 == 0 and b.size(0) % 16 == 0)


def scaled_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * a_scale_inv) @ (b * b_scale_inv)^T`` for fp8 ``a [m, k]``, ``b [n, k]``, accumulated in fp32."""
    if a_scale_inv.dim() == 0 and b_scale_inv.dim() == 0 and _kernel_takes(a, b):
        return torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=a_scale_inv, scale_b=b_scale_inv,
                                out_dtype=out_dtype)
    return dequantize(a, a_scale_inv).mm(dequantize(b, b_scale_inv).t()).to(out_dtype)


__all__ = ["amax", "cast", "dequantize", "pow2_scale_from_amax", "quantize_128x128", "quantize_1x128",
           "scale_from_amax", "scaled_gemm"]
