"""Per-rank optimizer-state memory with and without the distributed optimizer, measured on the tensors.

    python launch/bench/bench_optimizer_memory.py [--dp 2 4] [--layers 20 --hidden 1024 --precision bf16]

For each DP size, one gloo job of DP ranks (spawned here) builds the same
model (``layers`` x Linear(hidden, hidden), ~21M params by default) twice
through ``ds_megatron.initialize`` with AdamW, once with the non-distributed
optimizer (``Float16OptimizerWithFloat16Params``, or ``FP32Optimizer`` for
``--precision fp32``) and once with ``"use_distributed_optimizer": true``,
takes one ``engine(batch) / engine.backward / engine.step`` so that Adam's
state exists, and sums ``numel * element_size`` over

* main params: the fp32 copies (or shards) of the 16-bit params;
* optimizer state: every tensor in the inner optimizer's state (exp_avg,
  exp_avg_sq, step);

(``MegatronOptimizer.state_bytes``).  Printed per DP size: the largest and the
smallest rank, and the ratio distributed / non-distributed next to 1/DP; the
gap to 1/DP is the alignment padding of the buffers (params start at multiples
of 64 elements, buckets end at multiples of lcm(DP, 128)) and the per-param
step counters, which every rank holding a piece of a param keeps.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_megatron.integration.local_job import run_local_job  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grad_sync import mlp_stack  # noqa: E402  (the same model as the grad-sync benchmark)


def _measure(args):
    """One rank's part; rank 0's return value is the table."""
    import torch
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    import ds_megatron

    precision = {"bf16": {"bf16": {"enabled": True}}, "fp32": {}}[args.precision]
    x = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(rank))
    row = {}
    for name, megatron in (("non-distributed", {}), ("distributed", {"use_distributed_optimizer": True})):
        cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "gradient_clipping": 1.0,
               "steps_per_print": 10 ** 9, "megatron": megatron, **precision}
        state = ds_megatron.initialize_model_parallel(cfg)
        model = mlp_stack(args.layers, args.hidden)
        numel = sum(p.numel() for p in model.parameters())
        engine, optimizer, _, _ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
        loss = engine(x.to(next(model.parameters()).dtype)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        measured = optimizer.state_bytes()
        per_rank = [None] * world
        dist.all_gather_object(per_rank, measured)
        row[name] = (type(optimizer).__name__, per_rank)
        if engine.megatron.ddp_in_engine is not None:
            engine.megatron.ddp_in_engine.detach()
        state.destroy()
        del engine, optimizer, model
    return numel, row


def run(world: int, args):
    return run_local_job(world, _measure, args)


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:10.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    args = ap.parse_args(argv)
    for world in args.dp:
        numel, row = run(world, args)
        print(f"\nDP={world}: {numel / 1e6:.1f}M {args.precision} params, AdamW; per-rank bytes measured on the "
              "tensors after one step (MiB)")
        print(f"{'optimizer':52s} {'rank':>9s} {'main params':>11s} {'Adam state':>10s} {'total':>10s} "
              f"{'x non-dist':>10s}")
        ref_total = max(b["total"] for b in row["non-distributed"][1])
        for name, (cls, per_rank) in row.items():
            ranks = sorted(range(world), key=lambda r: per_rank[r]["total"])
            for label, r in (("max", ranks[-1]), ("min", ranks[0])):
                b = per_rank[r]
                print(f"{name + ' (' + cls + ')':52s} {label + ' r' + str(r):>9s} {_mib(b['main_params']):>11s} "
                      f"{_mib(b['optimizer_state'])} {_mib(b['total'])} {b['total'] / ref_total:10.5f}")
        print(f"{'ideal (1/DP)':52s} {'':9s} {'':11s} {'':10s} {'':10s} {1 / world:10.5f}")


if __name__ == "__main__":
    main()
