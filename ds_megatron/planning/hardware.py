"""The machine a plan's clock runs on, as data: peak rates, memory, links (``ds-megatron plan --hardware``).

Four built-in GPUs from NVIDIA's published datasheets, or any JSON file with the same fields (``cpu``: the one
``ds-megatron plan --calibrate`` writes after measuring this box).  Every rate is in bytes or FLOP per second;
link bandwidths are per GPU and per direction (a datasheet's bidirectional NVLink figure halved).

What a program achieves of a peak is a physical constant of the kernels, named here once, not per job:

* ``gemm_efficiency``: the share of the dense tensor-core peak cuBLAS sustains on large, well-shaped GEMMs;
  smaller GEMMs lose more to wave quantization (``TILE``: tiles of 128 x 256 outputs, one per SM per wave,
  NVIDIA's "Matrix Multiplication Background" guide) and to the HBM roofline;
* ``HBM_EFFICIENCY``: the share of the HBM bandwidth streaming kernels reach (STREAM / BabelStream);
* ``LINK_EFFICIENCY``: the share of a link's bandwidth NCCL's ring collectives reach as bus bandwidth
  (nccl-tests' busbw against the wire rate);
* ``FLASH_ATTENTION_EFFICIENCY``: FlashAttention-2's share of the peak, forward and backward (Dao 2023,
  head dim 128).

A measured profile (``cpu``) replaces the curve by its table of GEMM rates by shape and the ring constants by
measured latency and bus bandwidth per collective.

Where a device's kernels keep different tensors for backward, the activation plan (``planning.memory``) follows
the profile's ``device``: ``DeviceKernels``, ``CPU_KERNELS`` for the calibrated ``cpu`` profile (what the plan's
tests measure), ``CUDA_KERNELS`` for the GPUs.

``comm_overlap``: the share (0..1) of a collective's time that compute running at the same time hides, for the
collectives a step overlaps (CP's ring, ``overlap_grad_reduce``, ``overlap_param_gather``).  1 on a GPU, where
NCCL moves bytes on its own SMs and copy engines; ``--calibrate`` measures it on a CPU box, where gloo and the
GEMMs share the same cores.

``compute_efficiency``: the share of the clock's kernel-by-kernel price (GEMMs at the profile's rates, memory-bound
work at its bandwidth) a training loop reaches; every compute price is divided by it.  1 on the GPUs, whose
``gemm_efficiency`` and ``HBM_EFFICIENCY`` are sustained figures already.  On a CPU the kernels' rates alone miss
what a step also pays per operator (allocation, dispatch, autograd) and for activations that have gone cold in
cache by backward: ``--calibrate`` times a stack of reference GPT layers (``calibrate.REFERENCE``) forward and
backward on every core at once and divides the clock's price of them by the time (0.83-0.90 on this project's 2-core
EPYC box).

``cores``: the cores every rank of a one-node CPU job shares (``--calibrate`` reads ``os.sched_getaffinity``).
Its GEMM and memory rates are one rank's on a core while every core computes; while ``k`` ranks compute, each runs at
``core_share(k)`` of them, ``min(1, cores / k)`` (the scheduler time-slices the cores among the ranks that
compute; a rank waiting for a message sleeps).  A collective's processor time (gloo copies, sums and polls on the
same cores: ``CollectiveRate``'s CPU fit, 0.2-1.2 ms a call here) is work that takes its share of the cores like
compute; the rest of its wall time the rank waits.  ``None``: a device per rank (the GPUs), and
the ``cpu`` profiles written before the field, whose rates were measured with every rank computing at once.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from ..errors import ConfigError

TILE = (128, 256)  # outputs per CTA tile of cuBLAS's large-GEMM kernels (Ampere / Hopper / Blackwell)
HBM_EFFICIENCY = 0.85  # BabelStream triad on A100 80GB: ~1.73 of 2.04 TB/s
LINK_EFFICIENCY = 0.8  # nccl-tests all-reduce busbw: ~230-240 GB/s of NVLink3's 300 GB/s per direction on DGX A100
FLASH_ATTENTION_EFFICIENCY = (0.70, 0.55)  # FlashAttention-2 on A100, head dim 128: forward, backward
KERNEL_LAUNCH_S = 4e-6  # one CUDA kernel's launch and tail, the floor of a small GEMM
GIB = 2 ** 30


def ring_steps(kind: str, n: int) -> int:
    """The steps of a ring collective over ``n`` ranks, each paying a hop's latency."""
    return {"all_reduce": 2 * (n - 1), "send_recv": 1}.get(kind, n - 1)


