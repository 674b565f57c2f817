"""The predicted time of one training step (``ds-megatron plan --hardware``), from the config alone (pure, no torch).

Each rank's work per micro-batch and model chunk is priced on a ``planning.hardware`` profile:

* GEMMs at the profile's rate for their shape and dtype (forward; backward's input-gradient GEMM, which the
  previous stage waits for, B; its weight-gradient GEMM, W): QKV (or MLA's projections), the attention output
  projection, the MLP (an MoE layer: the router, its local experts' grouped GEMMs under balanced routing, the
  shared expert), the output layer;
* the attention core: a flash kernel does half the ``s x s`` work of causal attention, at FlashAttention-2's
  efficiency (backward 2.5x the forward's FLOPs); a ``"materialized"`` kernel (Megatron-LM 2021's, the CPU's)
  runs ``Q K^T`` and ``P V`` as batched GEMMs in full and streams the scores through memory (softmax, dropout);
  under CP's p2p ring there, the ring's block pairs one by one as it computes them (``ring_blocks``);
* memory-bound work at HBM bandwidth: norms, bias-dropout-residual adds, the activation, RoPE, MoE's permutes,
  the embedding, the cross entropy's fp32 logits (backward: ``ELEMENTWISE_BACKWARD`` x the forward's bytes);
* collectives at the latency and bus bandwidth of the link their group crosses (inside a node or between nodes,
  from the rank order and ``gpus_per_node``), with ``planning.comm_volume``'s bus bytes (a measured profile's rate
  by the compute before the collective: ``Hardware.collective_time``'s ``gap``): TP's reductions, each after its
  block's work (sequence parallel: gathers right after the previous scatter, scatters after a block), exposed;
  the CP ring's K/V, hidden behind the attention core (the profile's ``comm_overlap`` share of what the core
  covers: ``exposed``), the all-gather and all-to-all variants exposed;
  MoE's all-to-all over EP and, with ETP, the all-gather and reduce-scatter of the routed tokens over ETP,
  exposed; each pipeline message delays its receiver;
* recomputation's extra forward: a ``"full"`` layer's forward up to a dense MLP's fc2 input, an MoE layer's through
  its experts, shared expert and exchanges (torch's checkpoint stops at the last tensor backward needs;
  ``recompute_whole_layer``: Megatron-LM 2021's reentrant checkpoint reruns all of it), selective ``core_attn`` the
  core, ``mlp`` the MLP up to fc2, ``moe`` the MoE layer as a whole layer's rerun runs it;
* the pipeline: every rank's order of the schedule table (``pipeline_parallel.schedule_table``: 1F1B,
  interleaved, ZB-H1; uneven stages by their own costs) run against the data dependencies
  (``simulate_pipeline``); the idle time on the slowest rank is the bubble;
* ranks sharing fewer cores (a ``cpu`` profile's ``cores``, fewer than the job's ranks): the same orders run with
  every rank's work at ``core_share`` of its rate for the ranks computing at that moment, the processor time of
  its collectives and of each pipeline message it sends or receives (gloo's copies and polling) as work too, the
  rest of a collective's time, a message's delay and the bubble taking no core (``shared_parts``,
  ``simulate_shared_pipeline``), the step's end (below) in the same timeline; the breakdown's ``pp_comm_s`` is the
  slowest rank's messages' processor time, ``core_sharing_s`` its wait for a core;
* after the last backward: the gradient reduction over ``dp-cp`` (fp32 buffers; a reduce-scatter with the
  distributed optimizer), with ``overlap_grad_reduce`` hidden behind the last micro-batch's backward but for its
  last bucket; the tied embedding's all-reduce; the optimizer step (``OPTIMIZER_BYTES`` per owned parameter
  through HBM); the distributed optimizer's parameter all-gather, behind the next forward with
  ``overlap_param_gather`` (both hidden by the ``comm_overlap`` share, as the ring).

The step is the slowest rank's; the breakdown is that rank's, its parts adding up to the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..config.model import pad_vocab_size
from ..errors import ConfigError
from ..pipeline_parallel.schedule_table import (rank_operations, receives_of, sends_of, simulate_pipeline,
                                                simulate_shared_pipeline)
from .comm_volume import _all_reduce, _gather_or_scatter
from .flops import model_flops
from .hardware import FLASH_ATTENTION_EFFICIENCY, Hardware
from .memory import BYTES, kv_heads_per_rank, selective_recompute
from .param_counts import gpt_param_counts, pipeline_rank_chunks

ELEMENTWISE_BACKWARD = 2.0  # a memory-bound op's backward reads its saved input and the incoming gradient, writes one
FLASH_BACKWARD_FLOPS = 2.5  # FlashAttention's backward: five GEMMs of the forward's two, per block
# Adam's step per owned parameter: the fp32 param and both moments read and written (24), the fp32 grad read (4),
# the 16-bit param written (2), the grad read again for the global norm (4).  SGD: param, grad, momentum.
OPTIMIZER_BYTES = {"adam": 34, "adamw": 34, "sgd": 20}
# The p2p ring's passes per block pair over its fp32 scores and over its output rows (``ring_blocks``), forward and
# backward, as ``transformer.context_parallel`` runs them (counted at the dispatcher by tests/test_plan_ring.py):
# forward the scale, the log-sum-exp's read, ``s - lse`` and ``exp`` (7); the merge's two rescales and its add (7);
# backward the scale, ``s - lse``, ``exp``, ``dP - delta`` and ``P * (...)`` (11); ``dQ`` and ``dK`` scaled and
# three accumulations (13).  A diagonal pair's mask: one more read and write of its scores each way.
RING_PAIR_PASSES = {"forward": (7, 7), "backward": (11, 13)}
RING_MASK_PASSES = 2
PARTS = ("gemm", "attention", "elementwise", "tp_comm", "cp_comm", "moe_comm", "recompute")
COMM_PARTS = ("tp_comm", "cp_comm", "moe_comm")  # a rank in these waits in a collective: it computes nothing


@dataclass(frozen=True)
class Run:
    """What the clock reads of a job: the model, the layout and how a step runs it (``report.run_from_job``)."""

    model: object  # GPTConfig
    layout: object  # ParallelLayout
    params_dtype: str = "bf16"
    micro_batch: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    vpp: int = 1
    partition_method: str = "uniform"
    layers_per_stage: Optional[Sequence[int]] = None
    first: Optional[int] = None
    last: Optional[int] = None
    group_size: Optional[int] = None
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_fp32: bool = True
    optimizer_type: str = "adamw"
    bucket_size: Optional[int] = None
    hierarchical_inner: Optional[int] = None
    recompute_whole_layer: bool = False


@dataclass(frozen=True)
class Comm:
    """A collective's (or several's) seconds: ``wall``, what the rank waits in it (or, hidden behind compute, what
    is left exposed), and ``cpu``, the processor time it takes on the rank's core meanwhile (gloo on a CPU box:
    ``Hardware.collective_cpu_time``; 0 on a GPU), hidden or not."""

    wall: float = 0.0
    cpu: float = 0.0

    def __add__(self, other: "Comm") -> "Comm":
        return Comm(self.wall + other.wall, self.cpu + other.cpu)

    def __mul__(self, k: float) -> "Comm":
        return Comm(self.wall * k, self.cpu * k)

    __rmul__ = __mul__


@dataclass
class Cost:
    """Seconds by part (``PARTS``) of one phase: a chunk's forward, its B or its W, per micro-batch; ``comm``: the
    seconds of them the rank waits in collectives (``COMM_PARTS``, and those inside a recomputed forward);
    ``cpu``: by part, the processor seconds of its collectives (``Comm.cpu``)."""

    parts: Dict[str, float] = field(default_factory=dict)
    comm: float = 0.0
    cpu: Dict[str, float] = field(default_factory=dict)

    def add(self, part: str, seconds, comm: Optional[float] = None, cpu: float = 0.0) -> None:
        """``seconds``: a float, or a ``Comm`` (its wall time, its processor time added to ``cpu``); ``comm``: the
        collectives' seconds among them (default: all of them for a ``COMM_PARTS``); ``cpu``: their processor
        time."""
        if isinstance(seconds, Comm):
            seconds, cpu = seconds.wall, cpu + seconds.cpu
        if seconds:
            self.parts[part] = self.parts.get(part, 0.0) + seconds
            self.comm += (seconds if part in COMM_PARTS else 0.0) if comm is None else comm
        if cpu:
            self.cpu[part] = self.cpu.get(part, 0.0) + cpu

    def merge(self, other: "Cost", scale: float = 1.0, as_part: Optional[str] = None) -> None:
        for part, seconds in other.parts.items():
            self.add(as_part or part, seconds * scale, comm=0.0)
        for part, seconds in other.cpu.items():
            self.add(as_part or part, 0.0, comm=0.0, cpu=seconds * scale)
        self.comm += other.comm * scale

    @property
    def comm_cpu(self) -> float:
        return sum(self.cpu.values())

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass(frozen=True)
class StepTime:
    """The predicted step: its length, the job's model FLOPs (causal attention in full), and the slowest rank's
    breakdown in seconds (its parts add up to ``step_time_s``)."""

    step_time_s: float
    model_flops: float
    world_size: int
    peak_flops: float
    breakdown: Dict[str, float]
    stage: int

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / (self.step_time_s * self.world_size) / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time_s * self.world_size * self.peak_flops)

    def to_json(self) -> Dict:
        return {"step_time_s": self.step_time_s, "model_tflops_per_gpu": self.model_tflops_per_gpu,
                "mfu": self.mfu, "flop_convention": "causal attention counted in full (the published tables')",
                "critical_stage": self.stage, "breakdown": self.breakdown}


def exposed(hw: Hardware, comm: Comm, compute_s: float) -> Comm:
    """A collective ``comm`` run beside ``compute_s`` of compute: the profile's ``comm_overlap`` share of the wall
    time the compute covers is hidden (all of it on a GPU, little on a CPU whose cores do both); its processor
    time is not."""
    return Comm(comm.wall - hw.comm_overlap * min(comm.wall, compute_s), comm.cpu)


def collective(hw: Hardware, kind: str, n: int, bus: float, inter_node: bool, gap: Optional[float] = None) -> Comm:
    """One collective's wall and processor seconds on ``hw`` (``gap``: the wall seconds of compute before it)."""
    return Comm(hw.collective_time(kind, n, bus, inter_node, gap), hw.collective_cpu_time(kind, n, bus, inter_node))


