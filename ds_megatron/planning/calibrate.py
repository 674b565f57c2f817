"""``ds-megatron plan --calibrate OUT.json``: this box measured into a ``planning.hardware`` profile named ``cpu``.

The one planning module that loads torch (inside its functions; ``plan`` stays torch-free otherwise): the cores
the ranks share (``os.sched_getaffinity``); fp32 GEMM rates by shape and the bandwidth a copy streams through
memory, one core's with every core of the box computing at once (one thread each, as a rank runs: they share the
chip's memory bandwidth, caches and clock), before the ranks start (the step-time model shares the cores out
among the ranks computing at each moment of the schedule: ``Hardware.core_share``); gloo's all-reduce, all-gather,
reduce-scatter, all-to-all and send/recv between local ranks, each fitted to ``latency + bus bytes / bus
bandwidth`` from a small and a large message (bus bytes as ``comm_volume`` counts them); and how much of an
all-reduce started asynchronously a GEMM running meanwhile hides (``comm_overlap``).
The file is what ``--hardware`` reads; the figures hold for this box at this load.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import ConfigError
from .hardware import Hardware, load_hardware

GEMM_SIZES = (32, 64, 128, 256, 512, 1024)
MESSAGE_ELEMENTS = (256, 1 << 20)  # fp32: 1 KiB (latency) and 4 MiB (bandwidth)
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _best_of(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (the box's other load only slows a call down)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_gemms(sizes: Sequence[int] = GEMM_SIZES, repeats: int = 5,
                  together: Optional[Callable[[], Any]] = None) -> List[List[float]]:
    """``[m, n, k, flop/s]`` of fp32 ``torch.mm`` at each cube size, and the thin shapes of a layer's GEMMs;
    ``together``: called before each shape (a barrier, so that every core measures the same shape at once)."""
    import torch  # the measurement needs torch; the rest of planning does not
    rows = []
    shapes = [(s, s, s) for s in sizes] + [(4 * s, s, s) for s in sizes[:-1]]
    for m, n, k in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        if together is not None:
            together()
        seconds = _best_of(lambda: torch.mm(a, b), repeats)
        rows.append([m, n, k, 2.0 * m * n * k / seconds])
    return rows


def measure_memory_bandwidth(elements: int = 1 << 24, repeats: int = 5) -> float:
    """Bytes per second a copy streams (read and written counted)."""
    import torch  # as measure_gemms
    src, dst = torch.randn(elements), torch.empty(elements)
    dst.copy_(src)
    return 2 * 4 * elements / _best_of(lambda: dst.copy_(src), repeats)


def _bus_bytes(kind: str, n: int, nbytes: float) -> float:
    """nccl-tests' bus bytes of a collective over ``n`` ranks on a ``nbytes`` tensor (the whole one for the
    gathers, scatters and all-to-all, the message for send/recv)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    return nbytes if kind == "send_recv" else (n - 1) / n * nbytes


