"""Why fp8 "e4m3" (gradients in E4M3, one scale per tensor) trains worse than "hybrid" (E5M2 gradients): per linear,
how much of its output gradient dY underflows to 0 and how far its weight gradient lands from the exact one.

    python launch/bench/bench_fp8_grad_underflow.py [--config ds_configs/gpt_bf16_tp2_dp2.json] [--hidden 128,256]
        [--steps 100] [--every 10] [--train-fp8 e4m3|hybrid]

For each ``--hidden``: the config's model on one process in bf16 (fp32 main params, AdamW with the config's lr
schedule, clipping and micro-batch; DP 2's global batch as two micro-batches), trained ``--steps`` steps in plain
bf16.  Every ``--every`` steps the first micro-batch's input X and output gradient dY of each transformer linear are
kept, and quantized as the tensorwise recipe does (``scale = fp8_max / amax(dY)``, the amax of the whole tensor, as
agreed over TP): the fraction of dY's nonzero elements that become 0 in E4M3 and in E5M2, and the relative error
(Frobenius) of the weight gradient ``dY^T X`` against float64's, for bf16 (the GEMM on bf16 operands), e4m3, hybrid
and e4m3 with only the underflow (dY's underflowed elements zeroed, the rest exact): the last shows how much of
e4m3's error the underflow is; and the data gradient ``dY W``'s for e4m3 and hybrid.  The fused QKV's dY is also
split into its q, k and v parts.  Means over the measured steps are printed per layer and linear.  ``--train-fp8``
trains the model with that ``model.fp8`` (tensorwise) instead of bf16, measuring along its own trajectory.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from ds_megatron.config import split_config  # noqa: E402
from ds_megatron.fp8.quantize import cast, scale_from_amax  # noqa: E402
from ds_megatron.fp8.recipe import E4M3_MAX, E5M2_MAX  # noqa: E402
from ds_megatron.models.gpt import GPTModel  # noqa: E402
from ds_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from ds_megatron.training.build import build_datasets  # noqa: E402
from ds_megatron.training.lr_schedule import lr_at  # noqa: E402

FORMATS = {"e4m3": (torch.float8_e4m3fn, E4M3_MAX), "e5m2": (torch.float8_e5m2, E5M2_MAX)}


def dequantized(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 ``t`` through the tensorwise recipe's fp8 copy (one scale from the whole tensor's amax)."""
    dtype, fp8_max = FORMATS[fmt]
    scale = scale_from_amax(t.abs().amax().float(), fp8_max)
    return cast(t, scale, dtype).double() / scale.double()


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def measure(x: torch.Tensor, dy: torch.Tensor, w: torch.Tensor, qkv_heads: int = 0) -> dict:
    """The statistics of one linear's ``x [T, in]``, ``dy [T, out]`` and weight ``w [out, in]`` (bf16, as the layer
    saw them)."""
    nonzero = dy != 0
    q = {fmt: dequantized(dy, fmt) for fmt in FORMATS}
    lost = {fmt: nonzero & (q[fmt] == 0) for fmt in FORMATS}
    out = {f"underflow_{fmt}": (lost[fmt].sum() / nonzero.sum()).item() for fmt in FORMATS}
    xd, dyd = x.double(), dy.double()
    ref = dyd.t() @ xd
    qx = dequantized(x, "e4m3")
    out["dW_bf16"] = rel(dy.t() @ x, ref)
    out["dW_e4m3"] = rel(q["e4m3"].t() @ qx, ref)
    out["dW_hybrid"] = rel(q["e5m2"].t() @ qx, ref)
    out["dW_e4m3_underflow_only"] = rel(torch.where(lost["e4m3"], 0.0, dyd).t() @ xd, ref)
    dx_ref, qw = dyd @ w.double(), dequantized(w, "e4m3")
    out["dX_e4m3"], out["dX_hybrid"] = rel(q["e4m3"] @ qw, dx_ref), rel(q["e5m2"] @ qw, dx_ref)
    if qkv_heads:  # MHA's fused rows: per head [q, k, v], each head_dim wide
        parts = lost["e4m3"].reshape(dy.size(0), qkv_heads, 3, -1)
        nz = nonzero.reshape(parts.shape)
        rows = lambda t: t.reshape(qkv_heads, 3, -1, t.size(-1))  # noqa: E731  (dW's rows per head and part)
        dws = {k: rows(v) for k, v in (("ref", ref), ("e4m3", q["e4m3"].t() @ qx), ("hybrid", q["e5m2"].t() @ qx))}
        for i, name in enumerate("qkv"):
            out[f"underflow_e4m3_{name}"] = (parts[:, :, i].sum() / nz[:, :, i].sum()).item()
            for fmt in ("e4m3", "hybrid"):
                out[f"dW_{fmt}_{name}"] = rel(dws[fmt][:, i], dws["ref"][:, i])
        amax = dy.abs().reshape(parts.shape).amax(dim=(0, 1, 3)).float()
        out["amax_q_k_v_over_amax"] = [round((a / amax.max()).item(), 4) for a in amax]
    return out


