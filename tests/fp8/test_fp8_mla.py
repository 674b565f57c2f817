"""Multi-latent attention with fp8 against a float64 emulation of the recipe written here, at TP 1 and at TP 2 with
sequence parallelism (gloo ranks), at hidden 128 and 128 tokens, with a query latent (q_a_proj, q_b_proj) or without
(one q_proj).

Every projection is fp8, the down-projections too (megatron-core builds them as Transformer Engine linears, fp8
under its autocast).  The reference is the layer's arithmetic in float64 from its definition (RMSNorm, DeepSeek's
interleaved RoPE, causal softmax), each projection ``Q(X) Q(W)^T`` with ``dX = Q(dY) Q(W)``, ``dW = Q(dY)^T Q(X)``,
``Q`` the recipe's quantization (``ref_quantize`` of test_fp8_linear).  It is written per TP rank: rank r's heads
take the rows r of the up-projections and the columns r of ``o_proj``; the tensors a TP layer splits are quantized
with one scale agreed over the ranks (the whole tensor's), and the down-projections' output gradients, partial sums
over each rank's heads, are quantized per rank with the largest amax's scale, then summed.

``Q`` is applied to the fp32 tensors the layer quantized (recorded from its fp8 GEMMs), not to the emulation's
float64 ones: an element within fp32 rounding of the boundary between two fp8 codes rounds to either, and one such
flip moves a GEMM's result by an fp8 step times a row of the other operand (at these sizes one element of
``o_proj``'s input, 19.000 scaled, rounded to 18 in fp32 and to 20 in float64, and moved the output by 6.2e-3,
750 times fp32 rounding).  So only the GEMMs' accumulation differs: output and gradients must equal the reference
to fp32 rounding (relative 2e-6 of the tensor's largest value).  End to end, every recorded tensor must equal the
emulation's own to fp32 rounding upstream (``UPSTREAM`` of its largest value), and quantizing the two gives the
same fp8 tensor but for such flips (their sum ``FLIPS`` of the tensor's at most).  The layer must differ from the
16-bit layer by far more (every projection in fp8: dropping any one of them from fp8 fails the comparison).
"""
from __future__ import annotations

import contextlib
import os
import sys
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tensor_parallel"))
from harness import run_on_ranks  # noqa: E402
from test_fp8_linear import MAX, fp8_dtype, ref_quantize  # noqa: E402
from tp_helpers import part, tp_group  # noqa: E402

from ds_megatron.fp8 import FP8Recipe, update_delayed_scaling  # noqa: E402
from ds_megatron.fp8.linear import _FP8Linear  # noqa: E402
from ds_megatron.models import GPTConfig  # noqa: E402
from ds_megatron.parallel_state import ParallelGroup  # noqa: E402
from ds_megatron.tensor_parallel import allreduce_tp_partial_grads, init_method_normal  # noqa: E402
from ds_megatron.tensor_parallel.layers import attach_fp8, fp8_states  # noqa: E402
from ds_megatron.transformer.multi_latent_attention import MLASelfAttention  # noqa: E402

# tokens, batch, hidden, heads; q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim: widths the
# blockwise recipe tiles at TP 1 (128 tokens; kv_lora_rank + qk_pos_emb_head_dim = 160 leaves a partial tile).
S, B, H, N = 64, 2, 128, 4
QL, KVL, QK, POS, V = 128, 128, 32, 32, 32
EPS, BASE = 1e-6, 500.0
UPSTREAM, FLIPS = 5e-5, 1e-4  # measured at most 4.5e-6 (q_proj grad_output) and 6.9e-6 (q_b_proj grad_output, TP 2)
# (recipe, fp8, q_lora_rank): None for one q_proj in place of q_a_proj, its norm and q_b_proj
CASES = [("tensorwise", "e4m3", QL), ("tensorwise", "hybrid", QL), ("delayed", "hybrid", QL),
         ("delayed", "hybrid", None)]
TP1_CASES = CASES + [("blockwise", "hybrid", QL), ("blockwise", "hybrid", None)]
LINEARS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
ROLES = ("input", "weight", "grad_output")


