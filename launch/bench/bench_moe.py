"""Tokens/s of the MoE layer for EP=1/2/4 with both dispatchers, and grouped vs sequential experts, in one run.

    python launch/bench/bench_moe.py [--hidden 256 --ffn 512 --experts 8 --topk 2 --tokens 1024 --steps 10] [--json]

Part 1: the MoE layer (router, dispatch, experts, combine; forward + backward)
as a gloo job of EP ranks (weak scaling: every rank routes ``--tokens`` tokens,
so tokens/s counts EP x tokens per step), one job per (EP, dispatcher).
Part 2: one rank, ``GroupedMLP`` (with ``torch._grouped_mm``, and with the
padded ``bmm``) against ``SequentialMLP`` on the same routed tokens.  Ratios are against EP=1 with the
all-to-all dispatcher, and sequential / grouped.  On a CPU box the EP ranks
share the same few cores: the ratios show the cost of the dispatch, not a
speed-up.
Part 3: one rank, DeepSeek-V3's pieces beside today's: the MoE layer routed by softmax top-k, by sigmoid with
the expert bias, and by sigmoid with the bias and group-limited top-k (same experts and top-k, so the same
expert FLOPs; ``--groups`` groups of which ``--group-topk`` are kept), and multi-latent attention beside
standard attention of the same hidden size and heads (parameters and forward FLOPs per token printed with each).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_megatron.integration.local_job import run_local_job  # noqa: E402


def _layer_config(args, dispatcher: str, grouped: bool, **routing):
    from ds_megatron.models import GPTConfig
    return GPTConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=4, ffn_hidden_size=args.ffn,
                     num_experts=args.experts, moe_router_topk=args.topk, moe_aux_loss_coeff=0.01,
                     moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped, hidden_dropout=0.0,
                     attention_dropout=0.0, **routing)


def _time_layer(layer, x, steps: int) -> float:
    """Seconds per forward + backward step (after two warm-up steps)."""
    import torch
    for i in range(steps + 2):
        if i == 2:
            t0 = time.perf_counter()
        x.grad = None
        out = layer(x)
        (out.square().mean() + layer.aux_loss).backward()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return (time.perf_counter() - t0) / steps


def _ep_tokens_per_s(args, dispatcher):
    """Rank 0: tokens/s of the whole EP group (every rank routes ``args.tokens`` tokens)."""
    import torch
    import torch.distributed as dist
    from ds_megatron.moe import MoELayer
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    rank, world = dist.get_rank(), dist.get_world_size()
    state = ParallelState.build(ParallelLayout(world_size=world, ep=world, etp=1))
    torch.manual_seed(0)
    layer = MoELayer(_layer_config(args, dispatcher, None), parallel_state=state)
    x = torch.randn(args.tokens, 1, args.hidden, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    sec = _time_layer(layer, x, args.steps)
    state.destroy()
    return world * args.tokens / sec


def bench_ep(args, ep: int, dispatcher: str) -> float:
    return run_local_job(ep, _ep_tokens_per_s, args, dispatcher, timeout=600)


def bench_experts(args) -> dict:
    """Tokens/s of the whole layer on one rank with grouped and with sequential experts."""
    import torch
    from ds_megatron.moe import MoELayer
    torch.set_num_threads(1)
    out = {}
    for name, grouped, grouped_mm in (("grouped_mm", True, True), ("grouped_bmm", True, False),
                                      ("sequential", False, None)):
        torch.manual_seed(0)
        layer = MoELayer(_layer_config(args, "alltoall", grouped))
        if grouped:
            layer.experts.use_grouped_mm = grouped_mm
        x = torch.randn(args.tokens, 1, args.hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)
        out[name] = args.tokens / _time_layer(layer, x, args.steps)
    return out


def bench_routing(args) -> dict:
    """Tokens/s of the whole MoE layer on one rank under each routing rule (same experts, same top-k)."""
    import torch
    from ds_megatron.moe import MoELayer
    torch.set_num_threads(1)
    rules = {"softmax top-k": {},
             "sigmoid + expert bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
             "sigmoid + bias + group top-k": dict(moe_router_score_function="sigmoid",
                                                  moe_router_enable_expert_bias=True,
                                                  moe_router_num_groups=args.groups,
                                                  moe_router_group_topk=args.group_topk)}
    out = {}
    for name, extra in rules.items():
        torch.manual_seed(0)
        layer = MoELayer(_layer_config(args, "alltoall", None, **extra))
        x = torch.randn(args.tokens, 1, args.hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)
        out[name] = args.tokens / _time_layer(layer, x, args.steps)
    return out


def bench_attention(args) -> dict:
    """(tokens/s, parameters, forward FLOPs per token) of standard attention and of MLA, one rank, seq --seq."""
    import torch
    from ds_megatron.models import GPTConfig
    from ds_megatron.parallel_state import ParallelState
    from ds_megatron.transformer.attention import ParallelAttention
    from ds_megatron.transformer.multi_latent_attention import MLASelfAttention
    torch.set_num_threads(1)
    h, n = args.hidden, 4
    d = h // n
    common = dict(num_layers=1, hidden_size=h, num_attention_heads=n, seq_length=args.seq, hidden_dropout=0.0,
                  attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm")
    # MLA sized as DeepSeek-V3 relative to its heads: q rank 3/2 h, kv rank h/2, nope d, rope d/2, v d.
    mla = dict(multi_latent_attention=True, q_lora_rank=3 * h // 2, kv_lora_rank=h // 2, qk_head_dim=d,
               qk_pos_emb_head_dim=d // 2, v_head_dim=d, add_bias_linear=False)
    s = args.seq
    out = {}
    for name, cls, extra in (("standard", ParallelAttention, {}), ("multi-latent", MLASelfAttention, mla)):
        config = GPTConfig(**common, **extra)
        torch.manual_seed(0)
        init = torch.nn.init.xavier_normal_
        attn = cls(config, tp=ParallelState.single().tp, init_method=init, output_init_method=init)
        params = sum(p.numel() for p in attn.parameters() if p.dim() > 1)
        qk = (config.qk_head_dim + config.qk_pos_emb_head_dim) if extra else d
        v = config.v_head_dim if extra else d
        flops = 2 * params + 2 * n * s * (qk + v)  # the projections, then QK^T and PV over s keys (no causal halving)
        x = torch.randn(s, args.tokens // s, h, generator=torch.Generator().manual_seed(0), requires_grad=True)

        class Wrapped(torch.nn.Module):  # _time_layer's call: output and aux_loss
            aux_loss = 0.0

            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, y):
                return self.inner(y)
        out[name] = (args.tokens / _time_layer(Wrapped(attn), x, args.steps), params, flops)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="tokens routed per rank per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--groups", type=int, default=4, help="expert groups of group-limited routing")
    p.add_argument("--group-topk", type=int, default=2, help="groups kept per token")
    p.add_argument("--seq", type=int, default=256, help="sequence length of the attention comparison")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = p.parse_args(argv)

    ep_results = {(ep, d): bench_ep(args, ep, d) for ep in args.ep for d in ("alltoall", "allgather")}
    experts = bench_experts(args)
    routing = bench_routing(args)
    attention = bench_attention(args)
    base = ep_results[(args.ep[0], "alltoall")]
    if args.json:
        print(json.dumps({"ep": [{"ep": ep, "dispatcher": d, "tokens_per_s": v, "ratio": v / base}
                                 for (ep, d), v in ep_results.items()],
                          "experts": {**experts, "sequential_over_grouped_bmm":
                                      experts["sequential"] / experts["grouped_bmm"]},
                          "routing": routing,
                          "attention": {k: {"tokens_per_s": t, "params": p, "flops_per_token": f}
                                        for k, (t, p, f) in attention.items()}}))
        return 0
    print(f"MoE layer: hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, top-{args.topk}, "
          f"{args.tokens} tokens/rank, fp32, forward+backward, 1 thread per rank, {os.cpu_count()} CPU cores")
    print(f"{'EP':>3} {'dispatcher':>10} {'tokens/s':>10} {'ratio':>6}")
    for (ep, d), v in ep_results.items():
        print(f"{ep:>3} {d:>10} {v:>10,.0f} {v / base:>6.2f}")
    seq = experts["sequential"]
    print("experts on one rank (whole layer, EP=1): " + ", ".join(
        f"{k} {v:,.0f} tokens/s ({v / seq:.2f}x sequential)" for k, v in experts.items()))
    first = next(iter(routing.values()))
    print(f"routing on one rank (whole layer, same experts and top-{args.topk}; groups {args.groups}, "
          f"top-{args.group_topk} groups): " + ", ".join(f"{k} {v:,.0f} tokens/s ({v / first:.2f}x)"
                                                        for k, v in routing.items()))
    std = attention["standard"]
    print(f"attention on one rank (hidden {args.hidden}, 4 heads, seq {args.seq}, forward+backward):")
    for k, (t, params, flops) in attention.items():
        print(f"  {k:>12}: {t:>9,.0f} tokens/s ({t / std[0]:.2f}x), {params:,} weights, "
              f"{flops / 1e6:.2f} MFLOP/token forward ({flops / std[2]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
