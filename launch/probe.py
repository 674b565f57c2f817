"""Launcher probe: start torch.distributed from the launcher's environment and all-reduce the ranks.

Each rank prints one JSON line {rank, world_size, local_rank, local_size, sum}
(sum = 0 + 1 + ... + world_size-1 proves the collective worked) and, with
``--out DIR``, writes it to DIR/rank<R>.json as well.  tests/test_launchers.py
runs it under every script in launch/.

    bash launch/torchrun.sh 2 launch/probe.py --out /tmp/probe
"""
import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory to write rank<R>.json into")
    args, _ = parser.parse_known_args()  # tolerate a launcher's --local_rank

    from ds_megatron.integration.runtime import init_distributed_from_env
    init_distributed_from_env()

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    total = torch.tensor([rank], dtype=torch.long)
    dist.all_reduce(total)
    record = {"rank": rank, "world_size": dist.get_world_size(), "local_rank": int(os.environ["LOCAL_RANK"]),
              "local_size": int(os.environ["LOCAL_SIZE"]), "sum": int(total.item())}
    line = json.dumps(record)
    print(line, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            f.write(line + "\n")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown, which sometimes aborts under gloo (see ENVIRONMENT.md);
    # under mpiexec, finalize MPI first so the launcher sees a clean exit.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)


if __name__ == "__main__":
    main()