def config(**extra) -> GPTConfig:
    return GPTConfig(**{**dict(num_layers=1, hidden_size=H, num_attention_heads=N, seq_length=S, vocab_size=64,
                               hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
                               rotary_base=BASE, normalization="RMSNorm", norm_epsilon=EPS, add_bias_linear=False,
                               multi_latent_attention=True, q_lora_rank=QL, kv_lora_rank=KVL, qk_head_dim=QK,
                               qk_pos_emb_head_dim=POS, v_head_dim=V), **extra})


def linears(layer) -> list:
    return [name for name in LINEARS if hasattr(layer, name)]


@contextlib.contextmanager
def recording(layer):
    """Yield a dict that fills, while ``layer`` runs, with the fp32 tensor each of its fp8 GEMMs quantized on this
    rank, by (linear, role), as ``[rows, features]``: read where ``_FP8Linear``'s forward and backward take them
    (the linear known by its weight)."""
    names = {id(getattr(layer, name).weight): name for name in linears(layer)}
    seen = {}
    forward, backward = _FP8Linear.forward, _FP8Linear.backward

    def record_forward(ctx, x, weight, *rest):
        ctx.linear = names[id(weight)]
        seen[ctx.linear, "input"] = x.detach().reshape(-1, x.size(-1)).clone()
        seen[ctx.linear, "weight"] = weight.detach().clone()
        return forward(ctx, x, weight, *rest)

    def record_backward(ctx, dy):
        seen[ctx.linear, "grad_output"] = dy.reshape(-1, dy.size(-1)).clone()
        return backward(ctx, dy)

    with mock.patch.object(_FP8Linear, "forward", staticmethod(record_forward)), \
            mock.patch.object(_FP8Linear, "backward", staticmethod(record_backward)):
        yield seen


def every_rank(seen: dict, tp: ParallelGroup) -> dict:
    """(linear, role) -> the tensors every TP rank recorded, in rank order."""
    if tp.size == 1:
        return {key: [t] for key, t in seen.items()}
    out = {}
    for key in sorted(seen):  # the same order on every rank
        out[key] = [torch.empty_like(seen[key]) for _ in range(tp.size)]
        torch.distributed.all_gather(out[key], seen[key].contiguous(), group=tp.group)
    return out


class Quantizer:
    """The recipe's ``Q`` for the reference, on the layer's operands (``operands``: ``every_rank``'s): per (linear,
    role) a given scale (delayed) or the joint amax's, and the amaxes seen (MAX over the tensors quantized
    together), for the next delayed step."""

    def __init__(self, fmt: str, operands: dict, scales=None, blockwise: bool = False):
        self.fmt, self.operands, self.scales, self.amax, self.blockwise = fmt, operands, scales, {}, blockwise

    def take(self, ts, name: str, role: str):
        """The layer's fp32 tensors in place of the emulation's float64 ``ts`` (one per rank, or one for all: a
        replicated operand), which they must equal to fp32 rounding upstream."""
        assert (name, role) in self.operands, f"{name} {role}: the layer quantized no such tensor (not in fp8?)"
        got = self.operands[name, role][:len(ts)]
        for g, t in zip(got, ts):
            err, top = (g.double() - t.detach().reshape(g.shape)).abs().max().item(), t.abs().max().item()
            assert err <= UPSTREAM * top, f"{name} {role}: the layer's tensor is {err:.2e} from the emulation's " \
                                          f"(largest {top:.2e}), beyond fp32 rounding upstream"
        return got

    def __call__(self, ts, name: str, role: str):
        got = self.take(ts, name, role)
        dtype = fp8_dtype(self.fmt, role)
        a = max(g.abs().max() for g in got)
        self.amax[name, role] = torch.maximum(self.amax.get((name, role), a), a)
        scale = self.scales[name][role] if self.scales else torch.tensor(MAX[dtype], dtype=torch.float32) / a
        quantize = lambda t: ref_quantize(t, dtype, scale)  # noqa: E731
        qs = [quantize(g) for g in got]
        few_flips(qs, [quantize(t.detach().reshape(g.shape)) for t, g in zip(ts, got)], f"{name} {role}")
        return [q.reshape(t.shape) for q, t in zip(qs, ts)]