def group_spans_nodes(layout, token: str, gpus_per_node: int, expert: bool = False) -> bool:
    """Whether the group of ``token`` (``"tp"``, ``"dp-cp"``, ``"pp"``, ...) holding rank 0 spans more than one
    node: its ranks from the rank order's strides (the first dimension fastest)."""
    generator = layout.expert_generator() if expert else layout.dense_generator()
    order = generator.order.split("-")
    sizes = dict(zip(order, generator.ordered_size))
    wanted = token.split("-")
    stride, span = 1, 0
    for dim in order:
        if dim in wanted:
            span += stride * (sizes[dim] - 1)
        stride *= sizes[dim]
    return span >= gpus_per_node


class _Pricer:
    """Prices one run's work on one hardware profile (the links each group crosses decided once)."""

    def __init__(self, run: Run, hw: Hardware, gpus_per_node: int):
        self.run, self.hw, self.cfg, self.layout = run, hw, run.model, run.layout
        lay = self.layout
        self.inter = {kind: group_spans_nodes(lay, kind, gpus_per_node) for kind in ("tp", "cp", "dp-cp", "pp")}
        self.inter["ep"] = group_spans_nodes(lay, "ep", gpus_per_node, expert=True)
        self.inter["edp"] = group_spans_nodes(lay, "dp", gpus_per_node, expert=True)
        self.inter["etp"] = group_spans_nodes(lay, "tp", gpus_per_node, expert=True)
        self.act = BYTES[run.params_dtype]
        self.tokens = run.micro_batch * self.cfg.seq_length / lay.cp  # this rank's tokens of a micro-batch
        self.sp = self.cfg.sequence_parallel and lay.tp > 1
        self.layers: Dict[Tuple[bool, bool, bool], Tuple[Cost, Cost, Cost]] = {}  # by what a layer's price reads
        # The search prices many variants of one run: a chunk's price, a stage's parameters and the step's FLOPs
        # depend on its layers (and ends), not on the schedule, so each is made once (and never modified).
        self.chunks: Dict[Tuple[int, int, bool, bool], Tuple[Cost, Cost, Cost]] = {}
        self.counts: Dict[Tuple[Tuple[int, ...], bool, bool], object] = {}
        self.flops: Dict[float, float] = {}
        self.splits: Dict[Tuple, List[List[range]]] = {}

    def coll(self, kind: str, group: str, n: int, bus: float, gap: Optional[float] = None) -> Comm:
        return collective(self.hw, kind, n, bus, self.inter[group], gap)

    def gemm(self, fwd: Cost, b: Cost, w: Cost, m: float, n: float, k: float, dtype: str, batch: float = 1,
             weight: bool = True) -> float:
        """A linear layer's forward GEMM [m, k] x [k, n] and its backward: the input gradient (B) and, for a
        weight, the weight gradient (W).  Returns the forward's seconds."""
        t = self.hw.gemm_time(m, n, k, dtype, batch)
        fwd.add("gemm", t)
        b.add("gemm", self.hw.gemm_time(m, k, n, dtype, batch))
        if weight:
            w.add("gemm", self.hw.gemm_time(n, k, m, dtype, batch))
        return t

    def layer(self, index: int, recomputed: bool) -> Tuple[Cost, Cost, Cost]:
        """(forward, B, W) of transformer layer ``index`` for one micro-batch on one rank (priced once per kind:
        dense or MoE, fp8 or not, recomputed or not)."""
        key = (self.cfg.is_moe_layer(index), self.cfg.fp8_layer(index), recomputed)
        if key not in self.layers:
            self.layers[key] = self._layer(index, recomputed)
        return self.layers[key]

    def _layer(self, index: int, recomputed: bool) -> Tuple[Cost, Cost, Cost]:
        cfg, run, hw, lay = self.cfg, self.run, self.hw, self.layout
        t, cp, T, a = lay.tp, lay.cp, self.tokens, self.act
        h, n = cfg.hidden_size, cfg.num_attention_heads
        heads = n // t
        qk, v = cfg.head_widths
        dtype = "fp8" if cfg.fp8_layer(index) else run.params_dtype
        fwd, b, w = Cost(), Cost(), Cost()
        # Attention projections.
        if cfg.multi_latent_attention:
            q_in = h if cfg.q_lora_rank is None else cfg.q_lora_rank
            if cfg.q_lora_rank:
                self.gemm(fwd, b, w, T, cfg.q_lora_rank, h, dtype)
            self.gemm(fwd, b, w, T, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, h, dtype)
            self.gemm(fwd, b, w, T, heads * qk, q_in, dtype)
            self.gemm(fwd, b, w, T, heads * (cfg.qk_head_dim + v), cfg.kv_lora_rank, dtype)
        else:
            kv = kv_heads_per_rank(cfg, t)
            self.gemm(fwd, b, w, T, (heads + 2 * kv) * cfg.head_dim, h, dtype)
        self.gemm(fwd, b, w, T, h, heads * v, dtype)
        core_fwd, core_bwd = self.attention(fwd, b)
        attention_work = (fwd.total - fwd.comm, b.total - b.comm + w.total)  # before its TP reduction, each way
        # The MLP (dense, or MoE's router, experts and shared expert).
        ffn_fwd = Cost()
        gated = 2 if cfg.gated_linear_unit else 1
        if cfg.is_moe_layer(index):
            self.gemm(ffn_fwd, b, w, T / t if self.sp else T, cfg.num_experts, h, run.params_dtype)
            local = cfg.num_experts // lay.ep
            routed = T * cfg.moe_router_topk * lay.etp / t  # balanced routing: the stage's work evenly spread
            width = cfg.moe_ffn_hidden_size // lay.etp
            self.gemm(ffn_fwd, b, w, routed / local, gated * width, h, dtype, batch=local)
            fc2 = Cost()
            self.gemm(fc2, b, w, routed / local, h, width, dtype, batch=local)
            # Each way (forward, backward): the all-to-all over EP of the tokens this rank routes (balanced: as
            # many come back), dispatched and combined; with ETP, an all-gather of what arrived over the ETP group
            # before the experts and a reduce-scatter after them (each the other's backward).
            moved = _gather_or_scatter(lay.ep, routed / lay.etp * h * a)
            gathered = _gather_or_scatter(lay.etp, routed * h * a)
            exchange = (2 * self.coll("all_to_all", "ep", lay.ep, moved) + self.coll("all_gather", "etp", lay.etp,
                        gathered) + self.coll("reduce_scatter", "etp", lay.etp, gathered))
            fwd.add("moe_comm", exchange)
            b.add("moe_comm", exchange)
            elementwise = routed * (gated + 1) * width * a + 4 * routed * h * a  # activation, permutes
            if cfg.moe_shared_expert_intermediate_size:
                shared = cfg.moe_shared_expert_intermediate_size // t
                self.gemm(ffn_fwd, b, w, T, gated * shared, h, dtype)
                self.gemm(fc2, b, w, T, h, shared, dtype)
                elementwise += T * (gated + 1) * shared * a
        else:
            ffn = cfg.ffn_hidden_size // t
            self.gemm(ffn_fwd, b, w, T, gated * ffn, h, dtype)
            fc2 = Cost()
            self.gemm(fc2, b, w, T, h, ffn, dtype)
            elementwise = T * (gated + 1) * ffn * a  # the fused bias-activation: read fc1's output, write its own
        ffn_fwd.add("elementwise", hw.memory_time(elementwise))
        mlp_work = (ffn_fwd.total - ffn_fwd.comm + fc2.total,
                    b.total - b.comm + w.total - attention_work[1])  # the MLP's, before its TP reduction
        fwd.merge(ffn_fwd)
        fwd.merge(fc2)
        # Norms, bias-dropout-residual adds (this rank's slice of the sequence with SP), RoPE.
        rows = T / t if self.sp else T
        mask = h if cfg.hidden_dropout > 0 else 0
        tail = rows * (3 * h * a + mask)  # the MLP's bias-dropout-add, after which the checkpoint stops
        other = rows * 2 * 2 * h * a + rows * (3 * h * a + mask)
        if cfg.position_embedding_type == "rope":
            other += T * 2 * (heads + kv_heads_per_rank(cfg, t)) * qk * a
        fwd.add("elementwise", hw.memory_time(other + tail))
        b.add("elementwise", ELEMENTWISE_BACKWARD * hw.memory_time(other + tail + elementwise))
        # Tensor parallelism: two reductions forward (SP: two gathers, two scatters), as many backward (each
        # gather's backward a scatter, each scatter's a gather; without SP, the input copies' all-reduces).  Each
        # reduction comes after its block's work (forward: attention, MLP; backward: MLP, attention); SP's gathers
        # right after the previous scatter (a norm and a residual add between them).
        share = hw.core_share(lay.world_size)  # the wall time of that work while every rank computes
        gather = self.tp_collective("gather", gap=0.0)
        reduce = self.tp_collective("reduce", gap=attention_work[0] / share)
        fwd.add("tp_comm", 2 * gather + reduce + self.tp_collective("reduce", gap=mlp_work[0] / share))
        b.add("tp_comm", 2 * gather + self.tp_collective("reduce", gap=attention_work[1] / share)
              + self.tp_collective("reduce", gap=mlp_work[1] / share))
        # Recomputation's extra forward, charged to B (it runs right before the layer's backward).  Torch's
        # checkpoint stops at the last tensor the backward needs: a dense MLP's fc2 input, an MoE layer's
        # un-permuting indices, past its experts' fc2, the shared expert and both exchanges (comm_volume's
        # MoEReruns), the TP traffic of the attention and the shared expert's (none of the output's gather).
        core, mlp = selective_recompute(cfg, index, cp)
        moe = cfg.is_moe_layer(index)
        if moe:
            shared_tp = gather + reduce if cfg.moe_shared_expert_intermediate_size else Comm()
            moe_comm = exchange + shared_tp
            moe_rerun = ffn_fwd.total + fc2.total + moe_comm.wall
        if recomputed:
            rerun = Cost()
            rerun.merge(fwd)
            if not run.recompute_whole_layer:
                if not moe:
                    rerun.merge(fc2, -1.0)
                rerun.add("elementwise", -hw.memory_time(tail))
                # The attention's gather and reduction, and a dense MLP's gather up to fc2's input.
                tp_rerun = gather + reduce + (shared_tp if moe else gather)
                rerun.parts["tp_comm"], rerun.cpu["tp_comm"] = tp_rerun.wall, tp_rerun.cpu
            b.add("recompute", rerun.total, comm=sum(rerun.parts.get(part, 0.0) for part in COMM_PARTS),
                  cpu=rerun.comm_cpu)
        elif moe and mlp:
            b.add("recompute", (core_fwd if core else 0.0) + moe_rerun, comm=moe_comm.wall, cpu=moe_comm.cpu)
        else:
            b.add("recompute", (core_fwd if core else 0.0) + (ffn_fwd.total if mlp else 0.0))
        return fwd, b, w

    def tp_collective(self, kind: str, gap: Optional[float] = None) -> Comm:
        """One TP collective of the rank's [s, b, h]: ``"reduce"``, an all-reduce (SP: a reduce-scatter), or
        ``"gather"``, SP's all-gather (none without SP).  Priced apart: gloo's reduce-scatter is several times its
        all-gather's cost on a CPU.  ``gap``: the compute before it (``Hardware.collective_time``)."""
        t = self.layout.tp
        nbytes = self.tokens * self.cfg.hidden_size * self.act
        if not self.sp:
            return self.coll("all_reduce", "tp", t, _all_reduce(t, nbytes), gap) if kind == "reduce" else Comm()
        return self.coll("all_gather" if kind == "gather" else "reduce_scatter", "tp", t,
                         _gather_or_scatter(t, nbytes), gap)

    def attention(self, fwd: Cost, b: Cost) -> Tuple[float, float]:
        """The core's forward and backward seconds (added to ``fwd`` and ``b``), with the context-parallel
        exchange that is not hidden behind it."""
        cfg, hw, lay, a = self.cfg, self.hw, self.layout, self.act
        t, cp = lay.tp, lay.cp
        heads = cfg.num_attention_heads // t
        qk, v = cfg.head_widths
        bsz, sq, sk = self.run.micro_batch, cfg.seq_length / cp, cfg.seq_length
        if hw.attention_kernel == "flash":
            flops = 2 * bsz * heads * sq * sk * (qk + v) / 2  # causal: the kernel skips the masked half
            peak = hw.peak(self.run.params_dtype)
            peak *= hw.compute_efficiency
            forward = flops / (peak * FLASH_ATTENTION_EFFICIENCY[0])
            backward = FLASH_BACKWARD_FLOPS * flops / (peak * FLASH_ATTENTION_EFFICIENCY[1])
        elif cp > 1 and cfg.cp_comm_type == "p2p":
            forward, backward = self.ring_blocks()
        else:
            dtype, batch = self.run.params_dtype, bsz * heads
            forward = hw.gemm_time(sq, sk, qk, dtype, batch) + hw.gemm_time(sq, v, sk, dtype, batch)
            backward = (hw.gemm_time(sq, qk, sk, dtype, batch) + hw.gemm_time(sk, qk, sq, dtype, batch)
                        + hw.gemm_time(sq, sk, v, dtype, batch) + hw.gemm_time(sk, v, sq, dtype, batch))
            scores = batch * sq * sk
            streamed = 2 * scores * a + (2 * scores * a + scores if cfg.attention_dropout > 0 else 0)
            forward += hw.memory_time(streamed)
            backward += ELEMENTWISE_BACKWARD * hw.memory_time(streamed)
        fwd.add("attention", forward)
        b.add("attention", backward)
        if cp > 1:
            ring_fwd, ring_bwd = self.context_parallel_exchange()
            if cfg.cp_comm_type == "p2p":  # the ring's next block travels while this one is computed
                fwd.add("cp_comm", exposed(hw, ring_fwd, forward))
                b.add("cp_comm", exposed(hw, ring_bwd, backward))
            else:
                fwd.add("cp_comm", ring_fwd)
                b.add("cp_comm", ring_bwd)
        return forward, backward

    def ring_blocks(self) -> Tuple[float, float]:
        """The p2p ring's core on a materialized profile (a CPU), as ``transformer.context_parallel`` computes it:
        each (query half, key half) pair of zigzag chunks the causal mask does not skip (``2 cp + 1`` of ``4 cp``,
        two of them diagonal, each ``c = s / 2cp`` tokens square; a sliding window masks inside them, priced
        alike), its GEMMs one by one (forward ``Q K^T`` and ``P V``; backward the scores again, ``dV``, ``dP``,
        ``dQ``, ``dK``) and its passes over the fp32 scores and its output rows (``RING_PAIR_PASSES``, read and
        written counted apart; a diagonal pair's mask two more)."""
        cfg, lay, hw = self.cfg, self.layout, self.hw
        cp, heads = lay.cp, cfg.num_attention_heads // lay.tp
        qk, v = cfg.head_widths
        batch, c = self.run.micro_batch * heads, cfg.seq_length / (2 * cp)
        pairs, diagonal = 2 * cp + 1, 2  # the GPT's mask is causal
        scores, rows = batch * c * c * 4, batch * c * v * 4
        dtype = self.run.params_dtype
        forward = pairs * (hw.gemm_time(c, c, qk, dtype, batch) + hw.gemm_time(c, v, c, dtype, batch)
                           + hw.memory_time(RING_PAIR_PASSES["forward"][0] * scores
                                            + RING_PAIR_PASSES["forward"][1] * rows))
        backward = pairs * (hw.gemm_time(c, c, qk, dtype, batch) + hw.gemm_time(c, v, c, dtype, batch)
                            + hw.gemm_time(c, c, v, dtype, batch) + 2 * hw.gemm_time(c, qk, c, dtype, batch)
                            + hw.memory_time(RING_PAIR_PASSES["backward"][0] * scores
                                             + RING_PAIR_PASSES["backward"][1] * rows))
        mask = diagonal * hw.memory_time(RING_MASK_PASSES * scores)
        return forward + mask, backward + mask

    def context_parallel_exchange(self) -> Tuple[Comm, Comm]:
        """Seconds of a layer's CP traffic forward and backward (``comm_volume``'s bytes for each type)."""
        cfg, lay, a = self.cfg, self.layout, self.act
        t, cp = lay.tp, lay.cp
        qk, v = cfg.head_widths
        pair = self.tokens * (qk + v)
        kv = kv_heads_per_rank(cfg, t) * pair
        acc = max(a, 4)
        kind = cfg.cp_comm_type
        if kind in ("a2a", "a2a+p2p"):
            inner = (self.run.hierarchical_inner or cp) if kind == "a2a+p2p" else cp
            heads = cfg.num_attention_heads // t
            kv_heads = kv_heads_per_rank(cfg, t)
            moved = (heads + (kv_heads if kv_heads % inner == 0 else heads)) * pair * a
            one = self.coll("all_to_all", "cp", inner, _gather_or_scatter(inner, moved))
            ring = Comm()
            if kind == "a2a+p2p" and cp // inner > 1:
                message = (kv_heads if kv_heads % inner == 0 else heads) * pair * a
                ring = (cp // inner - 1) * self.coll("send_recv", "cp", 2, message)
            return one + ring, one + 2 * ring
        if kind == "all_gather":
            gather = self.coll("all_gather", "cp", cp, _gather_or_scatter(cp, cp * kv * a))
            return gather, self.coll("reduce_scatter", "cp", cp, _gather_or_scatter(cp, cp * kv * acc))
        step_fwd = self.coll("send_recv", "cp", 2, kv * a)
        # Backward: K/V travel the ring again, and each block's dK/dV accumulator after them, two messages a step.
        step_bwd = self.coll("send_recv", "cp", 2, kv * a) + self.coll("send_recv", "cp", 2, kv * acc)
        return (cp - 1) * step_fwd, (cp - 1) * step_bwd

    def head(self) -> Tuple[Cost, Cost, Cost]:
        """The output layer and the cross entropy (last virtual stage), per micro-batch."""
        cfg, lay, T, a = self.cfg, self.layout, self.tokens, self.act
        vocab = pad_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, lay.tp) // lay.tp
        fwd, b, w = Cost(), Cost(), Cost()
        self.gemm(fwd, b, w, T, vocab, cfg.hidden_size, self.run.params_dtype)
        logits = T * vocab * 4 * 3  # fp32: max, exp-sum, target pass
        fwd.add("elementwise", self.hw.memory_time(logits + 2 * T * cfg.hidden_size * a))
        b.add("elementwise", ELEMENTWISE_BACKWARD * self.hw.memory_time(logits / 3))
        # SP's gather of the hidden states (backward: its scatter; without SP, the input copy's all-reduce), and
        # the vocab-parallel cross entropy's two small all-reduces (the logits' max, then the sums), forward.
        stats = 2 * self.coll("all_reduce", "tp", lay.tp, _all_reduce(lay.tp, 4 * T))
        fwd.add("tp_comm", self.tp_collective("gather", gap=0.0) + stats)  # the gather right after a scatter
        b.add("tp_comm", self.tp_collective("reduce"))
        return fwd, b, w

    def embedding(self) -> Tuple[Cost, Cost, Cost]:
        fwd, b, w = Cost(), Cost(), Cost()
        rows = self.tokens * self.cfg.hidden_size * self.act
        fwd.add("elementwise", self.hw.memory_time(2 * rows))
        w.add("elementwise", self.hw.memory_time(2 * rows))
        fwd.add("tp_comm", self.tp_collective("reduce"))  # the vocab-parallel lookup's sum (SP: its scatter)
        return fwd, b, w

    def message_time(self) -> Comm:
        """One pipeline message (a micro-batch's activation or its gradient) between neighbouring stages."""
        if self.layout.pp == 1:
            return Comm()
        message = self.tokens * self.cfg.hidden_size * self.act / (self.layout.tp if self.sp else 1)
        return self.coll("send_recv", "pp", 2, message)

    def chunk(self, layers: range, embedding: bool, head: bool) -> Tuple[Cost, Cost, Cost]:
        """(forward, B, W) of one model chunk (contiguous ``layers``, with the embedding / the head) per
        micro-batch."""
        key = (layers.start, layers.stop, embedding, head)
        if key not in self.chunks:
            self.chunks[key] = self._chunk(layers, embedding, head)
        return self.chunks[key]

    def stage_counts(self, layers: Sequence[int], first_stage: bool, last_stage: bool):
        """``gpt_param_counts`` of one pipeline rank's layers."""
        key = (tuple(layers), first_stage, last_stage)
        if key not in self.counts:
            lay = self.layout
            self.counts[key] = gpt_param_counts(self.cfg, lay.tp, lay.ep, lay.etp, layers, first_stage=first_stage,
                                                last_stage=last_stage)
        return self.counts[key]

    def rank_chunks(self, run: Run) -> List[List[range]]:
        """``pipeline_rank_chunks`` of ``run``'s split (a variant of this pricer's run)."""
        key = (run.partition_method, tuple(run.layers_per_stage or ()), run.first, run.last, run.vpp)
        if key not in self.splits:
            self.splits[key] = pipeline_rank_chunks(self.cfg, self.layout, run.partition_method,
                                                    run.layers_per_stage, run.first, run.last, run.vpp)
        return self.splits[key]

    def model_flops(self, samples: float) -> float:
        if samples not in self.flops:
            self.flops[samples] = model_flops(self.cfg, samples)
        return self.flops[samples]

    def _chunk(self, layers: range, embedding: bool, head: bool) -> Tuple[Cost, Cost, Cost]:
        fwd, b, w = Cost(), Cost(), Cost()
        pieces = [self.layer(i, self.cfg.recomputes_layer(local)) for local, i in enumerate(layers)]
        if embedding:
            pieces.append(self.embedding())
        if head:
            pieces.append(self.head())
            for k in range(self.cfg.mtp_num_layers or 0):
                pieces += [self.layer(self.cfg.num_layers + k, False), self.head()]
        for f, bb, ww in pieces:
            fwd.merge(f)
            b.merge(bb)
            w.merge(ww)
        return fwd, b, w


