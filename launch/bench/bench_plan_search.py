"""``ds-megatron plan --search``'s own cost: CPU-seconds, candidates and layouts planned in full, by GPU count.

    python launch/bench/bench_plan_search.py [--rows 175B,1T] [--gpus 64,2048,16384] [--top 10]

Each row is a published run's config (``planning.published.paper_config``: Korthikanti et al.'s Table 5 model
with sequence parallelism and selective recomputation, its micro-batch 1 and its micro-batches per step); each
GPU count runs the search on A100s up to 2,048 GPUs and on B200s above, with the config's own global batch at
that count (micro-batch x micro-batches x DP of the paper's TP x PP; a count that TP x PP does not divide is
skipped: the search reads the config's own settings at that count).  Printed per run: the process's CPU-seconds
(``time.process_time``: the box's other jobs move the wall clock, not this), the candidates enumerated, the
variants planned in full, and the first layout.  Issue 44's goal: under 30 s at 16,384 GPUs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_megatron.planning import published  # noqa: E402
from ds_megatron.planning.hardware import load_hardware  # noqa: E402
from ds_megatron.planning.search import search_layouts  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="175B,1T", help="Korthikanti et al. Table 5 rows (22B, 175B, 530B, 1T)")
    ap.add_argument("--gpus", default="64,2048,16384")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args(argv)
    rows = {row[0]: row for row in published.KORTHIKANTI_TABLE_5}
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(f"{'model':>5s} {'GPUs':>6s} {'hardware':>8s} {'batch':>6s} {'CPU s':>6s} {'candidates':>10s} "
          f"{'planned':>7s}  first layout")
    for name in args.rows.split(","):
        _, h, layers, heads, tp, pp, vpp, gpus, batch, _, _ = rows[name]
        config = published.paper_config(h, layers, heads, tp, pp, vpp, 1, batch // (gpus // (tp * pp)), "selective")
        for world in (int(n) for n in args.gpus.split(",")):
            if world % (tp * pp):  # the search reads the config's own settings at this count (plan_from_config's)
                print(f"{name:>5s} {world:>6,d}  skipped: the config's tp x pp = {tp * pp} does not divide it")
                continue
            hw = load_hardware("a100" if world <= 2048 else "b200")
            global_batch = batch // (gpus // (tp * pp)) * (world // (tp * pp))
            start = time.process_time()
            result = search_layouts(config, world, hw, global_batch=global_batch, limit=args.top)
            seconds = time.process_time() - start
            x = result.layouts[0] if result.layouts else None
            first = (f"tp{x.tp} pp{x.pp} vpp{x.vpp} cp{x.cp} dp{x.dp} mb{x.micro_batch} {x.recompute} {x.schedule}"
                     f"{' distopt' if x.distributed_optimizer else ''}: {x.step_time_s:.3f} s" if x else "none fits")
            print(f"{name:>5s} {world:>6,d} {hw.name:>8s} {global_batch:>6,d} {seconds:6.1f} "
                  f"{result.candidates:>10,d} {result.evaluated:>7,d}  {first}", flush=True)


if __name__ == "__main__":
    main()
