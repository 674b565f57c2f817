"""Gradient-sync time per step on CPU/gloo: our bucketed buffers vs DeepSpeed stage 0 vs naive, next to the floor.

    python launch/bench/bench_grad_sync.py [--dp 2 4] [--layers 20 --hidden 1024 --batch 8 --steps 4
                                            --bucket-size 4000000]

For each DP size, one gloo job of DP ranks (spawned here, one thread each)
times, on the same model (``layers`` x Linear(hidden, hidden), ~21M params by
default) and the same data:

* floor: one all-reduce of a flat fp32 tensor holding as many elements as all grads;
* naive: after backward, one blocking all-reduce per parameter (then / DP);
* deepspeed: DeepSpeed 0.19.8 stage-0 engine, its ``allreduce_gradients`` (flatten,
  all-reduce in 500M-element buffers, copy back);
* megatron (overlap off): our DDP, one bucket reduced after backward (``finish_grad_sync``);
* megatron (overlap on): our DDP with ``bucket_size`` buckets started during backward;
  "sync" is what is still exposed after backward (the wait in ``finish_grad_sync``).

"sync" is the time spent in gradient reduction after backward returns;
"fwd+bwd+sync" the whole micro-step, whose difference to the no-communication
baseline is the true cost of sync (overlap trades exposed wait for slower
backward when ranks share few cores).  Times are the max over ranks of the
median over ``steps`` timed steps (after one warm-up).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_megatron.integration.local_job import run_local_job  # noqa: E402


def mlp_stack(layers: int, hidden: int):
    """The benchmarks' model: ``layers`` x (Linear(hidden, hidden), Tanh), seeded."""
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(hidden, hidden), torch.nn.Tanh())])


def _measure(args):
    """One rank's part; rank 0's return value is the table."""
    import torch
    import torch.distributed as dist
    import deepspeed
    rank, world = dist.get_rank(), dist.get_world_size()
    from ds_megatron.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.hidden, generator=g)

    def loss_of(module):
        return module(x).pow(2).mean()

    def timed(step_fn):
        """step_fn() -> (sync seconds, total seconds); max over ranks of the median."""
        step_fn()
        syncs, totals = [], []
        for _ in range(args.steps):
            dist.barrier()
            s, t = step_fn()
            syncs.append(s)
            totals.append(t)
        out = torch.tensor([statistics.median(syncs), statistics.median(totals)], dtype=torch.float64)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out.tolist()

    row = {}
    model = mlp_stack(args.layers, args.hidden)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)

    flat = torch.randn(numel)

    def floor():
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        t = time.perf_counter() - t0
        return t, t
    row["floor"] = timed(floor)

    def baseline():
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        loss_of(model).backward()
        return 0.0, time.perf_counter() - t0
    row["fwd+bwd (no comm)"] = timed(baseline)

    def naive():
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        loss_of(model).backward()
        t1 = time.perf_counter()
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        t2 = time.perf_counter()
        return t2 - t1, t2 - t0
    row["naive per-param"] = timed(naive)

    engine, _, _, _ = deepspeed.initialize(model=mlp_stack(args.layers, args.hidden), config={
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 0}})
    ds_sync = []
    original = engine.allreduce_gradients

    def timed_allreduce(*a, **k):
        t0 = time.perf_counter()
        original(*a, **k)
        ds_sync.append(time.perf_counter() - t0)
    engine.allreduce_gradients = timed_allreduce

    def deepspeed_stage0():
        engine.zero_grad()
        t0 = time.perf_counter()
        engine.backward(loss_of(engine))
        return ds_sync[-1], time.perf_counter() - t0
    row["deepspeed stage 0"] = timed(deepspeed_stage0)
    del engine

    state = ParallelState.build(ParallelLayout(world_size=world))
    for overlap in (False, True):
        m = mlp_stack(args.layers, args.hidden)
        ddp = DistributedDataParallel(m, DistributedDataParallelConfig(
            overlap_grad_reduce=overlap, bucket_size=args.bucket_size), state)

        def megatron():
            ddp.zero_grad_buffer()
            t0 = time.perf_counter()
            loss_of(ddp).backward()
            t1 = time.perf_counter()
            ddp.finish_grad_sync()
            t2 = time.perf_counter()
            return t2 - t1, t2 - t0
        name = f"megatron buckets, overlap {'on' if overlap else 'off'}"
        row[name + f" ({len(ddp.bucket_groups)} bucket(s))"] = timed(megatron)
        ddp.remove_hooks()
    state.destroy()
    return numel, row


def run(world: int, args):
    return run_local_job(world, _measure, args)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--bucket-size", type=int, default=4_000_000, help="elements per bucket with overlap on")
    args = ap.parse_args(argv)
    for world in args.dp:
        numel, row = run(world, args)
        floor_s = row["floor"][0]
        print(f"\nDP={world}: {numel / 1e6:.1f}M fp32 params ({numel * 4 / 2 ** 20:.0f} MiB of grads), "
              f"gloo on CPU, {os.cpu_count()} cores, max over ranks of the median of {args.steps} steps")
        print(f"{'method':48s} {'sync ms':>9s} {'x floor':>8s} {'fwd+bwd+sync ms':>16s}")
        for name, (sync_s, total_s) in row.items():
            ratio = f"{sync_s / floor_s:8.2f}" if sync_s else f"{'-':>8s}"
            print(f"{name:48s} {sync_s * 1e3:9.1f} {ratio} {total_s * 1e3:16.1f}")


if __name__ == "__main__":
    main()