def few_flips(got, emulated, what: str) -> None:
    """The fp8 tensors of the layer's operands and of the emulation's differ only by elements that lay within
    rounding of a boundary between two codes: few, their changes summing to ``FLIPS`` of the tensor's at most."""
    for g, e in zip(got, emulated):
        moved, total = (g - e).abs().sum().item(), e.abs().sum().item()
        assert moved <= FLIPS * total, f"{what}: {int((g != e).sum())} of {g.numel()} fp8 values differ from the " \
                                       f"emulation's, {moved / total:.1e} of the tensor: not rounding flips"


class QuantizeForward(torch.autograd.Function):
    """``Q`` of tensors quantized together; the gradient passes through (the GEMMs use Q(dY), see QuantizeGrad)."""

    @staticmethod
    def forward(ctx, quantizer, name, role, *ts):
        return tuple(quantizer(ts, name, role))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None) + grads


class QuantizeGrad(torch.autograd.Function):
    """Identity forward; backward quantizes the output gradients together (one scale for all of them)."""

    @staticmethod
    def forward(ctx, quantizer, name, *ts):
        ctx.quantizer, ctx.name = quantizer, name
        return tuple(t.clone() for t in ts)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + tuple(ctx.quantizer(grads, ctx.name, "grad_output"))


def tiles(t, dtype, tile):
    """``ref_quantize`` by power-of-two tiles, zero-padded to whole tiles (a partial tile: its own elements')."""
    r, c = tile
    padded = F.pad(t, (0, -t.size(1) % c, 0, -t.size(0) % r))
    # an all-zero tile (a causal core's first tokens' gradients) scales by inf: 0 * inf, read as its exact 0
    return ref_quantize(padded, dtype, tile=tile).nan_to_num(0.0)[:t.size(0), :t.size(1)]


class BlockwiseGemm(torch.autograd.Function):
    """One rank's blockwise GEMMs on the layer's operands: 1x128 tiles along each GEMM's reduction dimension (x and
    dy by features, then by tokens for the weight gradient), 128x128 weight blocks."""

    @staticmethod
    def forward(ctx, x, w, q, name):
        e4, row, block = fp8_dtype(q.fmt, "input"), (1, 128), (128, 128)
        (x32,), (w32,) = q.take([x], name, "input"), q.take([w], name, "weight")
        ctx.save_for_backward(x32, w32)
        ctx.q, ctx.name = q, name
        qx, qw = tiles(x32, e4, row), tiles(w32, e4, block)
        few_flips([qx, qw], [tiles(x.detach(), e4, row), tiles(w.detach(), e4, block)], f"{name} input, weight")
        return qx @ qw.t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        q = ctx.q
        e4, eg, row = fp8_dtype(q.fmt, "input"), fp8_dtype(q.fmt, "grad_output"), (1, 128)
        (dy32,) = q.take([dy], ctx.name, "grad_output")
        qdy = tiles(dy32, eg, row)
        few_flips([qdy], [tiles(dy, eg, row)], f"{ctx.name} grad_output")
        dx = qdy @ tiles(w, e4, (128, 128))
        dw = tiles(dy32.t().contiguous(), eg, row) @ tiles(x.t().contiguous(), e4, row).t()
        return dx, dw, None, None


def fp8_gemms(q, name, xs, ws, fan_out: int = 1):
    """Per rank ``Q(x_r) Q(w_r)^T``, every role quantized together over the ranks; output gradients too.
    ``fan_out``: one product used by that many ranks, each rank's gradient quantized on its own, then summed."""
    if q.blockwise:  # one rank: no scales to agree on
        return tuple(BlockwiseGemm.apply(x, w, q, name) for x, w in zip(xs, ws))
    qx = QuantizeForward.apply(q, name, "input", *xs)
    qw = QuantizeForward.apply(q, name, "weight", *ws)
    return QuantizeGrad.apply(q, name, *[a @ b.t() for a, b in zip(qx, qw)] * fan_out)