@dataclass(frozen=True)
class DeviceKernels:
    """The habits of a device's kernels that change what a layer keeps for backward (``planning.memory``).

    ``math_attention_under_dropout``: with ``attention_dropout > 0`` torch's CPU attention falls back to the math
    kernel, which keeps ``s x s`` probabilities, dropout mask and dropped probabilities (16-bit models: in fp32,
    beside fp32 copies of q, k and v); CUDA's flash / memory-efficient kernels keep the RNG state instead.
    ``fp8_gemm_fp32_copies``: the CPU's ``torch._scaled_mm`` makes fp32 copies of its fp8 operands and an fp32
    output; a GPU's reads the fp8 bytes.  ``dropout_mask_in_input_dtype``: the CPU's dropout keeps its scaled mask
    in the input's dtype; CUDA's fused dropout a one-byte mask.  ``padded_grouped_gemm``: grouped MoE experts
    (``moe_grouped_gemm``) run on a CPU as one batched GEMM over copies of their token groups padded to the largest
    (kept for backward); CUDA's ``torch._grouped_mm`` reads the rows in place.  ``rng_state_bytes``: a generator
    state a recomputation checkpoint keeps in the memory planned (a CPU's mt19937 state; a GPU's are host
    tensors)."""

    name: str
    math_attention_under_dropout: bool
    fp8_gemm_fp32_copies: bool
    dropout_mask_in_input_dtype: bool
    padded_grouped_gemm: bool
    rng_state_bytes: int


CPU_KERNELS = DeviceKernels("cpu", math_attention_under_dropout=True, fp8_gemm_fp32_copies=True,
                            dropout_mask_in_input_dtype=True, padded_grouped_gemm=True,
                            rng_state_bytes=5056)
CUDA_KERNELS = DeviceKernels("cuda", math_attention_under_dropout=False, fp8_gemm_fp32_copies=False,
                             dropout_mask_in_input_dtype=False, padded_grouped_gemm=False,
                             rng_state_bytes=0)
DEVICE_KERNELS = {k.name: k for k in (CPU_KERNELS, CUDA_KERNELS)}