def measure_collectives(sizes: Sequence[int] = MESSAGE_ELEMENTS, repeats: int = 5) -> Dict[str, Dict[str, float]]:
    """On every rank of the default (gloo) group: each collective's latency and bus bandwidth, fitted from a small
    and a large message; rank 0's figures are the ones to keep (every rank returns its own)."""
    import torch  # as measure_gemms
    import torch.distributed as dist
    n, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for kind in KINDS:
        points = []
        for elements in sizes:
            elements -= elements % n
            whole = torch.ones(elements)
            part = torch.ones(elements // n)

            def once():
                if kind == "all_reduce":
                    dist.all_reduce(whole)
                elif kind == "all_gather":
                    dist.all_gather_into_tensor(whole, part)
                elif kind == "reduce_scatter":
                    dist.reduce_scatter_tensor(part, whole)
                elif kind == "all_to_all":
                    dist.all_to_all_single(whole.clone(), whole)
                elif rank < 2:  # send/recv between ranks 0 and 1, a round trip halved
                    if rank == 0:
                        dist.send(whole, 1)
                        dist.recv(whole, 1)
                    else:
                        dist.recv(whole, 0)
                        dist.send(whole, 0)
                dist.barrier()

            once()
            seconds = _best_of(once, repeats) / (2 if kind == "send_recv" else 1)
            points.append((_bus_bytes(kind, n, 4 * elements), seconds))
        (small, t_small), (large, t_large) = points
        bandwidth = (large - small) / max(t_large - t_small, 1e-9)
        out[kind] = {"latency_s": max(t_small - small / bandwidth, 0.0), "bus_bytes_per_s": bandwidth, "ranks": n}
    return out


def hidden_fraction(compute_s: float, comm_s: float, both_s: float) -> float:
    """The share of the shorter of a computation and a collective that running them at once hid: the time the
    pair saved against one after the other, over the most it could save, clipped to 0..1."""
    return min(1.0, max(0.0, (compute_s + comm_s - both_s) / min(compute_s, comm_s)))


def measure_overlap(elements: int = 1 << 20, gemm_size: int = 256, repeats: int = 5) -> float:
    """On every rank of the default (gloo) group: ``hidden_fraction`` of an fp32 all-reduce of ``elements``
    started asynchronously while GEMMs of about its length run, against the two one after the other (the median
    of ``repeats`` rounds, every rank at once after a barrier); rank 0's figure is the one to keep."""
    import torch  # as measure_gemms
    import torch.distributed as dist
    buffer = torch.ones(elements)
    a, b = torch.randn(gemm_size, gemm_size), torch.randn(gemm_size, gemm_size)

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    comm = min(timed(lambda: dist.all_reduce(buffer)) for _ in range(repeats))
    one = min(timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    count = max(1, round(comm / one))  # GEMMs about as long as the collective: the most that can hide

    def gemms():
        for _ in range(count):
            torch.mm(a, b)

    def both():
        work = dist.all_reduce(buffer, async_op=True)
        gemms()
        work.wait()

    # The three timed side by side in each round, so a round's figure sees one load; the median round kept.
    rounds = sorted(hidden_fraction(timed(gemms), timed(lambda: dist.all_reduce(buffer)), timed(both))
                    for _ in range(repeats))
    return rounds[len(rounds) // 2]


def box_cores() -> int:
    """The cores this process, and the ranks it starts, may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def write_profile(path: str, gemms: List[List[float]], memory_bandwidth: float,
                  collectives: Dict[str, Dict[str, float]], ranks: int, overlap: float, cores: int) -> Hardware:
    """The ``cpu`` profile of these measurements (``gemms`` and ``memory_bandwidth``: one core's while every core
    computes), written to ``path`` as ``--hardware`` reads it."""
    peak = max(row[3] for row in gemms)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    doc = {"name": "cpu", "peak_flops": {"fp32": peak}, "hbm_bytes_per_s": memory_bandwidth,
           "memory_bytes": pages / ranks, "nvlink_bytes_per_s": collectives["all_reduce"]["bus_bytes_per_s"],
           "network_bytes_per_s": collectives["all_reduce"]["bus_bytes_per_s"], "gpus_per_node": 1 << 20,
           "sms": 1, "gemm_efficiency": 1.0, "gemm_table": gemms, "collectives": {"intra": collectives},
           "kernel_launch_s": 0.0, "attention_kernel": "materialized", "comm_overlap": overlap,
           "device": "cpu", "cores": cores,
           "source": f"ds-megatron plan --calibrate, {ranks} gloo ranks, {time.strftime('%Y-%m-%d %H:%M')}"}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    return load_hardware(path)  # read back as --hardware will, so a bad profile fails here


def _core_main(barrier, queue) -> None:
    """One of the box's cores, all measuring at once: a core's GEMM rates and copy bandwidth while the others work
    too (they share the chip's memory bandwidth, caches and clock)."""
    import torch
    torch.set_num_threads(1)
    gemms = measure_gemms(together=barrier.wait)
    barrier.wait()
    queue.put((gemms, measure_memory_bandwidth()))


def measure_busy_cores(cores: int) -> Tuple[List[List[float]], float]:
    """``measure_gemms`` and ``measure_memory_bandwidth`` on each of ``cores`` single-threaded processes at once;
    each figure the mean over the cores (one core's rate while every core computes)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(cores), ctx.Queue()
    procs = [ctx.Process(target=_core_main, args=(barrier, queue)) for _ in range(cores)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    gemms = [row[:3] + [sum(r[0][i][3] for r in results) / cores] for i, row in enumerate(results[0][0])]
    return gemms, sum(r[1] for r in results) / cores


def _rank_main(rank: int, ranks: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    result, overlap = measure_collectives(), measure_overlap()
    if rank == 0:
        queue.put((result, overlap))
    dist.barrier()
    dist.destroy_process_group()


def calibrate(path: str, ranks: int = 4, port: Optional[int] = None) -> Hardware:
    """Measure this box (every core computing at once, then ``ranks`` local gloo ranks) and write the profile to
    ``path``."""
    import torch.multiprocessing as mp
    if not 2 <= ranks <= 4:
        raise ConfigError(f"--calibrate-ranks {ranks}: measure with 2 to 4 local ranks")
    gemms, bandwidth = measure_busy_cores(box_cores())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, args=(r, ranks, port, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    collectives, overlap = queue.get(timeout=600)
    for p in procs:
        p.join()
    return write_profile(path, gemms, bandwidth, collectives, ranks, overlap, box_cores())
