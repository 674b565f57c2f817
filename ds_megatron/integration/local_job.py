"""Run a function on N gloo ranks of this machine, each a spawned process (benchmarks use it).

Torch-free at import: a rank sets its launcher variables before torch and
DeepSpeed load (``init_local_rank``), as they read them when they start.

``run_local_job(world, fn, *args)`` starts ``world`` processes with torch's
launcher variables on loopback, initializes DeepSpeed's comm layer (gloo on a
CPU box), calls ``fn(*args)`` on every rank and returns rank 0's result.  A
rank that raises makes the parent raise with its traceback; a job that does
not answer within ``timeout`` seconds is killed.  Each rank ends with barrier,
destroy and ``os._exit`` because interpreter teardown under gloo sometimes
aborts.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import sys
import traceback
from typing import Any, Callable, Dict

from ..utils.dist_env import free_port
from ..utils.runtime_env import use_cuda


def local_rank_env(rank: int, world_size: int, port: int, cpu_only: bool = False) -> Dict[str, str]:
    """torch's launcher variables for one rank of a single-machine job, all traffic on loopback.

    ``cpu_only``: pin the CPU path even on a GPU machine (no GPU visible, DeepSpeed's CPU
    accelerator, gloo), as the multi-rank tests do; otherwise the GPU is used when there is one.
    """
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
           "LOCAL_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if cpu_only or not use_cuda():
        env["DS_ACCELERATOR"] = "cpu"
    return env


def init_local_rank(rank: int, world_size: int, port: int, threads: int = 1, cpu_only: bool = False) -> None:
    """Make this process rank ``rank`` of a local job: launcher variables, threads, DeepSpeed's comm layer."""
    os.environ.update(local_rank_env(rank, world_size, port, cpu_only=cpu_only))
    # Boundary: loaded only now, since DeepSpeed picks its accelerator, and torch its thread pool, from the
    # variables above.
    import torch

    from .runtime import init_distributed, set_deepspeed_log_level  # boundary: see above
    torch.set_num_threads(threads)
    set_deepspeed_log_level("ERROR")
    init_distributed(verbose=False)


def _rank_main(rank: int, world: int, port: int, threads: int, fn: Callable, args, results) -> None:
    try:
        init_local_rank(rank, world, port, threads)
        value = fn(*args)
        if rank == 0:
            results.put((True, value))
        import torch.distributed as dist  # loaded by init_local_rank already

        from ..utils.collectives import barrier  # the rank's torch half, loaded by init_local_rank already
        barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - handed to the parent, which raises it
        results.put((False, f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        # Queue.put hands the item to a feeder thread; os._exit would kill it before the item is written.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_local_job(world: int, fn: Callable, *args, threads_per_rank: int = 1, timeout: float = 1800) -> Any:
    """``fn(*args)`` on ``world`` local ranks; rank 0's return value.  ``fn`` must be importable."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, threads_per_rank, fn, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        ok, value = results.get(timeout=timeout)
    except queue_module.Empty:
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world} ranks gave no answer in {timeout:.0f}s") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if not ok:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed on {value}")
    return value