@dataclass(frozen=True)
class CollectiveRate:
    """A measured collective: time = ``latency_s`` + bus bytes / ``bus_bytes_per_s``, the latency measured over
    ``ranks`` ranks scaled by ``ring_steps`` to a group of another size (``ranks`` 0: as measured, any size).
    ``cpu_latency_s`` and ``cpu_bytes_per_s``: the same fit of the processor time each rank spent in the call
    (gloo's copies, sums and polling on a CPU box, which the cores computing meanwhile do not get); 0: none.
    ``gap_s``: the wall time each rank computed before each measured call; ``short_*``: the same fit measured after
    ``short_gap_s`` of compute (on a CPU box a call right after another costs less than one after a layer's work:
    its ranks arrive together and their gloo threads are awake); a call after a gap between the two is priced
    between the fits, on a log scale of the gap; 0: no dependence measured."""

    latency_s: float
    bus_bytes_per_s: float
    ranks: int = 0
    cpu_latency_s: float = 0.0
    cpu_bytes_per_s: float = 0.0
    gap_s: float = 0.0
    short_gap_s: float = 0.0
    short_latency_s: float = 0.0
    short_bus_bytes_per_s: float = 0.0

    def seconds(self, latency_scale: float, bus_bytes: float, gap: Optional[float] = None) -> float:
        """One call's wall time: the fit at ``gap_s`` (``gap`` None: a call after a layer's work or more), or
        after ``gap`` seconds of compute, between the short and the long fit on a log scale of the gap."""
        long = self.latency_s * latency_scale + bus_bytes / self.bus_bytes_per_s
        if gap is None or not self.short_gap_s or gap >= self.gap_s:
            return long
        short = self.short_latency_s * latency_scale + bus_bytes / self.short_bus_bytes_per_s
        if gap <= self.short_gap_s:
            return short
        share = math.log(gap / self.short_gap_s) / math.log(self.gap_s / self.short_gap_s)
        return short + (long - short) * share

    def cpu_seconds(self, latency_scale: float, bus_bytes: float) -> float:
        """One call's processor time (0 where none was measured)."""
        return self.cpu_latency_s * latency_scale + (bus_bytes / self.cpu_bytes_per_s if self.cpu_bytes_per_s else 0.0)


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links.  ``peak_flops``: dense peak per dtype (``bf16``, ``fp16``, ``fp8``,
    ``fp32``); ``gemm_table``: measured ``[m, n, k, flop/s]`` rows replacing the wave-quantization curve;
    ``collectives``: measured rates by link (``"intra"`` / ``"inter"``) and kind (``all_reduce``,
    ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``send_recv``), replacing the ring model."""

    name: str
    peak_flops: Dict[str, float]
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float  # per GPU, per direction
    network_bytes_per_s: float  # per GPU, per direction (the node's NICs / its GPUs)
    gpus_per_node: int = 8
    sms: int = 108
    gemm_efficiency: float = 0.8
    hop_latency_s: Dict[str, float] = field(default_factory=lambda: {"intra": 2e-6, "inter": 5e-6})
    gemm_table: Optional[List[List[float]]] = None
    collectives: Optional[Dict[str, Dict[str, CollectiveRate]]] = None
    kernel_launch_s: float = KERNEL_LAUNCH_S
    attention_kernel: str = "flash"  # "flash" (causal blocks skipped) or "materialized" (scores through memory)
    comm_overlap: float = 1.0  # share of an overlapped collective that concurrent compute hides
    source: str = ""
    device: str = "cuda"  # whose kernels' habits the activation plan counts (DEVICE_KERNELS): "cuda" or "cpu"
    cores: Optional[int] = None  # cores the ranks of a one-node CPU job share; None: a device per rank
    compute_efficiency: float = 1.0  # the share of the kernel-by-kernel price a training loop reaches

    def core_share(self, busy_ranks: float) -> float:
        """The share of its own rate each of ``busy_ranks`` ranks computing at once gets of the ``cores``."""
        return 1.0 if not self.cores or busy_ranks <= self.cores else self.cores / busy_ranks

    @property
    def kernels(self) -> DeviceKernels:
        return DEVICE_KERNELS[self.device]

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops or not self.peak_flops[dtype]:
            raise ConfigError(f"--hardware {self.name} has no {dtype} peak (peak_flops has "
                              f"{sorted(k for k, v in self.peak_flops.items() if v)}); choose another params dtype "
                              "or hardware")
        return self.peak_flops[dtype]

    def gemm_time(self, m: float, n: float, k: float, dtype: str, batch: float = 1) -> float:
        """Seconds of ``batch`` GEMMs of [m, k] x [k, n] in ``dtype``."""
        if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
            return 0.0
        flops = 2.0 * m * n * k * batch
        if self.gemm_table:
            return flops / (self._table_rate(m, n, k) * self.compute_efficiency) + self.kernel_launch_s
        tiles = math.ceil(m / TILE[0]) * math.ceil(n / TILE[1]) * batch
        waves = math.ceil(tiles / self.sms)
        compute = flops / (self.peak(dtype) * self.gemm_efficiency * tiles / (waves * self.sms))
        size = 1 if dtype == "fp8" else 4 if dtype == "fp32" else 2
        memory = (m * k + k * n + m * n) * batch * size / (self.hbm_bytes_per_s * HBM_EFFICIENCY)
        return max(compute, memory) / self.compute_efficiency + self.kernel_launch_s

    def _table_rate(self, m: float, n: float, k: float) -> float:
        """The measured rate at the nearest size (geometric mean of the three sides, on a log scale),
        interpolated between the two measured sizes around it."""
        size = math.log((m * n * k) ** (1 / 3))
        rows = sorted((math.log((r[0] * r[1] * r[2]) ** (1 / 3)), r[3]) for r in self.gemm_table)
        if size <= rows[0][0]:
            return rows[0][1]
        for (x0, y0), (x1, y1) in zip(rows, rows[1:]):
            if size <= x1:
                return y0 + (y1 - y0) * (size - x0) / (x1 - x0) if x1 > x0 else y1
        return rows[-1][1]

    def memory_time(self, nbytes: float) -> float:
        """Seconds to stream ``nbytes`` through HBM (read and written bytes counted apart)."""
        return nbytes / (self.hbm_bytes_per_s * HBM_EFFICIENCY * self.compute_efficiency)

    def collective_time(self, kind: str, n: int, bus_bytes: float, inter_node: bool,
                        gap: Optional[float] = None) -> float:
        """Seconds of one collective of ``kind`` over ``n`` ranks moving ``bus_bytes`` (nccl-tests bus bytes,
        as ``planning.comm_volume`` counts them): the latency of its steps plus the bytes at the bus bandwidth
        of the link it crosses; ``gap``: the wall seconds its ranks computed before it, where a measured rate
        depends on them (``CollectiveRate.seconds``; None: a layer's work or more)."""
        if n <= 1 or bus_bytes <= 0:
            return 0.0
        if self.collectives:
            rate, scale = self._measured(kind, n, inter_node)
            return rate.seconds(scale, bus_bytes, gap)
        steps = ring_steps(kind, n)
        bandwidth = (self.network_bytes_per_s if inter_node else self.nvlink_bytes_per_s) * LINK_EFFICIENCY
        return steps * self.hop_latency_s["inter" if inter_node else "intra"] + bus_bytes / bandwidth

    def collective_cpu_time(self, kind: str, n: int, bus_bytes: float, inter_node: bool) -> float:
        """Processor seconds each rank spends in that collective (``CollectiveRate``'s CPU fit, its latency scaled
        as ``collective_time`` scales it); 0 where none was measured (the GPUs: NCCL moves bytes on the device)."""
        if n <= 1 or bus_bytes <= 0 or not self.collectives:
            return 0.0
        rate, scale = self._measured(kind, n, inter_node)
        return rate.cpu_seconds(scale, bus_bytes)

    def _measured(self, kind: str, n: int, inter_node: bool) -> Tuple[CollectiveRate, float]:
        """The measured rate of ``kind`` on the link (an all-reduce's where the kind was not measured) and the
        factor that scales its latency from the measured group to ``n`` ranks by ring steps."""
        rates = self.collectives.get("inter" if inter_node else "intra") or self.collectives["intra"]
        kind = kind if kind in rates else "all_reduce"
        rate = rates[kind]
        return rate, ring_steps(kind, n) / ring_steps(kind, rate.ranks) if rate.ranks else 1.0

    def measured_core_share(self) -> float:
        """The ``core_share`` each rank had while the collectives were measured (every measuring rank in the call
        at once): a call's processor time took its wall time over this much of a core."""
        ranks = max((rate.ranks for rates in (self.collectives or {}).values() for rate in rates.values()),
                    default=0)
        return self.core_share(ranks) if ranks else 1.0

    def to_json(self) -> Dict:
        return asdict(self)


TB, GB = 1e12, 1e9

# NVIDIA A100 Tensor Core GPU datasheet (2021, SXM4 80GB): BF16/FP16 312 TFLOPS dense, FP32 19.5, HBM2e
# 2,039 GB/s, NVLink 3 600 GB/s (bidirectional), 108 SMs; DGX A100: eight 200 Gb/s HDR InfiniBand NICs for eight
# GPUs (25 GB/s each).  cuBLAS reaches ~0.8 of the peak on large bf16 GEMMs.
A100 = Hardware("a100", {"bf16": 312 * TB, "fp16": 312 * TB, "fp32": 19.5 * TB}, 2039 * GB, 80 * GIB, 300 * GB,
                25 * GB, sms=108, gemm_efficiency=0.8, source="NVIDIA A100 datasheet; DGX A100 user guide")
# NVIDIA H100 datasheet (SXM5): BF16 989 TFLOPS dense, FP8 1,979 dense, FP32 67, HBM3 3.35 TB/s, NVLink 4
# 900 GB/s, 132 SMs; DGX H100: eight 400 Gb/s ConnectX-7 NICs (50 GB/s per GPU).  cuBLAS: ~0.7 of the peak.
H100 = Hardware("h100", {"bf16": 989 * TB, "fp16": 989 * TB, "fp8": 1979 * TB, "fp32": 67 * TB}, 3350 * GB,
                80 * GIB, 450 * GB, 50 * GB, sms=132, gemm_efficiency=0.7,
                source="NVIDIA H100 datasheet; DGX H100 user guide")
# NVIDIA H200 datasheet (SXM): H100's compute, HBM3e 4.8 TB/s and 141 GB, NVLink 900 GB/s; DGX H200: 400 Gb/s
# per GPU.
H200 = Hardware("h200", {"bf16": 989 * TB, "fp16": 989 * TB, "fp8": 1979 * TB, "fp32": 67 * TB}, 4800 * GB,
                141 * GB, 450 * GB, 50 * GB, sms=132, gemm_efficiency=0.7,
                source="NVIDIA H200 datasheet; DGX H200 user guide")
# NVIDIA HGX B200 / DGX B200 datasheet: per GPU BF16 2.25 PFLOPS dense, FP8 4.5 dense, HBM3e 8 TB/s and 180 GB,
# NVLink 5 1.8 TB/s, 148 SMs; DGX B200: eight 400 Gb/s ConnectX-7 NICs.
B200 = Hardware("b200", {"bf16": 2250 * TB, "fp16": 2250 * TB, "fp8": 4500 * TB, "fp32": 80 * TB}, 8000 * GB,
                180 * GB, 900 * GB, 50 * GB, sms=148, gemm_efficiency=0.7,
                source="NVIDIA DGX B200 / HGX B200 datasheets")

BUILT_IN = {h.name: h for h in (A100, H100, H200, B200)}


def hardware_from_dict(doc: Dict, where: str = "hardware") -> Hardware:
    """A ``Hardware`` from its JSON form (``to_json``); ConfigError naming the field on a bad one."""
    names = {f for f in Hardware.__dataclass_fields__}
    unknown = sorted(set(doc) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(sorted(names))}")
    doc = dict(doc)
    if doc.get("collectives"):
        doc["collectives"] = {link: {kind: CollectiveRate(**rate) for kind, rate in kinds.items()}
                              for link, kinds in doc["collectives"].items()}
    if doc.get("attention_kernel", "flash") not in ("flash", "materialized"):
        raise ConfigError(f"{where}: attention_kernel={doc['attention_kernel']!r} is unknown; use \"flash\" or "
                          "\"materialized\"")
    if doc.get("device", "cuda") not in DEVICE_KERNELS:
        raise ConfigError(f"{where}: device={doc['device']!r} is unknown; use \"cuda\" or \"cpu\"")
    if not 0.0 <= doc.get("comm_overlap", 1.0) <= 1.0:
        raise ConfigError(f"{where}: comm_overlap={doc['comm_overlap']!r} is outside 0..1; give the share of a "
                          "collective hidden behind concurrent compute (ds-megatron plan --calibrate measures it)")
    efficiency = doc.get("compute_efficiency", 1.0)
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0.0 < efficiency <= 2.0:
        raise ConfigError(f"{where}: compute_efficiency={efficiency!r} is outside (0, 2]; give the share of the "
                          "kernel-by-kernel price a training loop reaches (ds-megatron plan --calibrate measures it)")
    cores = doc.get("cores")
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise ConfigError(f"{where}: cores={cores!r} is not a positive number of cores; give the cores the ranks "
                          "share (ds-megatron plan --calibrate records them), or null for a device per rank")
    try:
        return Hardware(**doc)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}; give every field of a built-in profile (ds-megatron plan --calibrate "
                          "writes one)") from None


def load_hardware(spec: str) -> Hardware:
    """A built-in name (``a100``, ``h100``, ``h200``, ``b200``) or a JSON file."""
    if spec.lower() in BUILT_IN:
        return BUILT_IN[spec.lower()]
    if not os.path.exists(spec):
        raise ConfigError(f"--hardware {spec!r} is neither a built-in profile ({', '.join(BUILT_IN)}) nor a file; "
                          "give one of them, or write a profile with ds-megatron plan --calibrate")
    with open(spec, encoding="utf-8") as f:
        return hardware_from_dict(json.load(f), where=f"--hardware {spec}")