def stage_phases(run: Run, pricer: "_Pricer") -> List[List[Tuple[Cost, Cost, Cost]]]:
    """Per pipeline rank, per model chunk: (forward, B, W) of one micro-batch."""
    pp, v = run.layout.pp, run.vpp
    chunks = pricer.rank_chunks(run)
    return [[pricer.chunk(layers, stage == 0 and c == 0, stage == pp - 1 and c == v - 1)
             for c, layers in enumerate(chunks[stage])] for stage in range(pp)]


def plan_step_time(run: Run, hw: Hardware, gpus_per_node: Optional[int] = None,
                   pricer: Optional["_Pricer"] = None) -> StepTime:
    """The predicted step of ``run`` on ``hw`` (see the module docstring); ``pricer``: one made for a run of the
    same model, layout and micro-batch (its layers' prices reused)."""
    cfg, lay = run.model, run.layout
    gpus_per_node = gpus_per_node or hw.gpus_per_node
    pricer = pricer or _Pricer(run, hw, gpus_per_node)
    pp, v, m = lay.pp, run.vpp, run.micro_batches
    phases = stage_phases(run, pricer)
    message = pricer.message_time()
    tails, tails_cpu = zip(*(_after_backward(run, hw, pricer, stage, phases[stage]) for stage in range(pp)))
    kind = "zero_bubble" if run.schedule == "zero_bubble" else "interleaved_1f1b"
    shared = hw.cores is not None and lay.world_size > hw.cores
    if shared:
        timing = _shared_cores_timing(run, hw, gpus_per_node, phases, tails, tails_cpu, kind, message)
        ends = finish = timing.finish
    else:
        if pp > 1:
            costs = [[(f.total, b.total, w.total) for f, b, w in stage] for stage in phases]
            finish = simulate_pipeline(m, v, pp, run.group_size, schedule=kind, costs=costs,
                                       message_time=message.wall).finish
        else:
            finish = (m * sum(f.total + b.total + w.total for f, b, w in phases[0]),)
        ends = [finish[stage] + sum(tails[stage].values()) for stage in range(pp)]
    stage = max(range(pp), key=lambda st: (ends[st], -st))  # the slowest rank, the first of equals
    total, tail = ends[stage], tails[stage]
    compute = {part: m * sum(ph.parts.get(part, 0.0) for f, b, w in phases[stage] for ph in (f, b, w))
               for part in PARTS}
    parts = {f"{k}_s": s for k, s in compute.items() if s}
    if shared:
        # Its pipeline messages' processor time at its own rate, and the rest of the rank's seconds in its work
        # beyond their price at its own rate: waiting for a core (less, where a collective ran with fewer ranks
        # computing than when it was measured).
        parts["pp_comm_s"] = rank_messages(run, stage, kind) * message.cpu
        parts["core_sharing_s"] = (timing.busy[stage] - sum(compute.values()) - sum(tail.values())
                                   - parts["pp_comm_s"])
        parts["pipeline_bubble_s"] = total - timing.busy[stage]
    else:
        parts["pipeline_bubble_s"] = finish[stage] - sum(compute.values())
    parts.update(tail)
    peak = hw.peak("fp8" if cfg.fp8 is not None else run.params_dtype)
    flops = pricer.model_flops(run.micro_batch * m * lay.dp)
    # Parts of a few ulps are the rounding of a difference (a bubble of none), not time.
    return StepTime(total, flops, lay.world_size, peak, {k: s for k, s in parts.items() if abs(s) > 1e-12}, stage)


