"""FP8 column- and row-parallel linears against a float64 emulation of each recipe written here from its definition.

The reference quantizes with the recipe's scales (fp32 ``fp8_max / amax / 2^margin``; blockwise: the power of two
at or below it, per 1x128 tile along the GEMM's reduction dimension, or per 128x128 weight block), dequantizes in
float64 and multiplies in float64.  The layer's output and both gradients must equal it up to the fp32 GEMM's
rounding (bound: (k + 2) * 2^-24 * (|A| @ |B|^T)), and differ from the bf16 layer by far more (fp8 engaged).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tensor_parallel"))
from harness import run_on_ranks  # noqa: E402
from tp_helpers import part, tp_group  # noqa: E402

from ds_megatron.fp8 import FP8Recipe, update_delayed_scaling  # noqa: E402
from ds_megatron.parallel_state import ParallelGroup  # noqa: E402
from ds_megatron.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, attach_fp8,  # noqa: E402
                                                fp8_states)
from ds_megatron.tensor_parallel.weight_grad_store import WeightGradStore  # noqa: E402

MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
S, B, H, F = 128, 1, 256, 256  # tokens S * B; every width a multiple of 128 per TP rank (blockwise)
CASES = list(itertools.product(("tensorwise", "delayed", "blockwise"), ("e4m3", "hybrid")))


def fp8_dtype(fmt: str, role: str) -> torch.dtype:
    return torch.float8_e5m2 if fmt == "hybrid" and role == "grad_output" else torch.float8_e4m3fn


def ref_quantize(t: torch.Tensor, dtype: torch.dtype, scale=None, tile=None, margin: int = 0) -> torch.Tensor:
    """float64 dequantized fp8 copy of ``t [m, k]``: one scale (given, or from the whole tensor's amax), or a
    power-of-two scale per ``tile`` = (rows, cols) block."""
    t32 = t.float()
    if tile is None:
        if scale is None:
            scale = torch.tensor(MAX[dtype], dtype=torch.float32) / t32.abs().max() / 2.0 ** margin
        s = torch.as_tensor(scale, dtype=torch.float32).expand_as(t32)
    else:
        r, c = tile
        m, k = t32.shape
        amax = t32.reshape(m // r, r, k // c, c).abs().amax(dim=(1, 3))
        exact = (torch.tensor(MAX[dtype], dtype=torch.float32) / amax / 2.0 ** margin).double()
        s = (2.0 ** torch.floor(torch.log2(exact))).float()
        s = s.repeat_interleave(r, 0).repeat_interleave(c, 1)
    q = (t32 * s).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q.double() / s.double()


def ref_gemm(a: torch.Tensor, b: torch.Tensor):
    """``a @ b^T`` in float64 and the fp32 GEMM's rounding bound for it."""
    return a @ b.t(), (a.size(1) + 2) * 2.0 ** -24 * (a.abs() @ b.abs().t()) + 1e-30


def reference(x, w, dy, recipe: str, fmt: str, scales=None):
    """(y, dx, dw) with their bounds for ``x [T, in]``, ``w [out, in]``, ``dy [T, out]``; ``scales`` per role for
    the delayed recipe."""
    e4, eg = fp8_dtype(fmt, "input"), fp8_dtype(fmt, "grad_output")
    if recipe == "blockwise":
        row = (1, 128)
        qx, qdy = ref_quantize(x, e4, tile=row), ref_quantize(dy, eg, tile=row)
        qw = ref_quantize(w, e4, tile=(128, 128))
        qxt, qdyt = ref_quantize(x.t(), e4, tile=row), ref_quantize(dy.t(), eg, tile=row)
    else:
        scales = scales or {}
        qx = qxt = ref_quantize(x, e4, scales.get("input"))
        qw = ref_quantize(w, e4, scales.get("weight"))
        qdy = ref_quantize(dy, eg, scales.get("grad_output"))
        qxt, qdyt = qx.t(), qdy.t()
    return ref_gemm(qx, qw), ref_gemm(qdy, qw.t()), ref_gemm(qdyt, qxt)


def assert_matches(got: torch.Tensor, ref, what: str) -> None:
    value, bound = ref
    err = (got.double() - value).abs()
    assert bool((err <= bound).all()), f"{what}: max error {err.max():.3e} beyond the fp32 bound " \
                                       f"{bound[err > bound].min():.3e}"


def data(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S * B, H, generator=g) * scale
    w = torch.randn(F, H, generator=g) * 0.05
    dy = torch.randn(S * B, F, generator=g) * 1e-3 * scale
    return x, w, dy


def run_layer(layer, x_local, dy_local):
    x_local = x_local.clone().requires_grad_()
    layer.weight.grad = None
    y, _ = layer(x_local)
    y.backward(dy_local)
    return y.detach(), x_local.grad, layer.weight.grad.clone()


def check_column_and_row(tp: ParallelGroup, recipe: str, fmt: str, steps: int = 1) -> None:
    """Column (in H -> F) and row (in F -> H) layers, SP when TP > 1, against the full-tensor reference; with the
    delayed recipe ``steps`` steps, each step's scales from the earlier steps' amaxes agreed over TP."""
    n, r = tp.size, tp.rank
    sp = n > 1
    col = ColumnParallelLinear(H, F, tp=tp, bias=False, sequence_parallel=sp)
    row = RowParallelLinear(F, H, tp=tp, bias=False, input_is_parallel=True, sequence_parallel=sp)
    x, w, dy = data(0)
    w_row = w.t().contiguous() * 0.5
    with torch.no_grad():
        col.weight.copy_(part(w, 0, r, n))
        row.weight.copy_(part(w_row, 1, r, n))
    sx = lambda t: part(t.reshape(S, B, -1), 0, r, n) if sp else t.reshape(S, B, -1)  # noqa: E731
    # bf16 results of the same layers, to show fp8 changes them
    bf16 = {name: run_layer(layer, sx(x) if name == "col" else part(x.reshape(S, B, -1), 2, r, n),
                            part(dy.reshape(S, B, -1), 2, r, n) if name == "col" else sx(dy))
            for name, layer in (("col", col), ("row", row))}
    history = {name: [] for name in ("col", "row")}
    fp8 = FP8Recipe(fmt, recipe, amax_history_len=2, amax_compute_algo="max", margin=1 if recipe == "delayed" else 0)
    attach_fp8(col, fp8)
    attach_fp8(row, fp8)
    for step in range(steps):
        x, _, dy = data(step, scale=(1.0, 4.0, 0.5)[step])
        for name, layer, weight in (("col", col, w), ("row", row, w_row)):
            dy_n = dy[:, :weight.size(0)]
            x_n = x[:, :weight.size(1)]
            scales = None
            if recipe == "delayed":
                past = history[name]
                scales = {role: (torch.tensor(MAX[fp8_dtype(fmt, role)]) / max(a[role] for a in past[-2:]) / 2.0
                                 if past else torch.tensor(1.0)) for role in ("input", "weight", "grad_output")}
                assert all(torch.equal(layer.fp8.scale[k], v.float()) for k, v in scales.items()), (name, step)
                history[name].append({"input": x_n.abs().max(), "weight": weight.abs().max(),
                                      "grad_output": dy_n.abs().max()})
            y_ref, dx_ref, dw_ref = reference(x_n.double(), weight.double(), dy_n.double(), recipe, fmt, scales)
            if name == "col":
                y, dx, dw = run_layer(layer, sx(x_n), part(dy_n.reshape(S, B, -1), 2, r, n))
                out_part = lambda ref: tuple(part(t, 1, r, n) for t in ref)  # noqa: E731
                assert_matches(y.reshape(S * B, -1), out_part(y_ref), f"{name} output")
                assert_matches(dx.reshape(-1, H), tuple(part(t, 0, r, n) if sp else t for t in dx_ref),
                               f"{name} input gradient")
                assert_matches(dw, tuple(part(t, 0, r, n) for t in dw_ref), f"{name} weight gradient")
            else:
                y, dx, dw = run_layer(layer, part(x_n.reshape(S, B, -1), 2, r, n), sx(dy_n))
                assert_matches(y.reshape(-1, H), tuple(part(t, 0, r, n) if sp else t for t in y_ref),
                               f"{name} output")
                assert_matches(dx.reshape(S * B, -1), tuple(part(t, 1, r, n) for t in dx_ref),
                               f"{name} input gradient")
                assert_matches(dw, tuple(part(t, 1, r, n) for t in dw_ref), f"{name} weight gradient")
            if step == 0:
                for got, base in zip((y, dx, dw), bf16[name]):
                    rel = ((got - base).norm() / base.norm()).item()
                    assert rel > 1e-2, f"{name} {recipe} {fmt}: fp8 result within {rel:.1e} of bf16's (fp8 off?)"
        update_delayed_scaling(fp8_states(col) + fp8_states(row), {"dense": [tp]})


@pytest.mark.parametrize("recipe,fmt", CASES)
def test_fp8_linears_equal_float64_emulation_tp1(recipe, fmt):
    check_column_and_row(ParallelGroup.single("tp"), recipe, fmt, steps=3 if recipe == "delayed" else 1)


def _tp2_all_cases():
    with tp_group(2) as (g, _, _):
        for recipe, fmt in CASES:
            check_column_and_row(g, recipe, fmt, steps=2 if recipe == "delayed" else 1)


def test_fp8_linears_equal_float64_emulation_tp2_sequence_parallel():
    run_on_ranks(2, _tp2_all_cases)


def test_what_the_layer_cannot_run_is_refused_naming_it():
    tp = ParallelGroup.single("tp")
    with pytest.raises(ValueError, match="input features per TP rank is 192"):
        attach_fp8(ColumnParallelLinear(192, 256, tp=tp), FP8Recipe("e4m3", "blockwise"))
    layer = RowParallelLinear(256, 128, tp=tp)
    attach_fp8(layer, FP8Recipe("e4m3", "blockwise"))
    with pytest.raises(ValueError, match="seq_length x micro_batch_size that is a multiple of 128"):
        layer(torch.randn(96, 1, 256, requires_grad=True))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_a_deferred_fp8_weight_gradient_equals_the_undeferred_one(recipe):
    """ZB-H1's W pass on an fp8 linear: nothing reaches the weight in B, and W gives it the gradient the undeferred
    layer computes, bit for bit (the GEMM on the fp8 copies of X and dY that B made)."""
    tp = ParallelGroup.single("tp")
    grads = []
    for deferred in (False, True):
        torch.manual_seed(0)
        layer = ColumnParallelLinear(256, 128, tp=tp)
        attach_fp8(layer, FP8Recipe("hybrid", recipe))
        if recipe == "delayed":
            layer.fp8.scale = {"input": torch.tensor(100.0), "weight": torch.tensor(3000.0),
                               "grad_output": torch.tensor(2.0 ** 16)}
        store = WeightGradStore()
        if deferred:  # the reference: the plain fp8 layer, no store
            layer.weight_grad_store = store
        x = torch.randn(128, 1, 256, requires_grad=True)
        dy = torch.randn(128, 1, 128)
        with store.deferring("w") if deferred else contextlib.nullcontext():
            layer(x)[0].backward(dy)
        if deferred:
            assert layer.weight.grad is None and store.pending == ["w"]
            store.run("w")
        grads.append(layer.weight.grad)
    assert torch.equal(grads[0], grads[1])
