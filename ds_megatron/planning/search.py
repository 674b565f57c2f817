"""``ds-megatron plan --search``: the layouts of N GPUs for one model, ranked by predicted step time (pure, no torch).

Enumerated: TP (within a node, with sequence parallelism when above 1), CP and its type (``p2p``,
``all_gather``, ``a2a``, and hierarchical ``a2a+p2p`` with each split of CP into an all-to-all group of more
than one and fewer than CP ranks and a ring over those groups), EP and ETP (``1`` or TP) for MoE models, PP, DP (the rest), the micro-batch, the
recomputation (none, selective ``core_attn``, full; an MoE model's also ``selective_moe``: ``core_attn`` and
``moe``, where the activation plan plans recomputed MoE layers), and per such group its variants: v chunks per rank
(interleaved), ZB-H1 for one chunk, Megatron's uneven first / last stages (one layer fewer on each), the
distributed optimizer.  Each variant is the user's config with these keys replaced, so it passes the config's
own rules or is dropped (``parse_job_config``, ``MegatronConfig.layout``); it is kept when the plan's peak per
rank (``planning.memory``, through ``job_plan.memory_plans``) fits the hardware's memory.

Pruning keeps the answer exact for the layouts returned (``tests/test_plan_search.py``: the same ranking as
planning every candidate in full): a group whose first rank overflows the memory at its best
(``_memory_floor``) is dropped; a group's time bound is its compute per rank without bubble, communication after
the backward or stage imbalance (the model's work over ``pp`` stages), below every variant's step.  Groups are
visited in the order of their bound and none of a group's variants is planned once the bound reaches the
``limit``-th best step found; a variant is simulated only when its ``pipeline_floor`` is below it, and its memory
planned (per stage, without rank lists) only when its step is.  What depends only on the group (its model, its
layers' and chunks' prices, its stages' parameters) is priced once for all its variants (``_Pricer``), each
``ParallelLayout`` made once per sizes, each schedule's orders once per size (``schedule_table``).  Not
enumerated: PP sizes that do not divide the layers, the rank order (the config's).
"""
from __future__ import annotations

import copy
import dataclasses
import heapq
import json
import time
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional, Tuple

from ..config.job import parse_job_config
from ..errors import ConfigError
from .hardware import GIB, DeviceKernels, Hardware
from .memory import BYTES, activation_bytes, check_recompute_planned, optimizer_state_bytes_per_param
from .param_counts import gpt_param_counts
from .job_plan import memory_plans, run_from_job
from ..parallel.layout import ParallelLayout
from .step_time import Run, _Pricer, least_message_time, least_time, plan_step_time, stage_phases

MICRO_BATCHES = (1, 2, 4, 8, 16)
RECOMPUTE = ("none", "selective", "full")
# An MoE model's selective recomputation of its MoE layers too (core_attn and moe), searched beside RECOMPUTE's
SELECTIVE_MOE = "selective_moe"
RECOMPUTE_SETTINGS = {"none": dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                                   recompute_modules=None),
                      "selective": dict(recompute_granularity="selective", recompute_method=None,
                                        recompute_num_layers=None, recompute_modules=None),
                      SELECTIVE_MOE: dict(recompute_granularity="selective", recompute_method=None,
                                          recompute_num_layers=None, recompute_modules=["core_attn", "moe"]),
                      "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                                   recompute_modules=None)}
CP_TYPES = ("p2p", "all_gather", "a2a")


@dataclass(frozen=True)
class Layout:
    """One ranked layout: the sizes, how a step runs, its predicted step and the plan's peak per rank."""

    tp: int
    pp: int
    vpp: int
    cp: int
    cp_comm_type: str
    hierarchical_context_parallel_sizes: Optional[Tuple[int, int]]  # [a2a, p2p] with cp_comm_type "a2a+p2p"
    ep: int
    etp: int
    dp: int
    micro_batch: int
    recompute: str
    distributed_optimizer: bool
    schedule: str
    first: Optional[int]
    last: Optional[int]
    step_time_s: float
    model_tflops_per_gpu: float
    mfu: float
    peak_memory_gib: float

    def to_json(self) -> Dict:
        return asdict(self)


