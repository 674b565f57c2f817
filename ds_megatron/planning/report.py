"""``ds-megatron plan --config FILE --world-size N``: memory per rank of a GPT job (``planning.memory``), the
bytes each rank sends per step (``planning.comm_volume``) and, with ``--hardware``, the predicted step time
(``planning.step_time``), before launching it; ``--search`` ranks the layouts of N GPUs (``planning.search``);
``--calibrate`` measures this box into a hardware profile (``planning.calibrate``, the one part that loads torch).
Pure Python, no torch.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Optional, Sequence

from ..config.job import parse_job_config
from ..errors import ConfigError
from .comm_volume import format_comm_volume
from .hardware import CPU_KERNELS, load_hardware
from .job_plan import plan_from_config, run_from_job
from .memory import format_plan
from .search import format_layouts, search_layouts
from .step_time import format_step_time, plan_step_time

__all__ = ["main", "plan_from_config"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-megatron plan",
                                     description="plan a layout: memory, communication and step time per rank")
    parser.add_argument("--config", help="DeepSpeed JSON config with a \"megatron\" section")
    parser.add_argument("--world-size", type=int, help="number of ranks of the job")
    parser.add_argument("--micro-batch", type=int, help="default: train_micro_batch_size_per_gpu")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--hardware", help="a100 | h100 | h200 | b200 | FILE.json (--calibrate writes one): "
                                           "add the predicted step time; activations as its kernels keep them")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs sharing a node's NVLink (default: the hardware's)")
    parser.add_argument("--search", action="store_true",
                        help="rank the layouts of --world-size GPUs by predicted step time (needs --hardware)")
    parser.add_argument("--global-batch-size", type=int, help="--search: samples per step (default: the config's)")
    parser.add_argument("--top", type=int, default=10, help="--search: how many layouts to print (default 10)")
    parser.add_argument("--calibrate", metavar="OUT.json",
                        help="measure this box (sgemm by shape, gloo collectives) into a hardware profile, then exit")
    parser.add_argument("--calibrate-ranks", type=int, default=4, help="--calibrate: local gloo ranks (2-4)")
    args = parser.parse_args(argv)
    try:
        if args.calibrate:
            from .calibrate import calibrate  # loads torch: the only part of plan that does
            calibrate(args.calibrate, ranks=args.calibrate_ranks)
            print(f"wrote {args.calibrate}")
            return 0
        if not args.config or not args.world_size:
            raise ConfigError("--config and --world-size are required (but for --calibrate OUT.json)")
        if args.search:
            return _search(args)
        hw = load_hardware(args.hardware) if args.hardware else None
        header, plans, comm = plan_from_config(args.config, args.world_size, args.micro_batch,
                                               hw.kernels if hw else CPU_KERNELS)
        step = None
        if hw:
            run = run_from_job(parse_job_config(args.config), args.world_size, args.micro_batch)
            step = plan_step_time(run, hw, args.gpus_per_node)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"header": header, "roles": [dict(asdict(p), total_bytes=p.total_bytes) for p in plans],
               "comm": comm if isinstance(comm, str) else
               [{"stage": c.stage, "bus_bytes": c.bus_bytes, "total": c.total} for c in comm]}
        if step is not None:
            doc["time"] = step.to_json()
        print(json.dumps(doc))
    else:
        print(format_plan(plans, header))
        print("\n" + (comm if isinstance(comm, str) else format_comm_volume(comm)))
        if step is not None:
            print("\n" + format_step_time(step, hw))
    return 0


def _search(args) -> int:
    if not args.hardware:
        raise ConfigError("--search needs --hardware (a100, h100, h200, b200 or a profile file)")
    hw = load_hardware(args.hardware)
    result = search_layouts(args.config, args.world_size, hw, args.gpus_per_node, args.global_batch_size,
                            limit=args.top)
    if args.json:
        print(json.dumps({"layouts": [layout.to_json() for layout in result.layouts],
                          "candidates": result.candidates, "evaluated": result.evaluated}))
    else:
        print(format_layouts(result, hw))
    return 0 if result.layouts else 2


if __name__ == "__main__":
    sys.exit(main())
