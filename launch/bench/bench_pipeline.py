"""Pipeline parallelism on CPU/gloo at a fixed world size: step time, peak memory per rank, measured bubble vs formula.

    python launch/bench/bench_pipeline.py [--world-size 4 --pp 1 2 4 --micro-batches 1 2 4 8 16
                                           --layers 8 --hidden 256 --seq 128 --micro-batch 2 --steps 3
                                           --schedules deepspeed v1 v2 v4 zb]

Schedules: ``deepspeed`` is DeepSpeed's pipeline engine (1F1B); ``vN`` is our runtime with N chunks per
rank (``v1``: plain 1F1B, ``v2`` / ``v4``: Megatron's interleaved 1F1B; rows whose layers or micro-batches
do not divide are skipped, as the config would refuse them); ``zb`` is our runtime's ZB-H1.

For each PP size (DP = world / PP) and each number of micro-batches m >= PP,
one fresh gloo job (spawned here, one thread per rank) trains the same GPT
(``layers`` x ``hidden``, fp32, Adam) through ``ds_megatron.initialize``:
PP = 1 with the plain loop (``engine(batch)`` / ``backward`` / ``step``),
PP > 1 with the schedule's ``train_batch``.  Per row:

* step ms: the median over ``steps`` timed steps (after one warm-up), max over ranks;
* tokens/s: tokens of the global batch (m x micro-batch x DP x seq) / step time;
* peak RSS MiB: each rank's resident-set high-water mark (``ru_maxrss``, a
  fresh process per row), max over ranks and its growth over the rank's
  footprint before the model was built;
* bubble: on each rank, the share of the pipelined part of a step (from the
  first instruction to the gradient reduction) not spent in forward or backward
  compute, averaged over ranks, next to the seed's ``(p - 1) / (v m + p - 1)`` (ZB-H1: the paper's
  ``(p - 1) / (3m + p - 1)``, which assumes F = B = W).

The formula assumes one device per stage.  When ranks outnumber cores (4 ranks
on a 2-core box) stages also wait for a core, which shows up as bubble too;
the header prints the core count.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_megatron.integration.local_job import run_local_job  # noqa: E402


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _measure(args, pp: int, m: int, schedule: str = "deepspeed"):
    import torch
    import torch.distributed as dist
    import ds_megatron
    from ds_megatron.models import GPTConfig, GPTModel

    base_rss = _rss_mib()
    world = dist.get_world_size()
    dp = world // pp
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": m,
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
           "megatron": {"pipeline_model_parallel_size": pp}}
    ours = pp > 1 and schedule != "deepspeed"
    if schedule == "zb":
        cfg["megatron"].update(pipeline_schedule="zero_bubble")
    elif ours:
        cfg["megatron"].update(pipeline_schedule="interleaved_1f1b",
                               virtual_pipeline_model_parallel_size=int(schedule[1:]))
    model_cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                          seq_length=args.seq, vocab_size=1024, hidden_dropout=0.0, attention_dropout=0.0)
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(0)
    if ours:
        from ds_megatron.models.gpt_chunks import GPTModelChunks
        model = GPTModelChunks(model_cfg, state, num_model_chunks=1 if schedule == "zb" else int(schedule[1:]))
    elif pp > 1:
        model = ds_megatron.GPTPipelineModule(model_cfg, state)
    else:
        model = GPTModel(model_cfg, state)
    engine, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    g = torch.Generator().manual_seed(state.dp.rank)
    data = torch.randint(0, 1024, (m, args.micro_batch, args.seq + 1), generator=g)
    ones = torch.ones(args.micro_batch, args.seq)

    compute, span_end = [0.0], [None]
    if ours:
        engine.megatron.pipeline_runtime.schedule.record_timings = True
    elif pp > 1:
        # The engine runs each schedule instruction through its class-level _INSTRUCTION_MAP (bound per call),
        # so the timers go into an instance copy of that map.
        from deepspeed.runtime.pipe import schedule as ds_schedule
        instructions = dict(engine._INSTRUCTION_MAP)

        def timed(fn):
            def run(self, *a, **k):
                t0 = time.perf_counter()
                out = fn(self, *a, **k)
                compute[0] += time.perf_counter() - t0
                return out
            return run

        def marks_end(fn):
            def run(self, *a, **k):
                span_end[0] = time.perf_counter()
                return fn(self, *a, **k)
            return run
        instructions[ds_schedule.ForwardPass] = timed(instructions[ds_schedule.ForwardPass])
        instructions[ds_schedule.BackwardPass] = timed(instructions[ds_schedule.BackwardPass])
        instructions[ds_schedule.ReduceTiedGrads] = marks_end(instructions[ds_schedule.ReduceTiedGrads])
        engine._INSTRUCTION_MAP = instructions

    def step():
        compute[0], span_end[0] = 0.0, None
        t0 = time.perf_counter()
        if pp > 1:
            engine.train_batch(iter([(t[:, :-1], (t[:, 1:], ones)) for t in data]))
            if ours:
                timed = engine.megatron.pipeline_runtime.schedule
                return time.perf_counter() - t0, 1.0 - timed.compute_seconds / timed.span_seconds
        else:
            for t in data:
                t1 = time.perf_counter()
                loss = engine(t[:, :-1], t[:, 1:], ones)
                engine.backward(loss)
                compute[0] += time.perf_counter() - t1
                span_end[0] = time.perf_counter()
                engine.step()
        total = time.perf_counter() - t0
        return total, 1.0 - compute[0] / (span_end[0] - t0)

    step()  # warm-up
    totals, bubbles = [], []
    for _ in range(args.steps):
        dist.barrier()
        total, bubble = step()
        totals.append(total)
        bubbles.append(bubble)
    peak = _rss_mib()
    out = torch.tensor([statistics.median(totals), statistics.median(bubbles), peak, peak - base_rss],
                       dtype=torch.float64)
    gathered = [torch.zeros_like(out) for _ in range(world)]
    dist.all_gather(gathered, out)
    engine.megatron.destroy()
    rows = torch.stack(gathered)
    return dict(step_s=float(rows[:, 0].max()), bubble=float(rows[:, 1].mean()), peak=float(rows[:, 2].max()),
                growth=float(rows[:, 3].max()), dp=dp)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=["deepspeed", "v1", "v2", "v4", "zb"])
    args = ap.parse_args(argv)
    print(f"world size {args.world_size} on {os.cpu_count()} cores (gloo, one thread per rank); GPT {args.layers} "
          f"layers x hidden {args.hidden}, seq {args.seq}, micro-batch {args.micro_batch}, fp32 Adam; "
          f"median of {args.steps} steps")
    print(f"{'schedule':>9s} {'PP':>3s} {'DP':>3s} {'m':>3s} {'step ms':>9s} {'tokens/s':>9s} {'peak RSS MiB':>13s} "
          f"{'(+ training)':>12s} {'bubble':>7s} {'(p-1)/(vm+p-1)':>15s}")
    for pp in args.pp:
        if args.world_size % pp:
            continue
        for m in args.micro_batches:
            if pp > 1 and m < pp:
                continue  # refused: fewer micro-batches than stages
            for schedule in (args.schedules if pp > 1 else ["none"]):
                v = 1 if schedule in ("deepspeed", "none", "zb") else int(schedule[1:])
                if v > 1 and (m % pp or args.layers % (pp * v)):
                    continue  # refused: micro-batches not in groups of pp, or layers not in pp x v chunks
                r = run_local_job(args.world_size, _measure, args, pp, m, schedule)
                tokens = m * args.micro_batch * r["dp"] * args.seq
                formula = (pp - 1) / ((3 if schedule == "zb" else v) * m + pp - 1)
                print(f"{schedule:>9s} {pp:3d} {r['dp']:3d} {m:3d} {r['step_s'] * 1e3:9.1f} "
                      f"{tokens / r['step_s']:9.0f} {r['peak']:13.0f} {r['growth']:12.0f} {r['bubble']:7.2f} "
                      f"{formula:15.2f}", flush=True)


if __name__ == "__main__":
    main()