def shared_parts(cost: Cost, hw: Hardware) -> Tuple[float, float]:
    """(work, wait) of a phase on ranks sharing cores: its compute and its collectives' processor time take a
    core (at ``core_share`` of the rank's rate while others compute too); of the collectives' wall time the rank
    waits what is left once their processor time is taken out as it was measured (``measured_core_share``: the
    calibration's ranks all in the call at once), so a collective priced alone as measured takes its wall time."""
    cpu = cost.comm_cpu
    return cost.total - cost.comm + cpu, max(0.0, cost.comm - cpu / hw.measured_core_share())


def least_time(cost: Cost, hw: Hardware) -> float:
    """The least time a phase ``cost`` can take on ``hw``: its total, or, on ranks sharing cores, its work at a
    whole core and its wait (``shared_parts``); the search's bounds add these up."""
    return cost.total if hw.cores is None else sum(shared_parts(cost, hw))


def least_message_time(message: Comm, hw: Hardware) -> float:
    """The least delay a pipeline message puts between its sender's operation and its receiver's."""
    return message.wall if hw.cores is None else max(0.0, message.wall - message.cpu / hw.measured_core_share())


def rank_messages(run: Run, stage: int, schedule: str) -> int:
    """The pipeline messages pipeline rank ``stage`` sends and receives in a step of its order (what
    ``simulate_shared_pipeline`` charges ``message_work`` for)."""
    pp, v = run.layout.pp, run.vpp
    if pp == 1:
        return 0
    ops = rank_operations(run.micro_batches, v, pipeline_parallel_size=pp, pipeline_parallel_rank=stage,
                          microbatch_group_size_per_vp_stage=run.group_size, schedule=schedule)
    return sum((receives_of(op, stage, pp, v) is not None) + (sends_of(op, stage, pp, v) is not None) for op in ops)


