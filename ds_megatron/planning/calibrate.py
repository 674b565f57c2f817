"""``ds-megatron plan --calibrate OUT.json``: this box measured into a ``planning.hardware`` profile named ``cpu``.

The one planning module that loads torch (inside its functions; ``plan`` stays torch-free otherwise): the cores
the ranks share (``os.sched_getaffinity``); fp32 GEMM rates by shape and the bandwidth a copy streams through
memory, one core's with every core of the box computing at once (one thread each, as a rank runs: they share the
chip's memory bandwidth, caches and clock), before the ranks start (the step-time model shares the cores out
among the ranks computing at each moment of the schedule: ``Hardware.core_share``); gloo's all-reduce, all-gather,
reduce-scatter, all-to-all and send/recv between local ranks, each fitted to ``latency + bus bytes / bus
bandwidth`` over the mean call at four sizes (bus bytes as ``comm_volume`` counts them), and the processor time
each rank spends in them fitted alike; how much of an
all-reduce started asynchronously a GEMM running meanwhile hides (``comm_overlap``); and the share of the clock's
kernel-by-kernel price a training loop reaches (``compute_efficiency``: reference GPT layers timed forward and
backward against the clock's price of them).
The file is what ``--hardware`` reads; the figures hold for this box at this load.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..config.model import GPTConfig
from ..errors import ConfigError
from ..parallel.layout import ParallelLayout
from .hardware import Hardware, hardware_from_dict, load_hardware
from .step_time import Run, _Pricer

GEMM_SIZES = (32, 64, 128, 256, 512, 1024)
MESSAGE_ELEMENTS = (256, 1 << 14, 1 << 17, 1 << 20)  # fp32: 1 KiB to 4 MiB, a layer's messages among them
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


# The reference the clock's prices are checked against on this box: a stack of pre-LN GPT layers (norm, fused
# QKV, causal attention, projection, residual add, norm, fc1, GELU, fc2, residual add), fp32, no dropout.
REFERENCE = dict(hidden=256, heads=8, seq=256, batch=2, layers=8)


def measure_reference_layers(hidden: int = REFERENCE["hidden"], heads: int = REFERENCE["heads"],
                             seq: int = REFERENCE["seq"], batch: int = REFERENCE["batch"],
                             layers: int = REFERENCE["layers"], repeats: int = 3) -> float:
    """Seconds of one reference layer's forward and backward in a training loop (the median of ``repeats`` passes
    of the whole stack, per layer): what a step pays beyond its kernels' rates alone (allocations, dispatch and
    autograd per operator, activations gone cold in cache by the time backward reads them) is in it."""
    import torch  # as measure_gemms
    import torch.nn.functional as F

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
            self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
            self.fc1, self.fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

        def forward(self, x):  # [s, b, h]
            q, k, v = self.qkv(self.norm1(x)).view(seq, batch, 3, heads, hidden // heads).permute(2, 1, 3, 0, 4)
            core = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(core.permute(2, 0, 1, 3).reshape(seq, batch, hidden))
            return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))

    stack = torch.nn.Sequential(*[Layer() for _ in range(layers)])
    x = torch.randn(seq, batch, hidden, requires_grad=True)

    def once():
        stack(x).sum().backward()

    once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / layers


def reference_price(hw: Hardware) -> float:
    """The clock's price on ``hw`` of one reference layer's forward and backward (``measure_reference_layers``)."""
    model = GPTConfig(num_layers=1, hidden_size=REFERENCE["hidden"], num_attention_heads=REFERENCE["heads"],
                      seq_length=REFERENCE["seq"], vocab_size=1024, hidden_dropout=0.0, attention_dropout=0.0,
                      position_embedding_type="learned_absolute")
    run = Run(model, ParallelLayout(1), "fp32", REFERENCE["batch"])
    return sum(cost.total for cost in _Pricer(run, hw, 1).layer(0, False))


def _bus_bytes(kind: str, n: int, nbytes: float) -> float:
    """nccl-tests' bus bytes of a collective over ``n`` ranks on a ``nbytes`` tensor (the whole one for the
    gathers, scatters and all-to-all, the message for send/recv)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    return nbytes if kind == "send_recv" else (n - 1) / n * nbytes


