"""Tokens/s and model FLOP/s of the GPT under TP=1, 2, 4 on this machine, side by side.

    python launch/bench/bench_tp.py [--layers 4 --hidden 256 --heads 8 --seq 256 --mbs 4 --steps 10]

Each TP size runs as its own gloo job of TP ranks (no data parallelism), one
after the other, through ds_megatron.initialize and the plain DeepSpeed loop
(fp32, AdamW).  Model FLOPs follow the Megatron-LM paper: its
96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) counts forward + backward + the
recomputed forward of activation checkpointing; we do not recompute, so per
step we count forward + backward = 72*B*s*l*h^2*(1 + s/(6h)) + 6*B*s*h*V.
On a CPU box, TP ranks share the same few cores: the ratios show the cost of
TP's communication and smaller GEMMs, not a speed-up.
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


def model_flops_per_step(B, s, l, h, V):
    """Forward + backward model FLOPs (no recomputation), Megatron-LM paper's accounting."""
    return 72 * B * s * l * h * h * (1 + s / (6 * h)) + 6 * B * s * h * V


def _measure(args):
    import torch
    import ds_megatron
    from ds_megatron.models import GPTConfig, GPTModel
    from ds_megatron.tensor_parallel import RNGStatesTracker, model_parallel_seed

    world = torch.distributed.get_world_size()
    ds_config = {"train_micro_batch_size_per_gpu": args.mbs, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
                 "megatron": {"tensor_model_parallel_size": world}}
    state = ds_megatron.initialize_model_parallel(ds_config)
    tracker = model_parallel_seed(1234, state.tp.rank, tracker=RNGStatesTracker())
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    seq_length=args.seq, vocab_size=257, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, state, rng_tracker=tracker)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = ds_megatron.initialize(model=model, optimizer=opt, config=ds_config, parallel_state=state)
    g = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, 257, (args.mbs, args.seq), generator=g),
             "labels": torch.randint(0, 257, (args.mbs, args.seq), generator=g)}
    times = []
    for step in range(args.warmup + args.steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        torch.distributed.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    state.destroy()
    return {"tp": world, "step_s": sorted(times)[len(times) // 2], "padded_vocab": model.padded_vocab_size}


def run(tp, args):
    return run_local_job(tp, _measure, args, threads_per_rank=max(1, (os.cpu_count() or 1) // tp), timeout=900)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tp", default="1,2,4")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [run(int(tp), args) for tp in args.tp.split(",")]
    base = rows[0]["step_s"]
    tokens = args.mbs * args.seq
    print(f"GPT l={args.layers} h={args.hidden} heads={args.heads} s={args.seq} B={args.mbs}, fp32, "
          f"{os.cpu_count()} cores; model FLOPs = fwd+bwd, 72Bslh^2(1+s/6h) + 6BshV (no recompute)")
    print(f"{'TP':>3} {'ranks':>5} {'step ms':>9} {'tokens/s':>10} {'GFLOP/s':>9} {'GFLOP/s/rank':>12} "
          f"{'tokens/s vs TP=1':>17}")
    for r in rows:
        flops = model_flops_per_step(args.mbs, args.seq, args.layers, args.hidden, r["padded_vocab"])
        r.update(tokens_per_s=tokens / r["step_s"], gflops=flops / r["step_s"] / 1e9)
        print(f"{r['tp']:>3} {r['tp']:>5} {r['step_s'] * 1e3:>9.1f} {r['tokens_per_s']:>10,.0f} {r['gflops']:>9.2f} "
              f"{r['gflops'] / r['tp']:>12.2f} {base / r['step_s']:>16.2f}x")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