def _shared_cores_timing(run: Run, hw: Hardware, gpus_per_node: int, phases, tails, tails_cpu, kind: str,
                         message: Comm):
    """The schedule run on ``hw.cores`` cores that all ranks of the job share: while ``k`` pipeline stages
    compute, ``k`` x (world / pp) ranks do, each at ``core_share`` of its rate; the collectives' processor time
    is work like compute, the rest of their time and the bubble take no core (``shared_parts``); a pipeline
    message's processor time is work of its sender's and its receiver's operations.  Each stage's tail after its
    last backward runs in the same timeline (reduction and collectives first, then the optimizer step, then the
    parameter all-gather)."""
    lay = run.layout
    if lay.world_size > gpus_per_node:
        raise ConfigError(f"--hardware {hw.name}: cores={hw.cores} are shared by the ranks of one node, and "
                          f"{lay.world_size} ranks over {gpus_per_node} per node span several; plan a one-node job "
                          "on this profile")
    per_stage = lay.world_size // lay.pp
    rates = [hw.core_share(k * per_stage) for k in range(lay.pp + 1)]
    costs = [[tuple(shared_parts(c, hw) for c in chunk) for chunk in stage] for stage in phases]
    segments = []
    for tail, cpu in zip(tails, tails_cpu):
        first = Cost()
        for part in ("dp_comm_s", "embedding_comm_s"):
            first.add(part, tail.get(part, 0.0), comm=tail.get(part, 0.0), cpu=cpu.get(part, 0.0))
        gather = Cost()
        gather.add("optimizer_s", tail.get("optimizer_s", 0.0), comm=0.0)
        gather.add("param_gather_s", tail.get("param_gather_s", 0.0), comm=tail.get("param_gather_s", 0.0),
                   cpu=cpu.get("param_gather_s", 0.0))
        segments.append([shared_parts(first, hw), shared_parts(gather, hw)])
    return simulate_shared_pipeline(run.micro_batches, run.vpp, lay.pp, costs, rates, run.group_size,
                                    schedule=kind, message_time=least_message_time(message, hw),
                                    message_work=message.cpu, tails=segments)