def fit_latency_bandwidth(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """``(latency_s, bytes_per_s)`` of ``seconds = latency + bytes / bandwidth`` fitted by least squares to
    ``(bytes, seconds)`` points (two or more sizes); a negative intercept reads as no latency."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = max(sum((x - mx) * (y - my) for x, y in points) / sxx, 1e-18) if sxx else 1e-18
    return max(my - slope * mx, 0.0), 1.0 / slope


def measure_collectives(sizes: Sequence[int] = MESSAGE_ELEMENTS, repeats: int = 30,
                        gemm_size: int = 256) -> Dict[str, Dict[str, float]]:
    """On every rank of the default (gloo) group: each collective's latency and bus bandwidth, fitted to the mean
    time of ``repeats`` calls at each message size, each call right after a GEMM of about 5 ms on every rank (as
    a step runs them: a layer's compute, then a collective), and again after one of about 0.15 ms (``short_*``: a
    collective right after another, as sequence parallelism's gather after the previous scatter).  The mean, not
    the fastest: a gloo call on a CPU box is bimodal (a 512 KiB all-reduce between two ranks took 0.25 ms at best
    and 2.4-2.7 ms on average, a training step's TP reductions 2.8 ms each), and a step pays the average over
    hundreds of them; the longer the compute before it, the slower the call (a 128 KiB all-gather over 4 ranks on
    2 cores: 4.2 ms after 0.5 ms of GEMM, 6.1 after 1.7, 9.6 after 9.5: the ranks arrive further apart and their
    gloo threads have gone to sleep).  ``gap_s`` and ``short_gap_s``: the GEMMs' mean wall time.  Send/recv: a
    round trip between the ranks of each pair (0-1, 2-3), halved.  The processor time the rank spent in each call
    (``time.process_time``, gloo's threads included: its copies, sums and polling) is fitted alike (``cpu_*``, after
    the long GEMM): on a box whose ranks share the cores it is taken from the ranks computing meanwhile (0.8 ms a
    4 KiB message each side here with 4 ranks on 2 cores, 0.2 ms with 2).  Rank 0's figures are the ones to keep
    (every rank returns its own)."""
    import torch  # as measure_gemms
    import torch.distributed as dist
    n, rank = dist.get_world_size(), dist.get_rank()
    a = torch.randn(gemm_size, gemm_size)
    gaps = {"long": torch.randn(gemm_size, 16 * gemm_size),  # about 5 ms on one core
            "short": torch.randn(gemm_size, gemm_size // 2)}  # about 0.15 ms
    peer = rank ^ 1 if (rank ^ 1) < n else None
    out = {}
    for kind in KINDS:
        fits = {}
        for gap, b in gaps.items():
            points, cpu_points, computed = [], [], 0.0
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
                    elif peer is not None:
                        if rank % 2 == 0:
                            dist.send(whole, peer)
                            dist.recv(whole, peer)
                        else:
                            dist.recv(whole, peer)
                            dist.send(whole, peer)

                once()
                dist.barrier()
                total = cpu = 0.0
                for _ in range(repeats):
                    start = time.perf_counter()
                    torch.mm(a, b)
                    computed += time.perf_counter() - start
                    start, start_cpu = time.perf_counter(), time.process_time()
                    once()
                    total += time.perf_counter() - start
                    cpu += time.process_time() - start_cpu
                calls = repeats * (2 if kind == "send_recv" else 1)
                bus = _bus_bytes(kind, n, 4 * elements)
                points.append((bus, total / calls))
                cpu_points.append((bus, cpu / calls))
            fits[gap] = (fit_latency_bandwidth(points), fit_latency_bandwidth(cpu_points),
                         computed / (repeats * len(sizes)))
        (latency, bandwidth), (cpu_latency, cpu_bandwidth), gap_s = fits["long"]
        (short_latency, short_bandwidth), _, short_gap_s = fits["short"]
        out[kind] = {"latency_s": latency, "bus_bytes_per_s": bandwidth, "ranks": n, "cpu_latency_s": cpu_latency,
                     "cpu_bytes_per_s": cpu_bandwidth, "gap_s": gap_s, "short_gap_s": short_gap_s,
                     "short_latency_s": short_latency, "short_bus_bytes_per_s": short_bandwidth}
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
                  collectives: Dict[str, Dict[str, float]], ranks: int, overlap: float, cores: int,
                  reference: Optional[float] = None) -> Hardware:
    """The ``cpu`` profile of these measurements (``gemms`` and ``memory_bandwidth``: one core's while every core
    computes; ``reference``: the seconds of ``measure_reference_layers``, whose price on the profile over them is
    its ``compute_efficiency``, 1 without), written to ``path`` as ``--hardware`` reads it."""
    peak = max(row[3] for row in gemms)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    doc = {"name": "cpu", "peak_flops": {"fp32": peak}, "hbm_bytes_per_s": memory_bandwidth,
           "memory_bytes": pages / ranks, "nvlink_bytes_per_s": collectives["all_reduce"]["bus_bytes_per_s"],
           "network_bytes_per_s": collectives["all_reduce"]["bus_bytes_per_s"], "gpus_per_node": 1 << 20,
           "sms": 1, "gemm_efficiency": 1.0, "gemm_table": gemms, "collectives": {"intra": collectives},
           "kernel_launch_s": 0.0, "attention_kernel": "materialized", "comm_overlap": overlap,
           "device": "cpu", "cores": cores, "compute_efficiency": 1.0,
           "source": f"ds-megatron plan --calibrate, {ranks} gloo ranks, {time.strftime('%Y-%m-%d %H:%M')}"}
    if reference is not None:
        doc["compute_efficiency"] = reference_price(hardware_from_dict(doc, where=path)) / reference
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
    bandwidth = measure_memory_bandwidth()
    barrier.wait()
    queue.put((gemms, bandwidth, measure_reference_layers()))


def measure_busy_cores(cores: int) -> Tuple[List[List[float]], float, float]:
    """``measure_gemms``, ``measure_memory_bandwidth`` and ``measure_reference_layers`` on each of ``cores``
    single-threaded processes at once; each figure the mean over the cores (one core's while every core
    computes)."""
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
    return gemms, sum(r[1] for r in results) / cores, sum(r[2] for r in results) / cores


def _rank_main(rank: int, ranks: int, store: str, queue) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    result, overlap = measure_collectives(), measure_overlap()
    if rank == 0:
        queue.put((result, overlap))
    dist.barrier()
    dist.destroy_process_group()


def calibrate(path: str, ranks: int = 4) -> Hardware:
    """Measure this box (every core computing at once, then ``ranks`` local gloo ranks) and write the profile to
    ``path``.  The ranks meet through a file store in a fresh directory: no port to choose (one picked free can be
    taken before the store listens on it)."""
    import torch.multiprocessing as mp
    if not 2 <= ranks <= 4:
        raise ConfigError(f"--calibrate-ranks {ranks}: measure with 2 to 4 local ranks")
    gemms, bandwidth, reference = measure_busy_cores(box_cores())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ds-megatron-calibrate-") as where:
        store = os.path.join(where, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, ranks, store, queue)) for r in range(ranks)]
        for p in procs:
            p.start()
        collectives, overlap = queue.get(timeout=600)
        for p in procs:
            p.join()
    return write_profile(path, gemms, bandwidth, collectives, ranks, overlap, box_cores(), reference)
