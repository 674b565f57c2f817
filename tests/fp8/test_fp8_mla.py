"""Multi-latent attention with fp8 against a float64 emulation of the recipe written here, at TP 1 and at TP 2 with
sequence parallelism (gloo ranks).

Every projection is fp8, the down-projections too (megatron-core builds them as Transformer Engine linears, fp8
under its autocast).  The reference is the layer's arithmetic in float64 from its definition (RMSNorm, DeepSeek's
interleaved RoPE, causal softmax), each projection ``Q(X) Q(W)^T`` with ``dX = Q(dY) Q(W)``, ``dW = Q(dY)^T Q(X)``,
``Q`` the recipe's quantization (``ref_quantize`` of test_fp8_linear).  It is written per TP rank: rank r's heads
take the rows r of the up-projections and the columns r of ``o_proj``; the tensors a TP layer splits are quantized
with one scale agreed over the ranks (the whole tensor's), and the down-projections' output gradients, partial sums
over each rank's heads, are quantized per rank with the largest amax's scale, then summed.  Output and gradients
must equal the reference to fp32 rounding (relative 2e-6 of the tensor's largest value), and differ from the
16-bit layer by far more (every projection in fp8: dropping any one of them from fp8 fails the comparison).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tensor_parallel"))
from harness import run_on_ranks  # noqa: E402
from test_fp8_linear import MAX, fp8_dtype, ref_quantize  # noqa: E402
from tp_helpers import part, tp_group  # noqa: E402

from ds_megatron.fp8 import FP8Recipe, update_delayed_scaling  # noqa: E402
from ds_megatron.models import GPTConfig  # noqa: E402
from ds_megatron.parallel_state import ParallelGroup  # noqa: E402
from ds_megatron.tensor_parallel import allreduce_tp_partial_grads, init_method_normal  # noqa: E402
from ds_megatron.tensor_parallel.layers import attach_fp8, fp8_states  # noqa: E402
from ds_megatron.transformer.multi_latent_attention import MLASelfAttention  # noqa: E402

# tokens, batch, hidden, heads; q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim.  Blockwise:
# widths it tiles at TP 1 (128 tokens; kv_lora_rank + qk_pos_emb_head_dim = 160 leaves a partial tile).  A check
# sets the module's sizes (``use_sizes``) before it builds anything.
SIZES = {"small": dict(S=32, B=2, H=64, N=4, QL=32, KVL=32, QK=16, POS=8, V=16),
         "blockwise": dict(S=64, B=2, H=128, N=4, QL=128, KVL=128, QK=32, POS=32, V=32)}
S = B = H = N = QL = KVL = QK = POS = V = 0
EPS, BASE = 1e-6, 500.0
CASES = [("tensorwise", "e4m3"), ("tensorwise", "hybrid"), ("delayed", "hybrid")]
TP1_CASES = CASES + [("blockwise", "hybrid")]
LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
ROLES = ("input", "weight", "grad_output")


def use_sizes(name: str) -> None:
    globals().update(SIZES[name])


def config(**extra) -> GPTConfig:
    return GPTConfig(num_layers=1, hidden_size=H, num_attention_heads=N, seq_length=S, vocab_size=64,
                     hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope", rotary_base=BASE,
                     normalization="RMSNorm", norm_epsilon=EPS, add_bias_linear=False, multi_latent_attention=True,
                     q_lora_rank=QL, kv_lora_rank=KVL, qk_head_dim=QK, qk_pos_emb_head_dim=POS, v_head_dim=V, **extra)


class Quantizer:
    """The recipe's ``Q`` for the reference: per (linear, role) a given scale (delayed) or the joint amax's, and
    the amaxes seen (MAX over the tensors quantized together), for the next delayed step."""

    def __init__(self, fmt: str, scales=None, blockwise: bool = False):
        self.fmt, self.scales, self.amax, self.blockwise = fmt, scales, {}, blockwise

    def __call__(self, ts, name: str, role: str):
        dtype = fp8_dtype(self.fmt, role)
        a = max(t.float().abs().max() for t in ts)
        self.amax[name, role] = torch.maximum(self.amax.get((name, role), a), a)
        scale = self.scales[name][role] if self.scales else torch.tensor(MAX[dtype], dtype=torch.float32) / a
        return [ref_quantize(t.reshape(-1, t.size(-1)), dtype, scale).reshape(t.shape) for t in ts]


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
    """One rank's blockwise GEMMs: 1x128 tiles along each GEMM's reduction dimension (x and dy by features, then
    by tokens for the weight gradient), 128x128 weight blocks."""

    @staticmethod
    def forward(ctx, x, w, fmt):
        e4, row = fp8_dtype(fmt, "input"), (1, 128)
        ctx.save_for_backward(x, w)
        ctx.fmt = fmt
        return tiles(x, e4, row) @ tiles(w, e4, (128, 128)).t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        e4, eg, row = fp8_dtype(ctx.fmt, "input"), fp8_dtype(ctx.fmt, "grad_output"), (1, 128)
        dx = tiles(dy, eg, row) @ tiles(w, e4, (128, 128))
        dw = tiles(dy.t().contiguous(), eg, row) @ tiles(x.t().contiguous(), e4, row).t()
        return dx, dw, None


def fp8_gemms(q, name, xs, ws, fan_out: int = 1):
    """Per rank ``Q(x_r) Q(w_r)^T``, every role quantized together over the ranks; output gradients too.
    ``fan_out``: one product used by that many ranks, each rank's gradient quantized on its own, then summed."""
    if q.blockwise:  # one rank: no scales to agree on
        return tuple(BlockwiseGemm.apply(x, w, q.fmt) for x, w in zip(xs, ws))
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
    # the down-projections: whole on every rank; each rank's copy of the output takes its heads' gradient
    qa_r = fp8_gemms(q, "q_a_proj", [t], [w["q_a_proj.weight"]], fan_out=tp)
    kva_r = fp8_gemms(q, "kv_a_proj_with_mqa", [t], [w["kv_a_proj_with_mqa.weight"]], fan_out=tp)
    rows = lambda name, r, width: w[name][r * heads * width:(r + 1) * heads * width]  # noqa: E731
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


