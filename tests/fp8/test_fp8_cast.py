"""The tensorwise cast of a gradient with a wide dynamic range, E4M3 and E5M2, against their value grids written here
from the formats' definitions: round to nearest, ties to even, subnormals kept, values below half the smallest
subnormal to 0, the amax onto the format's largest finite value (issue 42: e4m3's gradients under one scale per
tensor, where the tensor's small elements reach E4M3's subnormals and underflow)."""
from __future__ import annotations

import pytest
import torch

from ds_megatron.fp8.quantize import cast, scale_from_amax

# (exponent bits, mantissa bits, largest finite value): E4M3 "fn" has no infinity, its top code is NaN only.
FORMATS = {torch.float8_e4m3fn: (4, 3, 448.0), torch.float8_e5m2: (5, 2, 57344.0)}


def grid(dtype: torch.dtype) -> torch.Tensor:
    """The format's finite non-negative values in code order, float64: subnormals m * 2^(1 - bias - M), then
    normals 2^(e - bias) * (1 + m / 2^M), up to the largest finite value."""
    e_bits, m_bits, top = FORMATS[dtype]
    bias = 2 ** (e_bits - 1) - 1
    values = [m * 2.0 ** (1 - bias - m_bits) for m in range(2 ** m_bits)]
    values += [2.0 ** (e - bias) * (1 + m / 2 ** m_bits) for e in range(1, 2 ** e_bits) for m in range(2 ** m_bits)]
    return torch.tensor([v for v in values if v <= top], dtype=torch.float64)


def round_to_grid(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``v`` (within the format's range) to the nearest grid value, a tie to the even code."""
    g = grid(dtype)
    a = v.abs()
    hi = torch.searchsorted(g, a).clamp(1, len(g) - 1)
    lo = hi - 1
    d_lo, d_hi = a - g[lo], g[hi] - a
    pick = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(lo % 2 == 0, lo, hi)))
    return torch.sign(v) * g[pick]


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_a_wide_range_gradient_casts_onto_the_format_grid_with_underflow_to_zero(dtype):
    top = FORMATS[dtype][2]
    g = torch.Generator().manual_seed(0)
    # A gradient whose elements span 2^-40 .. 1 of its amax: many land in the subnormals or below.
    dy = (torch.randn(64, 512, generator=g) * torch.exp2(-40 * torch.rand(64, 512, generator=g))).bfloat16()
    scale = scale_from_amax(dy.abs().amax().float(), top)
    got = cast(dy, scale, dtype).double()
    want = round_to_grid((dy.float() * scale).double(), dtype)  # the recipe's fp32 product, rounded here
    assert torch.equal(got, want), f"{(got != want).sum()} elements off the {dtype} grid's rounding"
    smallest = grid(dtype)[1].item()
    scaled = (dy.float() * scale).double().abs()
    assert got.abs().max() == top  # the amax lands on the largest finite value
    assert bool((got[scaled < smallest / 2] == 0).all()) and bool((got[scaled > smallest / 2] != 0).all())
    assert 0.05 < (got == 0).double().mean() < 0.95  # the case really has both underflow and survivors


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_edges_of_the_range_round_as_the_format_defines(dtype):
    g = grid(dtype)
    smallest, top = g[1].item(), g[-1].item()
    # half the smallest subnormal ties to 0 (even); just above it rounds up; beyond the top saturates to it
    x = torch.tensor([smallest / 2, smallest * 0.5000001, smallest * 1.5, top * 1.01, -top * 3, 0.0])
    got = cast(x, torch.tensor(1.0), dtype).double()
    want = torch.tensor([0.0, smallest, 2 * smallest, top, -top, 0.0], dtype=torch.float64)
    assert torch.equal(got, want), (got, want)
