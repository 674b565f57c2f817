"""``ds-megatron plan``'s predicted step time against measured steps: layouts of one GPT on 4 CPU ranks (gloo).

    python launch/bench/bench_plan_time.py [--hardware cpu.json] [--steps 3] [--layers 8 --hidden 256 --seq 256]
                                           [--micro-batch 2 --global-batch 32]

Without ``--hardware`` the box is calibrated first (``ds-megatron plan --calibrate``, 4 ranks) into a temporary
profile.  Each layout (TP, PP 1F1B / interleaved / ZB-H1, CP, DP, the distributed optimizer, recomputation) is one
fresh 4-rank job training the same fp32 GPT through ``ds_megatron.initialize`` (our pipeline runtime for PP);
the step is the median of ``--steps`` timed steps after one warm-up, max over ranks.  Printed: each layout's
measured and predicted step, the error, and the Spearman rank correlation and median error over the layouts;
the search's first choice over these layouts (the one predicted fastest whose plan fits the profile's memory)
and its measured step against the fastest measured; then ``plan --search``'s first choices over all layouts.
The box's load moves the measurements (ranks share its cores, which the profile's ``cores`` models, but not other
jobs): the header prints the core count, the load average and the profile's cores.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_megatron.config.job import parse_job_config  # noqa: E402
from ds_megatron.integration.local_job import run_local_job  # noqa: E402
from ds_megatron.planning.hardware import load_hardware  # noqa: E402
from ds_megatron.planning.job_plan import memory_plans, run_from_job  # noqa: E402
from ds_megatron.planning.search import search_layouts  # noqa: E402
from ds_megatron.planning.step_time import plan_step_time  # noqa: E402

WORLD = 4
# name -> the "megatron" keys of the layout (and the model's recomputation)
LAYOUTS = {
    "dp4": {},
    "dp4 distributed optimizer": {"use_distributed_optimizer": True},
    "tp2 dp2": {"tensor_model_parallel_size": 2},
    "tp4 sp": {"tensor_model_parallel_size": 4, "sequence_parallel": True},
    "tp2 dp2 full recompute": {"tensor_model_parallel_size": 2, "model": {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}},
    "cp2 dp2": {"context_parallel_size": 2},
    "pp2 dp2 1f1b": {"pipeline_model_parallel_size": 2, "pipeline_schedule": "1f1b"},
    "pp4 interleaved v2": {"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2},
    "pp4 zb-h1": {"pipeline_model_parallel_size": 4, "pipeline_schedule": "zero_bubble"},
    "pp2 tp2 selective": {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2,
                          "model": {"recompute_granularity": "selective"}},
}


def job_config(args, layout) -> dict:
    """The bench's GPT at ``layout``, every layout stepping the same global batch."""
    dp = WORLD // (layout.get("tensor_model_parallel_size", 1) * layout.get("pipeline_model_parallel_size", 1)
                   * layout.get("context_parallel_size", 1))
    model = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8, seq_length=args.seq,
                 vocab_size=1024, hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope")
    megatron = copy.deepcopy(layout)
    model.update(megatron.pop("model", {}))
    megatron["model"] = model
    return {"train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": args.global_batch // (args.micro_batch * dp),
            "steps_per_print": 10 ** 9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "megatron": megatron}


