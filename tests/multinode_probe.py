"""Two-node probe (tests/test_multinode.py): what a rank sees when torchrun starts it as one of several nodes.

Each rank writes OUT/rank<R>.json: its RANK / LOCAL_RANK / GROUP_RANK (the node), LOCAL_SIZE, the
engine's device, its tensor-parallel group (TP=4 over 2 nodes x 2 ranks spans both) and the sum of
the TP group's ranks, all-reduced over that group (6 proves the cross-node group carries data).
"""
import json
import os
import sys


def node() -> int:
    """torchrun names the node (GROUP_RANK); under MPI the MPI_LOCALNRANKS-rank blocks are the hosts."""
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    return int(os.environ["RANK"]) // int(os.environ["MPI_LOCALNRANKS"])


def main() -> None:
    out = sys.argv[sys.argv.index("--out") + 1]
    from ds_megatron.integration.runtime import init_distributed_from_env
    init_distributed_from_env()
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState

    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=dist.get_world_size()))
    total = torch.tensor([dist.get_rank()], dtype=torch.long)
    dist.all_reduce(total, group=state.tp.group)
    record = {"rank": dist.get_rank(), "local_rank": int(os.environ["LOCAL_RANK"]),
              "node": node(), "local_size": int(os.environ["LOCAL_SIZE"]),
              "device": str(get_accelerator().device_name()), "tp_ranks": list(state.tp.ranks),
              "tp_rank": state.tp.rank, "tp_sum": int(total.item())}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        f.write(json.dumps(record) + "\n")
    state.destroy()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skips interpreter teardown, which sometimes aborts under gloo (ENVIRONMENT.md)


if __name__ == "__main__":
    main()
