"""Run a test body on N real gloo ranks, with a hard timeout.

``run_on_ranks(world_size, fn, *args)`` calls ``fn(*args)`` on every rank of a
gloo job and returns the list of per-rank results.  Workers are started once
per world size through a ``forkserver`` that has torch and DeepSpeed imported
already, and are reused by later tests (each keeps its process group), which
saves most of the start-up cost on a 2-core machine.  Between tests a worker
collects its garbage: a destroyed gloo group lives on in reference cycles until
then, and each keeps a thread that wakes every few milliseconds (hundreds of
them once took half the CPU of an idle pool); a pool whose workers still hold
many threads after that (groups a test never destroyed) is started afresh.  If any rank raises, the
others are killed at once and the test fails with that rank's traceback; if
the ranks do not all answer within ``timeout`` seconds, the workers are killed
and the test fails: nothing hangs.

``fn`` must be importable (a module-level function in a test module).
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing as mp
import os
import queue
import sys
import traceback
from typing import Any, Callable, Dict, List

from ds_megatron.integration.local_job import init_local_rank
from ds_megatron.utils.dist_env import free_port

_CTX = None
_POOLS: Dict[int, "_Pool"] = {}
DEFAULT_TIMEOUT = float(os.environ.get("DS_MEGATRON_TEST_TIMEOUT", "180"))
# A worker holds about 5 threads with its default group; each live gloo group adds 3.
MAX_WORKER_THREADS = 60


class RankFailure(AssertionError):
    """A rank raised, or the job timed out."""


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # torch._dynamo: the first torch.optim optimizer imports it (3-4 s), once here instead of in every worker.
        _CTX.set_forkserver_preload(["torch", "torch._dynamo", "deepspeed", "ds_megatron"])
    return _CTX


def _worker_main(rank: int, world_size: int, port: int, tasks, results, sys_path: List[str]) -> None:
    sys.path[:] = sys_path
    import torch.distributed as dist
    # Multi-rank tests are CPU tests (gloo) on every machine: no GPU visible to the workers.
    init_local_rank(rank, world_size, port, threads=1, cpu_only=True)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            value = (rank, True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
            value = (rank, False, traceback.format_exc())
        gc.collect()  # before answering: the parent counts the threads left (see the module docstring)
        results.put(value)
    try:
        dist.barrier()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skips interpreter teardown, which sometimes aborts under gloo


@contextlib.contextmanager
def _cpu_only_environment():
    pinned = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    saved = {k: os.environ.get(k) for k in pinned}
    os.environ.update(pinned)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Pool:
    def __init__(self, world_size: int):
        ctx = _context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker_main, daemon=True,
                                  args=(r, world_size, port, self.tasks[r], self.results, list(sys.path)))
                      for r in range(world_size)]
        # The forkserver (started by the first start) imports torch and DeepSpeed for every later
        # worker: it must not see a GPU either, or they would cache one before their own settings apply.
        with _cpu_only_environment():
            for p in self.procs:
                p.start()

    def run(self, fn: Callable, args, kwargs, timeout: float) -> List[Any]:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out: List[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        import time
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            dead = [r for r in pending if not self.procs[r].is_alive()]
            if dead:
                self.kill()
                raise RankFailure(f"rank(s) {dead} of {self.world_size} died (exit codes "
                                  f"{[self.procs[r].exitcode for r in dead]}) while running {fn.__name__}")
            if left <= 0:
                self.kill()
                raise RankFailure(f"{fn.__name__} on {self.world_size} ranks timed out after {timeout:.0f}s; "
                                  f"ranks {sorted(pending)} never answered")
            try:
                rank, ok, value = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if not ok:
                self.kill()
                raise RankFailure(f"rank {rank} of {self.world_size} failed in {fn.__name__}:\n{value}")
            out[rank] = value
            pending.discard(rank)
        if max(_threads(p.pid) for p in self.procs) > MAX_WORKER_THREADS:
            self.close()  # the next test starts a fresh pool
        return out

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        _POOLS.pop(self.world_size, None)


def _threads(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return 0


def run_on_ranks(world_size: int, fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result."""
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    return pool.run(fn, args, kwargs, timeout)


def shutdown_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()


atexit.register(shutdown_pools)