def _measure(config, steps):
    import torch
    import torch.distributed as dist
    import ds_megatron
    from ds_megatron.models import GPTModel
    from ds_megatron.models.gpt_chunks import GPTModelChunks

    job = parse_job_config(config)
    model_cfg, parallel = job.model, job.megatron.parallel
    state = ds_megatron.initialize_model_parallel(config)
    torch.manual_seed(0)
    pp = parallel.pipeline_model_parallel_size
    if pp > 1:
        chunks = parallel.virtual_pipeline_model_parallel_size or 1
        model = GPTModelChunks(model_cfg, state, num_model_chunks=chunks)
    else:
        model = GPTModel(model_cfg, state)
    engine, *_ = ds_megatron.initialize(model=model, config=config, parallel_state=state)
    m, mb, seq = config["gradient_accumulation_steps"], config["train_micro_batch_size_per_gpu"], model_cfg.seq_length
    g = torch.Generator().manual_seed(state.dp.rank)
    data = torch.randint(0, 1024, (m, mb, seq + 1), generator=g)
    ones = torch.ones(mb, seq)

    def step():
        start = time.perf_counter()
        if pp > 1:
            engine.train_batch(iter([(t[:, :-1], (t[:, 1:], ones)) for t in data]))
        else:
            for t in data:
                engine.backward(engine(t[:, :-1], t[:, 1:], ones))
                engine.step()
        return time.perf_counter() - start

    step()
    times = []
    for _ in range(steps):
        dist.barrier()
        times.append(step())
    out = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    engine.megatron.destroy()
    return float(out)


def spearman(xs, ys) -> float:
    def ranks(vs):
        order = sorted(range(len(vs)), key=lambda i: vs[i])
        out = [0.0] * len(vs)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", help="a profile from ds-megatron plan --calibrate (default: calibrate now)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=32, help="samples per step, the same for every layout")
    args = ap.parse_args(argv)
    if args.hardware is None:
        from ds_megatron.planning.calibrate import calibrate  # torch: only when no profile is given
        args.hardware = os.path.join(tempfile.mkdtemp(), "cpu.json")
        calibrate(args.hardware, ranks=WORLD)
    hw = load_hardware(args.hardware)
    print(f"{WORLD} gloo ranks on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; GPT {args.layers} "
          f"layers x hidden {args.hidden}, seq {args.seq}, micro-batch {args.micro_batch}, {args.global_batch} samples "
          f"per step, fp32 AdamW; median of {args.steps} steps; profile {args.hardware} (comm_overlap "
          f"{hw.comm_overlap:.2f}, cores {hw.cores})")
    print(f"{'layout':>26s} {'measured ms':>12s} {'predicted ms':>13s} {'error':>7s}")
    measured, predicted, fits = [], [], []
    for name, layout in LAYOUTS.items():
        config = job_config(args, layout)
        job = parse_job_config(config)
        plan = plan_step_time(run_from_job(job, WORLD), hw)
        fits.append(max(p.total_bytes for p in memory_plans(job, WORLD, rank_lists=False)) <= hw.memory_bytes)
        seconds = run_local_job(WORLD, _measure, config, args.steps)
        measured.append(seconds)
        predicted.append(plan.step_time_s)
        print(f"{name:>26s} {seconds * 1e3:12.1f} {plan.step_time_s * 1e3:13.1f} "
              f"{plan.step_time_s / seconds - 1:+7.1%}", flush=True)
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured)]
    names = list(LAYOUTS)
    fastest = measured.index(min(measured))
    print(f"Spearman rank correlation {spearman(measured, predicted):.2f}; median |error| "
          f"{statistics.median(errors):.1%} (goals: >= 0.8, <= 20%); fastest measured {measured[fastest] * 1e3:.1f} "
          f"ms ({names[fastest]})")
    # The search's rule over the measured set: the layout predicted fastest among those whose plan fits memory.
    first = min((i for i in range(len(names)) if fits[i]), key=lambda i: predicted[i])
    print(f"search's first choice among the measured: {names[first]} (predicted {predicted[first] * 1e3:.1f} ms, "
          f"measured {measured[first] * 1e3:.1f} ms) = {measured[first] / measured[fastest]:.2f}x the fastest "
          f"measured ({names[fastest]}, {measured[fastest] * 1e3:.1f} ms); goal <= 1.10x")
    result = search_layouts(job_config(args, {}), WORLD, hw, global_batch=args.global_batch, limit=3)
    for x in result.layouts:
        print(f"search: tp{x.tp} pp{x.pp} vpp{x.vpp} cp{x.cp} dp{x.dp} mb{x.micro_batch} {x.recompute} "
              f"{x.schedule}{' distributed optimizer' if x.distributed_optimizer else ''}: predicted "
              f"{x.step_time_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