def check(tp: ParallelGroup, recipe: str, fmt: str) -> None:
    use_sizes("blockwise" if recipe == "blockwise" else "small")
    n, r = tp.size, tp.rank
    sp = n > 1
    cfg = config(sequence_parallel=sp)
    weights = full_weights(config())
    layer = build(cfg, tp)
    x0, dy0 = data(0)
    bf16 = run(layer, x0, dy0, tp, sp)
    attach_fp8(layer, FP8Recipe(fmt, recipe))
    assert len(fp8_states(layer)) == len(LINEARS)
    scales = None
    for step in range(2 if recipe == "delayed" else 1):
        x, dy = data(step)
        q = Quantizer(fmt, scales, recipe == "blockwise")
        if recipe == "delayed" and scales is None:  # the first step: scale 1
            q.scales = {name: {role: torch.tensor(1.0) for role in ROLES} for name in LINEARS}
        y_ref, dx_ref, dw_ref = reference(weights, x, dy, q, n)
        y, dx, dw = run(layer, x, dy, tp, sp)
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
                  for name in LINEARS}


@pytest.mark.parametrize("recipe,fmt", TP1_CASES)
def test_fp8_mla_equals_float64_emulation_tp1(recipe, fmt):
    check(ParallelGroup.single("tp"), recipe, fmt)


def _tp2():
    with tp_group(2) as (g, _, _):
        for recipe, fmt in CASES:
            check(g, recipe, fmt)


def test_fp8_mla_equals_float64_emulation_tp2_sequence_parallel():
    run_on_ranks(2, _tp2)