def rms_norm(x, weight):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rope(x, positions):
    """DeepSeek's interleaved pairs (evens then odds), then the rotate-half rotation; float64 angles."""
    x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    inv_freq = 1.0 / BASE ** (torch.arange(0, POS, 2, dtype=torch.float64) / POS)
    angles = positions[:, None].double() * inv_freq[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    half = POS // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def reference(w, x, dy, q: Quantizer, tp: int):
    """Output and gradients (x and every parameter) of the layer split over ``tp`` ranks, emulated in float64;
    ``w``: the full weights by name."""
    w = {k: v.double().requires_grad_() for k, v in w.items()}
    x = x.double().requires_grad_()
    t = x.reshape(S * B, H)
    heads = N // tp
    # a down-projection: whole on every rank; each rank's copy of the output takes its heads' gradient
    kva_r = fp8_gemms(q, "kv_a_proj_with_mqa", [t], [w["kv_a_proj_with_mqa.weight"]], fan_out=tp)
    rows = lambda name, r, width: w[name][r * heads * width:(r + 1) * heads * width]  # noqa: E731
    if "q_proj.weight" in w:  # x through f: every rank's copy takes its heads' gradient
        qs = fp8_gemms(q, "q_proj", [t] * tp, [rows("q_proj.weight", r, QK + POS) for r in range(tp)])
    else:
        qa_r = fp8_gemms(q, "q_a_proj", [t], [w["q_a_proj.weight"]], fan_out=tp)
        qs = fp8_gemms(q, "q_b_proj", [rms_norm(a, w["q_a_layernorm.weight"]) for a in qa_r],
                       [rows("q_b_proj.weight", r, QK + POS) for r in range(tp)])
    kvs = fp8_gemms(q, "kv_b_proj", [rms_norm(a[:, :KVL], w["kv_a_layernorm.weight"]) for a in kva_r],
                    [rows("kv_b_proj.weight", r, QK + V) for r in range(tp)])
    positions = torch.arange(S)
    ctxs = []
    for r in range(tp):
        qh = qs[r].view(S, B, heads, QK + POS).permute(1, 2, 0, 3)
        kvh = kvs[r].view(S, B, heads, QK + V).permute(1, 2, 0, 3)
        k_pos = rope(kva_r[r][:, KVL:].view(S, B, POS).permute(1, 0, 2).unsqueeze(1), positions)
        qq = torch.cat((qh[..., :QK], rope(qh[..., QK:], positions)), -1)
        kk = torch.cat((kvh[..., :QK], k_pos.expand(-1, heads, -1, -1)), -1)
        scores = qq @ kk.transpose(-1, -2) * (QK + POS) ** -0.5
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        ctx = scores.softmax(-1) @ kvh[..., QK:]  # [b, heads, s, v]
        ctxs.append(ctx.permute(2, 0, 1, 3).reshape(S * B, heads * V))
    wo = w["o_proj.weight"]
    outs = fp8_gemms(q, "o_proj", ctxs, [wo[:, r * heads * V:(r + 1) * heads * V] for r in range(tp)])
    out = sum(outs).view(S, B, H)  # each rank's partial gets the whole output gradient, quantized once
    out.backward(dy.double())
    return out.detach(), x.grad, {k: v.grad for k, v in w.items()}


def full_weights(cfg) -> dict:
    torch.manual_seed(0)
    layer = build(cfg, ParallelGroup.single("tp"))
    return {k: v.detach().clone() for k, v in layer.named_parameters()}


def build(cfg, tp) -> MLASelfAttention:
    torch.manual_seed(0)  # every TP size draws the same full weights
    init = init_method_normal(0.1)
    layer = MLASelfAttention(cfg, tp=tp, init_method=init, output_init_method=init)
    with torch.no_grad():  # norm weights that are not all ones, so their gradients matter
        if cfg.q_lora_rank is not None:
            layer.q_a_layernorm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
        layer.kv_a_layernorm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    return layer


def data(step: int):
    g = torch.Generator().manual_seed(10 + step)
    scale = (1.0, 3.0, 0.5)[step]
    return torch.randn(S, B, H, generator=g) * scale, torch.randn(S, B, H, generator=g) * 1e-2 * scale


def run(layer, x, dy, tp: ParallelGroup, sp: bool):
    """This rank's output and the full-layer gradients (x's and every weight's, put back together over TP)."""
    n, r = tp.size, tp.rank
    for p in layer.parameters():
        p.grad = None
    xl = (part(x, 0, r, n) if sp else x).clone().requires_grad_()
    out = layer(xl)
    out.backward(part(dy, 0, r, n) if sp else dy)
    allreduce_tp_partial_grads(layer, tp)  # the down-projections' and norms' gradients: partial over heads
    grads = {}
    for name, p in layer.named_parameters():
        grads[name] = p.grad
        if getattr(p, "tensor_model_parallel", False) and n > 1:
            gathered = [torch.empty_like(p.grad) for _ in range(n)]
            torch.distributed.all_gather(gathered, p.grad.contiguous(), group=tp.group)
            grads[name] = torch.cat(gathered, p.partition_dim)
    return out.detach(), xl.grad, grads


def close(got, ref, what: str) -> None:
    err = (got.double() - ref).abs().max().item()
    bound = 2e-6 * ref.abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3e} beyond fp32 rounding ({bound:.3e})"