@dataclass(frozen=True)
class SearchResult:
    layouts: List[Layout]
    candidates: int  # groups x variants enumerated
    evaluated: int  # variants planned in full (the rest pruned by their bound)
    seconds: float


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _load(config) -> Dict:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    with open(config, encoding="utf-8") as f:
        return json.load(f)


def candidate_config(base: Dict, choice: Dict, global_batch: int, dp: int) -> Dict:
    """The user's config with a layout's keys replaced (the rest, the model's architecture included, kept)."""
    doc = copy.deepcopy(base)
    mega = doc.setdefault("megatron", {})
    model = mega.setdefault("model", {})
    for key in ("num_layers_per_virtual_pipeline_stage", "pipeline_num_layers_per_stage",
                "hierarchical_context_parallel_sizes", "virtual_pipeline_model_parallel_size",
                "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_schedule"):
        mega.pop(key, None)
    for key in ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"):
        model.pop(key, None)
    mega.update(tensor_model_parallel_size=choice["tp"], pipeline_model_parallel_size=choice["pp"],
                context_parallel_size=choice["cp"], sequence_parallel=choice["tp"] > 1,  # SP whenever TP
                use_distributed_optimizer=choice["distributed_optimizer"], pipeline_partition_method="uniform")
    model.pop("sequence_parallel", None)  # set for the whole layout above
    if not choice["distributed_optimizer"]:
        mega["overlap_param_gather"] = False
    if choice["ep"] > 1 or "expert_model_parallel_size" in mega:
        mega["expert_model_parallel_size"] = choice["ep"]
    if choice["etp"] is not None:
        mega["expert_tensor_parallel_size"] = choice["etp"]
    if choice["pp"] > 1:
        mega["pipeline_schedule"] = choice["schedule"]
        if choice["vpp"] > 1:
            mega["virtual_pipeline_model_parallel_size"] = choice["vpp"]
        for end in ("first", "last"):
            if choice[end] is not None:
                mega[f"decoder_{end}_pipeline_num_layers"] = choice[end]
    if choice["cp"] > 1:
        model["cp_comm_type"] = choice["cp_comm_type"]
        if choice.get("cp_inner") is not None:
            mega["hierarchical_context_parallel_sizes"] = [choice["cp_inner"], choice["cp"] // choice["cp_inner"]]
    model.update({k: v for k, v in RECOMPUTE_SETTINGS[choice["recompute"]].items() if v is not None})
    doc.pop("train_batch_size", None)
    doc["train_micro_batch_size_per_gpu"] = choice["micro_batch"]
    doc["gradient_accumulation_steps"] = global_batch // (dp * choice["micro_batch"])
    doc.pop("activation_checkpointing", None)
    return doc


def _groups(job, world: int, gpus_per_node: int, global_batch: int) -> Iterator[Dict]:
    """The (tp, cp, type, ep, etp, pp, micro-batch, recompute) groups, before the config's rules."""
    model = job.model
    tps = [t for t in _divisors(gpus_per_node) if t <= world]
    for tp in tps:
        for cp in [c for c in _divisors(world // tp) if c == 1 or model.seq_length % (2 * c * tp) == 0]:
            types = [(t, None) for t in CP_TYPES] + [("a2a+p2p", inner) for inner in _divisors(cp)[1:-1]]
            for cp_type, cp_inner in (types if cp > 1 else [("p2p", None)]):
                for pp in [p for p in _divisors(world // (tp * cp)) if p <= model.num_layers]:
                    dp = world // (tp * cp * pp)
                    if global_batch % dp:
                        continue
                    experts = [(1, None)]
                    if model.num_experts:
                        experts = [(ep, etp) for ep in _divisors(model.num_experts) for etp in sorted({1, tp})
                                   if (world // pp) % (ep * etp) == 0]
                    recomputes = RECOMPUTE + ((SELECTIVE_MOE,) if model.num_experts else ())
                    for ep, etp in experts:
                        for mb in MICRO_BATCHES:
                            if (global_batch // dp) % mb:
                                continue
                            for recompute in recomputes:
                                yield dict(tp=tp, cp=cp, cp_comm_type=cp_type, cp_inner=cp_inner, ep=ep, etp=etp,
                                           pp=pp, dp=dp,
                                           micro_batch=mb, recompute=recompute, vpp=1, schedule="1f1b",
                                           first=None, last=None, distributed_optimizer=False)


def _variants(group: Dict, num_layers: int) -> Iterator[Dict]:
    pp, dp = group["pp"], group["dp"] * group["cp"]
    schedules = [(1, "1f1b", None, None)]
    if pp > 1:
        base = num_layers // pp
        schedules += [(1, "zero_bubble", None, None)]
        schedules += [(v, "interleaved_1f1b", None, None) for v in _divisors(num_layers // pp)[1:]
                      if num_layers % pp == 0]
        if base > 1:
            schedules += [(1, "1f1b", None, base - 1), (1, "1f1b", base - 1, base - 1)]
    for vpp, schedule, first, last in schedules:
        for distributed in ((False, True) if dp > 1 else (False,)):
            yield dict(group, vpp=vpp, schedule=schedule, first=first, last=last, distributed_optimizer=distributed)


def _group_run(job, base: Run, group: Dict, world: int, global_batch: int, layouts: Dict, models: Dict) -> Run:
    """The group's plain variant (one chunk, 1F1B, uniform stages, no distributed optimizer) as a ``Run``, through
    the model's and the layout's own rules (ConfigError or ValueError when they refuse it); the whole config's
    rules are checked for each variant planned in full."""
    model_key = (group["tp"] > 1, group["cp_comm_type"], group["recompute"])
    if model_key not in models:  # a few models for thousands of groups
        models[model_key] = dataclasses.replace(job.model, sequence_parallel=group["tp"] > 1,
                                                cp_comm_type=group["cp_comm_type"],
                                                **RECOMPUTE_SETTINGS[group["recompute"]])
    model = models[model_key]
    check_recompute_planned(model)  # recomputed MoE layers where the activation plan plans them
    key = (group["tp"], group["pp"], group["cp"], group["ep"], group["etp"])
    if key not in layouts:  # made once per sizes: a layout of 16,384 ranks checks its groups when made
        layouts[key] = ParallelLayout(world_size=world, tp=group["tp"], pp=group["pp"], cp=group["cp"],
                                      ep=group["ep"], etp=group["etp"], order=job.megatron.parallel.order)
    layout = layouts[key]
    model.check_layout(layout)
    if model.num_layers % layout.pp:
        raise ConfigError("uneven stages: planned as variants of the group of a uniform split")
    return dataclasses.replace(base, model=model, layout=layout, hierarchical_inner=group["cp_inner"],
                               micro_batch=group["micro_batch"],
                               micro_batches=global_batch // (layout.dp * group["micro_batch"]), schedule="1f1b",
                               vpp=1, partition_method="uniform", layers_per_stage=None, first=None, last=None,
                               distributed_optimizer=False)


def _memory_floor(run: Run, kernels: DeviceKernels) -> float:
    """Bytes no variant of this group goes below on its first pipeline rank: its fewest layers (one fewer than
    uniform with an uneven first stage) and the embedding, each parameter with its weight, its gradient and, at
    best (the distributed optimizer), its share of the fp32 copy and optimizer state, and what those layers keep
    for backward for each micro-batch every schedule holds there at once before its first backward
    (``min(pp, micro-batches)``)."""
    cfg, lay = run.model, run.layout
    layers = range(max(cfg.num_layers // lay.pp - 1, 1) if lay.pp > 1 else cfg.num_layers)
    counts = gpt_param_counts(cfg, lay.tp, lay.ep, lay.etp, layers, first_stage=True, last_stage=lay.pp == 1)
    low = BYTES[run.params_dtype]
    grad = 4 if run.grad_fp32 else low
    state = optimizer_state_bytes_per_param(run.optimizer_type) + (4 if run.params_dtype != "fp32" else 0)
    dense, expert = counts.sharded + counts.replicated, counts.expert
    static = (dense + expert) * (low + grad) + dense * state / (lay.dp * lay.cp) + expert * state / lay.edp
    kept = activation_bytes(cfg, lay.tp, run.micro_batch, run.params_dtype, logits=False, cp=lay.cp, layers=layers,
                            etp=lay.etp, hierarchical_inner=run.hierarchical_inner, embedding=False, kept_only=True,
                            kernels=kernels)
    return static + kept * min(lay.pp, run.micro_batches)


def _bound(run: Run, pricer: _Pricer) -> float:
    """A step no variant of this group beats: every layer's work spread evenly over the stages (each phase at its
    ``least_time``)."""
    model, pp, hw = run.model, run.layout.pp, pricer.hw
    work = 0.0
    for i in range(model.num_layers):
        work += sum(least_time(c, hw) for c in pricer.layer(i, model.recomputes_layer(0)))
    work += sum(least_time(c, hw) for c in pricer.head()) + sum(least_time(c, hw) for c in pricer.embedding())
    return run.micro_batches * work / pp


def pipeline_floor(run: Run, phases, message_time: float, hw: Hardware) -> float:
    """A time no rank of ``run``'s pipeline finishes its last backward after, below what ``simulate_pipeline``
    gives (``tests/test_plan_time.py`` holds it so; equal to it for 1F1B and interleaved stages of equal costs):
    rank r starts no work before the first micro-batch's forwards of chunk 0 on ranks 0..r-1 and their messages
    (``head``), then computes its own work (``busy``); its last backward of chunk 0 then has each lower rank's
    backward of chunk 0 and a message to wait for (``chain``).  That backward is a 1F1B or interleaved rank's
    last operation; under ZB-H1 only W's follow it (at most every W of the rank).  Less one part in 10^9 for the
    rounding of the simulation's own sums.  Each phase at its ``least_time``, each message at its least delay."""
    m, zero_bubble = run.micro_batches, run.schedule == "zero_bubble"
    costs = [[tuple(least_time(c, hw) for c in phase) for phase in stage] for stage in phases]
    floor = head = chain = 0.0
    for stage in costs:
        busy = m * sum(f + b + w for f, b, w in stage)
        f, b, w = stage[0]
        after = m * w if zero_bubble else 0.0
        floor = max(floor, head + busy, head + busy - after + chain)
        head += f + message_time
        chain += message_time + (b if zero_bubble else b + w)
    return floor * (1 - 1e-9)


def search_layouts(config, world_size: int, hw: Hardware, gpus_per_node: Optional[int] = None,
                   global_batch: Optional[int] = None, limit: int = 10) -> SearchResult:
    """The ``limit`` fastest layouts of ``world_size`` GPUs that fit ``hw``'s memory (see the module docstring)."""
    start = time.perf_counter()
    base = _load(config)
    job = parse_job_config(base)
    gpn = gpus_per_node or hw.gpus_per_node
    if global_batch is None:
        layout = job.megatron.layout(world_size)
        global_batch = (base["train_micro_batch_size_per_gpu"] * (job.megatron.deepspeed_batch.micro_batches(
            layout.dp) or 1) * layout.dp)
    if global_batch < 1:
        raise ConfigError(f"--global-batch-size {global_batch} must be a positive number of samples")
    bounded: List[Tuple[float, int, Dict, Run, _Pricer]] = []
    layouts: Dict = {}
    models: Dict = {}
    base_run = run_from_job(job, world_size)  # the job's own settings (dtype, optimizer, overlap), read once
    for n, group in enumerate(_groups(job, world_size, gpn, global_batch)):
        try:
            run = _group_run(job, base_run, group, world_size, global_batch, layouts, models)
        except ValueError:  # ConfigError too: the model or the layout refuses the group
            continue
        if _memory_floor(run, hw.kernels) <= hw.memory_bytes:
            pricer = _Pricer(run, hw, gpn)
            bounded.append((_bound(run, pricer), n, group, run, pricer))
    bounded.sort(key=lambda item: item[:2])
    best: List[Tuple[float, int, Layout]] = []  # a max-heap of the kept layouts by step (negated)
    candidates = evaluated = 0
    for bound, _, group, run, pricer in bounded:
        variants = list(_variants(group, job.model.num_layers))
        candidates += len(variants)
        if len(best) >= limit and bound >= -best[0][0]:
            continue  # counted, not planned: the bound says none of them makes the list
        for choice in variants:
            variant = dataclasses.replace(run, vpp=choice["vpp"], schedule=choice["schedule"], first=choice["first"],
                                          last=choice["last"], distributed_optimizer=choice["distributed_optimizer"])
            try:
                phases = stage_phases(variant, pricer)
            except ValueError:  # stages the uneven ends cannot split
                continue
            if len(best) >= limit and pipeline_floor(variant, phases, least_message_time(pricer.message_time(), hw),
                                                            hw) >= -best[0][0]:
                continue  # its pipeline's critical path alone is slower than the list's last
            step = plan_step_time(variant, hw, gpn, pricer)
            if len(best) >= limit and step.step_time_s >= -best[0][0]:
                continue
            evaluated += 1
            layout = _evaluate(base, choice, world_size, hw, global_batch, step)
            if layout is None:
                continue
            heapq.heappush(best, (-layout.step_time_s, evaluated, layout))
            if len(best) > limit:
                heapq.heappop(best)
    layouts = sorted((item[2] for item in best), key=lambda lay: lay.step_time_s)
    return SearchResult(layouts, candidates, evaluated, time.perf_counter() - start)


def _evaluate(base: Dict, choice: Dict, world: int, hw: Hardware, global_batch: int, step) -> Optional[Layout]:
    """The variant's layout if the config's rules take it and the plan's peak fits memory, else None."""
    try:
        job = parse_job_config(candidate_config(base, choice, global_batch, choice["dp"]))
        plans = memory_plans(job, world, rank_lists=False, kernels=hw.kernels)
    except ConfigError:
        return None
    peak = max(p.total_bytes for p in plans)
    if peak > hw.memory_bytes:
        return None
    sizes = None if choice["cp_inner"] is None else (choice["cp_inner"], choice["cp"] // choice["cp_inner"])
    return Layout(choice["tp"], choice["pp"], choice["vpp"], choice["cp"], choice["cp_comm_type"], sizes, choice["ep"],
                  choice["tp"] if choice["etp"] is None else choice["etp"], choice["dp"],
                  choice["micro_batch"], choice["recompute"], choice["distributed_optimizer"], choice["schedule"],
                  choice["first"], choice["last"], step.step_time_s, step.model_tflops_per_gpu, step.mfu,
                  peak / GIB)


def format_layouts(result: SearchResult, hw: Hardware) -> str:
    head = (f"{len(result.layouts)} fastest layouts on {hw.name} that fit {hw.memory_bytes / GIB:,.0f} GiB per GPU "
            f"({result.candidates:,} candidates, {result.evaluated:,} planned in full, {result.seconds:.1f} s)")
    rows = [["step s", "TFLOP/s", "MFU", "GiB", "tp", "pp", "vpp", "cp", "ep", "etp", "dp", "mb", "recompute",
             "dist opt", "schedule", "first/last"]]
    for x in result.layouts:
        rows.append([f"{x.step_time_s:.3f}", f"{x.model_tflops_per_gpu:.1f}", f"{x.mfu:.1%}",
                     f"{x.peak_memory_gib:.1f}", str(x.tp), str(x.pp), str(x.vpp),
                     f"{x.cp}" + (f" {x.cp_comm_type}" if x.cp > 1 else "")
                     + (" {}x{}".format(*x.hierarchical_context_parallel_sizes)
                        if x.hierarchical_context_parallel_sizes else ""), str(x.ep), str(x.etp), str(x.dp),
                     str(x.micro_batch), x.recompute, "yes" if x.distributed_optimizer else "no", x.schedule,
                     f"{x.first or '-'}/{x.last or '-'}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join([head] + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows])