def run(base: dict, hidden: int, steps: int, every: int, train_fp8) -> tuple:
    cfg = json.loads(json.dumps(base))
    cfg["megatron"]["model"]["hidden_size"] = hidden
    if train_fp8:
        cfg["megatron"]["model"].update(fp8=train_fp8, fp8_recipe="tensorwise")
    cfg["megatron"]["train"].update(output_dir="/tmp/bench_fp8_grad_underflow")
    _, mc = split_config(cfg)
    model_cfg, tcfg = mc.model, mc.train
    micro, dp = cfg["train_micro_batch_size_per_gpu"], 2  # the bench's TP 2 x DP 2: 2 micro-batches per step
    torch.manual_seed(tcfg.seed)
    model = GPTModel(model_cfg).bfloat16()
    params = [p for p in model.parameters() if p.requires_grad]
    main = [p.detach().float().clone().requires_grad_() for p in params]
    decay = [m for m, p in zip(main, params) if p.dim() > 1]
    no_decay = [m for m, p in zip(main, params) if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tcfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tcfg.lr, betas=(tcfg.adam_beta1, tcfg.adam_beta2))
    train_ds, _ = build_datasets(mc, micro * dp, micro * dp)
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and name.startswith("layers.")}
    heads = model_cfg.num_attention_heads
    kept, records, losses = {}, collections.defaultdict(list), []

    def hook(name):
        def forward_hook(module, inputs, output):
            if kept.get("on"):
                x = inputs[0].detach()
                y = output[0] if isinstance(output, tuple) else output
                y.register_hook(lambda g: kept.__setitem__(name, (x.reshape(-1, x.size(-1)),
                                                                  g.detach().reshape(-1, g.size(-1)))))
        return forward_hook

    for name, m in linears.items():
        m.register_forward_hook(hook(name))
    gradient_clipping = cfg.get("gradient_clipping", 0.0)
    for step in range(steps):
        for p in params:
            p.grad = None
        for i in range(dp):
            samples = [train_ds[(step * dp + i) * micro + j] for j in range(micro)]
            tokens = torch.stack([s["tokens"] for s in samples])
            labels = torch.stack([s["labels"] for s in samples])
            kept["on"] = step % every == 0 and i == 0
            loss = model(tokens, labels) / dp
            loss.backward()
            losses.append(loss.item())
            kept["on"] = False
        for name in linears:
            if name in kept:
                x, dy = kept.pop(name)
                qkv_heads = heads if name.endswith("query_key_value") else 0
                records[name].append(measure(x, dy, linears[name].weight.detach(), qkv_heads))
        for m, p in zip(main, params):
            m.grad = p.grad.float()
        if gradient_clipping:
            torch.nn.utils.clip_grad_norm_(main, gradient_clipping)
        for group in opt.param_groups:
            group["lr"] = lr_at(step + 1, tcfg.lr, tcfg.min_lr, tcfg.lr_warmup_iters,
                                tcfg.lr_decay_iters or tcfg.train_iters)
        opt.step()
        if (step + 1) % 10 == 0:
            print(f"hidden {hidden}: step {step + 1}, loss {losses[-1] * dp:.4f}", file=sys.stderr, flush=True)
        with torch.no_grad():
            for m, p in zip(main, params):
                p.copy_(m)
    return records, [sum(losses[i:i + dp]) for i in range(0, len(losses), dp)]


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "ds_configs", "gpt_bf16_tp2_dp2.json"))
    p.add_argument("--hidden", default="128,256")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--train-fp8", choices=("e4m3", "hybrid"), help="train with this model.fp8 instead of bf16")
    args = p.parse_args()
    torch.set_num_threads(1)  # one process per --hidden can run side by side
    with open(args.config) as f:
        base = json.load(f)
    keys = ("underflow_e4m3", "underflow_e5m2", "dW_bf16", "dW_e4m3", "dW_hybrid", "dW_e4m3_underflow_only",
            "dX_e4m3", "dX_hybrid")
    for hidden in (int(h) for h in args.hidden.split(",")):
        records, losses = run(base, hidden, args.steps, args.every, args.train_fp8)
        n = len(next(iter(records.values())))
        print(f"\nhidden {hidden}, trained in {args.train_fp8 or 'bf16'}: training loss of the last 10 steps "
              f"{sum(losses[-10:]) / len(losses[-10:]):.4f}; means over {n} measured steps "
              f"(0, {args.every}, ... < {args.steps})\nunderflow: the share of dY's nonzero elements that become 0; "
              f"dW_* (dX_*): ||dW - dW_float64|| / ||dW_float64||")
        print(f"{'linear':<40}" + "".join(f"{k[:12]:>13}" for k in keys))
        for name, rows in records.items():
            print(f"{name:<40}" + "".join(f"{mean(rows, k):>13.4%}" for k in keys))
            if "underflow_e4m3_q" in rows[0]:
                for what in ("underflow_e4m3", "dW_e4m3", "dW_hybrid"):
                    print(f"{'  q / k / v ' + what:<40}"
                          + "".join(f"{mean(rows, f'{what}_{c}'):>13.4%}" for c in "qkv"))
                print(f"  amax(q, k, v) / amax(dY) at each measured step: {[r['amax_q_k_v_over_amax'] for r in rows]}")
        worst = max(((r["underflow_e4m3"], i * args.every, name) for name, rows in records.items()
                     for i, r in enumerate(rows)))
        print(f"largest e4m3 underflow of one linear at one measured step: {worst[0]:.4%} (step {worst[1]}, "
              f"{worst[2]})")
        for k in keys:
            print(f"all linears {k}: {sum(mean(rows, k) for rows in records.values()) / len(records):.4%}")


if __name__ == "__main__":
    main()