def check(tp: ParallelGroup, recipe: str, fmt: str, q_lora_rank) -> None:
    n, r = tp.size, tp.rank
    sp = n > 1
    cfg = config(sequence_parallel=sp, q_lora_rank=q_lora_rank)
    weights = full_weights(config(q_lora_rank=q_lora_rank))
    layer = build(cfg, tp)
    names = linears(layer)
    x0, dy0 = data(0)
    bf16 = run(layer, x0, dy0, tp, sp)
    attach_fp8(layer, FP8Recipe(fmt, recipe))
    assert len(fp8_states(layer)) == len(names)
    scales = None
    for step in range(2 if recipe == "delayed" else 1):
        x, dy = data(step)
        with recording(layer) as seen:
            y, dx, dw = run(layer, x, dy, tp, sp)
        q = Quantizer(fmt, every_rank(seen, tp), scales, recipe == "blockwise")
        if recipe == "delayed" and scales is None:  # the first step: scale 1
            q.scales = {name: {role: torch.tensor(1.0) for role in ROLES} for name in names}
        y_ref, dx_ref, dw_ref = reference(weights, x, dy, q, n)
        close(y, part(y_ref, 0, r, n) if sp else y_ref, f"{recipe} {fmt} step {step} output")
        close(dx, part(dx_ref, 0, r, n) if sp else dx_ref, f"{recipe} {fmt} step {step} input gradient")
        for name, g in dw.items():
            close(g, dw_ref[name], f"{recipe} {fmt} step {step} {name} gradient")
        if step == 0:  # fp8 engaged: far from the 16-bit layer
            for got, base in ((y, bf16[0]), (dx, bf16[1])):
                rel = ((got - base).norm() / base.norm()).item()
                assert rel > 1e-2, f"{recipe} {fmt}: fp8 within {rel:.1e} of 16-bit (fp8 off?)"
        update_delayed_scaling(fp8_states(layer), {"dense": [tp]})
        if recipe != "delayed":
            break
        scales = {name: {role: torch.tensor(MAX[fp8_dtype(fmt, role)]) / q.amax[name, role] for role in ROLES}
                  for name in names}


@pytest.mark.parametrize("recipe,fmt,q_lora_rank", TP1_CASES)
def test_fp8_mla_equals_float64_emulation_tp1(recipe, fmt, q_lora_rank):
    check(ParallelGroup.single("tp"), recipe, fmt, q_lora_rank)


def _tp2():
    with tp_group(2) as (g, _, _):
        for case in CASES:
            check(g, *case)


def test_fp8_mla_equals_float64_emulation_tp2_sequence_parallel():
    run_on_ranks(2, _tp2)