def _after_backward(run: Run, hw: Hardware, pricer: _Pricer, stage: int,
                    phases) -> Tuple[Dict[str, float], Dict[str, float]]:
    """The exposed seconds after the stage's last backward: gradient reduction, the tied embedding's sum, the
    optimizer step, the parameter all-gather; and the processor seconds of those collectives (``Comm.cpu``)."""
    cfg, lay = run.model, run.layout
    pp = lay.pp
    counts = pricer.stage_counts([i for c in pricer.rank_chunks(run)[stage] for i in c], first_stage=stage == 0,
                                 last_stage=stage == pp - 1)
    grad = 4 if run.grad_fp32 else BYTES[run.params_dtype]
    dense, expert = counts.sharded + counts.replicated, counts.expert
    n_dense, n_expert = lay.dp * lay.cp, lay.edp
    dp, edp = pricer.inter["dp-cp"], pricer.inter["edp"]
    if run.distributed_optimizer:
        reduce = (collective(hw, "reduce_scatter", n_dense, _gather_or_scatter(n_dense, dense * grad), dp)
                  + collective(hw, "reduce_scatter", n_expert, _gather_or_scatter(n_expert, expert * grad), edp))
        gather = (collective(hw, "all_gather", n_dense, _gather_or_scatter(n_dense, dense * pricer.act), dp)
                  + collective(hw, "all_gather", n_expert, _gather_or_scatter(n_expert, expert * pricer.act), edp))
        owned = -(-dense // n_dense) + -(-expert // max(n_expert, 1))
    else:
        reduce = (collective(hw, "all_reduce", n_dense, _all_reduce(n_dense, dense * grad), dp)
                  + collective(hw, "all_reduce", n_expert, _all_reduce(n_expert, expert * grad), edp))
        gather, owned = Comm(), dense + expert
    last_backward = sum(b.total + w.total for f, b, w in phases)
    first_forward = sum(f.total for f, b, w in phases)
    if run.overlap_grad_reduce and reduce.wall:  # every bucket but the last reduced during the backward
        bucket = run.bucket_size or max(40_000_000, 1_000_000 * n_dense)
        buckets = max(1, -(-(dense + expert) // bucket))
        reduce = reduce * (1 / buckets) + exposed(hw, reduce * (1 - 1 / buckets), last_backward)
    if run.overlap_param_gather and gather.wall:
        gather = exposed(hw, gather, first_forward)
    out = {"dp_comm_s": reduce, "param_gather_s": gather}
    if pp > 1 and (stage in (0, pp - 1)) and not cfg.untie_embeddings_and_output_weights:
        vocab = pad_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, lay.tp) // lay.tp
        out["embedding_comm_s"] = collective(hw, "all_reduce", 2, _all_reduce(2, vocab * cfg.hidden_size * 4),
                                             pricer.inter["pp"])
    out["optimizer_s"] = Comm(hw.memory_time(owned * OPTIMIZER_BYTES.get(run.optimizer_type.lower(), 34)))
    return ({k: c.wall for k, c in out.items() if c.wall}, {k: c.cpu for k, c in out.items() if c.cpu})


def format_step_time(step: StepTime, hw: Hardware) -> str:
    """A few lines: the step, its rate, and the slowest rank's breakdown."""
    parts = ", ".join(f"{k[:-2].replace('_', ' ')} {s * 1e3:,.1f}" for k, s in
                      sorted(step.breakdown.items(), key=lambda kv: -kv[1]))
    return (f"predicted step on {hw.name}: {step.step_time_s:,.3f} s, {step.model_tflops_per_gpu:,.1f} model "
            f"TFLOP/s per GPU, MFU {step.mfu:.1%} (causal attention counted in full, as the published tables "
            "count it)\n"
            f"  slowest rank (stage {step.stage}), ms: {parts}")
