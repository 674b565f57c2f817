"""The layout search's shortcuts change no answer: its ranked layouts against a brute-force enumeration that plans
every candidate in full, the pipeline floor it prunes by against the simulated schedule (and the formula of equal
stages), the simulation's compiled orders against the schedule table's messages, and ZB-H1's orders against its
rule re-run turn by turn.  Torch-free."""
import dataclasses
import random

import pytest

from ds_megatron.config.job import parse_job_config
from ds_megatron.pipeline_parallel.schedule_table import (_programs, rank_operations, receives_of, sends_of,
                                                          simulate_pipeline, zero_bubble_orders)
from ds_megatron.planning import search
from ds_megatron.planning.hardware import H100, CollectiveRate
from ds_megatron.planning.job_plan import plan_from_config, run_from_job
from ds_megatron.planning.search import candidate_config, pipeline_floor, search_layouts
from ds_megatron.planning.step_time import Cost, plan_step_time

BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "megatron": {"model": dict(num_layers=4, hidden_size=128, num_attention_heads=8, seq_length=128,
                                   vocab_size=512, hidden_dropout=0.0, attention_dropout=0.0)}}
KEY = ("tp", "pp", "vpp", "cp", "cp_comm_type", "ep", "dp", "micro_batch", "recompute", "distributed_optimizer",
       "schedule", "first", "last")


def _key(layout_or_choice):
    """A layout's sizes and settings (a search result's, or an enumerated choice's)."""
    if isinstance(layout_or_choice, dict):
        inner, etp = layout_or_choice["cp_inner"], layout_or_choice["etp"]
        return tuple(layout_or_choice[k] for k in KEY) + (etp if etp is not None else layout_or_choice["tp"],) + (
            None if inner is None else (inner, layout_or_choice["cp"] // inner),)
    return tuple(getattr(layout_or_choice, k) for k in KEY) + (layout_or_choice.etp,) + (
        layout_or_choice.hierarchical_context_parallel_sizes,)


def _brute_force(base, world, hw, gpus_per_node, batch):
    """Every candidate the search enumerates, each through the whole config (``parse_job_config``), the full
    memory plan with its rank lists (activations as ``hw``'s kernels keep them, as the search plans them) and a
    step time of its own pricer: (step, peak, layout key), fastest first."""
    job = parse_job_config(base)
    out = []
    for group in search._groups(job, world, gpus_per_node, batch):
        for choice in search._variants(group, job.model.num_layers):
            try:
                candidate = parse_job_config(candidate_config(base, choice, batch, choice["dp"]))
                _, plans, _ = plan_from_config(candidate, world, kernels=hw.kernels)
                step = plan_step_time(run_from_job(candidate, world), hw, gpus_per_node).step_time_s
            except ValueError:  # ConfigError too: the config's rules, or stages the uneven ends cannot split
                continue
            peak = max(p.total_bytes for p in plans)
            if peak <= hw.memory_bytes:
                out.append((step, peak, _key(choice)))
    return sorted(out, key=lambda row: row[0])


def test_search_returns_the_brute_force_ranking():
    """4 GPUs (two nodes of 2), a memory between the candidates' peaks (hierarchical CP among those that fit):
    the full list and the top 1, 3 and 10 with pruning are the brute force's fastest, each with its step and
    peak to the bit."""
    everything = _brute_force(BASE, 4, dataclasses.replace(H100, memory_bytes=1e15), 2, 4)
    peaks = sorted(row[1] for row in everything)
    hierarchical = min(row[1] for row in everything if row[2][-1])  # keep a2a+p2p layouts among the compared
    hw = dataclasses.replace(H100, memory_bytes=max(peaks[len(peaks) // 3], hierarchical))
    reference = [row for row in everything if row[1] <= hw.memory_bytes]
    assert 10 < len(reference) < len(everything)
    by_key = {row[2]: row for row in reference}
    for limit in (10 ** 6, 1, 3, 10):
        result = search_layouts(BASE, 4, hw, gpus_per_node=2, global_batch=4, limit=limit)
        got = [(x.step_time_s, x.peak_memory_gib * 2 ** 30, _key(x)) for x in result.layouts]
        assert [row[0] for row in got] == [row[0] for row in reference[:limit]], limit
        for step, peak, key in got:
            assert by_key[key][0] == step and by_key[key][1] == pytest.approx(peak, rel=1e-15), key
        if limit < 10:
            assert result.evaluated < len(everything) / 2, "the bounds pruned too little"
    assert any(row[2][-1] for row in reference), "no hierarchical CP among the layouts"


def test_search_ranks_as_the_brute_force_on_ranks_sharing_cores():
    """4 ranks on 2 cores of one node, collectives taking processor time (a calibrated CPU's kind: a collective
    run while fewer ranks compute ends before its measured wall time, so a phase's plain total is no floor; the
    bounds read ``least_time``): the top 1, 3 and 10 with pruning are the brute force's to the bit."""
    rates = {kind: CollectiveRate(2e-3, 1e9, 4, 1e-3, 2e9) for kind in ("all_reduce", "all_gather",
                                                                       "reduce_scatter", "all_to_all")}
    rates["send_recv"] = CollectiveRate(1.4e-3, 2e9, 4, 0.7e-3, 4e9)
    hw = dataclasses.replace(H100, cores=2, gpus_per_node=4, collectives={"intra": rates}, memory_bytes=1e15)
    reference = _brute_force(BASE, 4, hw, 4, 8)
    assert len(reference) > 10
    for limit in (1, 3, 10):
        result = search_layouts(BASE, 4, hw, gpus_per_node=4, global_batch=8, limit=limit)
        assert [x.step_time_s for x in result.layouts] == [row[0] for row in reference[:limit]], limit
        assert result.evaluated < len(reference), "the bounds pruned nothing"


MOE_BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "megatron": {"model": dict(BASE["megatron"]["model"], num_experts=4, moe_router_topk=2,
                                       moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=64)}}


def test_search_ranks_recomputed_moe_layers_as_the_brute_force():
    """An MoE model on 2 GPUs: full and selective ``moe`` recomputation are searched beside none and ``core_attn``,
    and the list, with a memory that keeps some of each, is the brute force's to the bit."""
    everything = _brute_force(MOE_BASE, 2, dataclasses.replace(H100, memory_bytes=1e15), 2, 4)
    kinds = {row[2][KEY.index("recompute")] for row in everything}
    assert kinds == {"none", "selective", "selective_moe", "full"}, kinds
    peaks = sorted(row[1] for row in everything)
    hw = dataclasses.replace(H100, memory_bytes=peaks[len(peaks) // 2])
    reference = [row for row in everything if row[1] <= hw.memory_bytes]
    assert {row[2][KEY.index("recompute")] for row in reference} >= {"selective_moe", "full"}
    result = search_layouts(MOE_BASE, 2, hw, gpus_per_node=2, global_batch=4, limit=10 ** 6)
    got = [(x.step_time_s, x.peak_memory_gib * 2 ** 30, _key(x)) for x in result.layouts]
    assert [row[0] for row in got] == [row[0] for row in reference]
    by_key = {row[2]: row for row in reference}
    for step, peak, key in got:
        assert by_key[key][0] == step and by_key[key][1] == pytest.approx(peak, rel=1e-15), key


def _phases(costs):
    def cost(seconds):
        c = Cost()
        c.add("gemm", seconds)
        return c
    return [[tuple(cost(x) for x in chunk) for chunk in stage] for stage in costs]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zero_bubble"])
def test_pipeline_floor_is_below_the_simulation_and_the_formula_for_equal_stages(schedule):
    """Random per-chunk costs and message times: never above the simulated finish; equal stages without message
    time: (m + p - 1)(F + B + W) / ... the 1F1B and interleaved formula, which the simulation gives too."""
    rng = random.Random(0)
    for _ in range(40):
        p = rng.choice([2, 3, 4, 8])
        v = rng.choice([2, 3]) if schedule == "interleaved_1f1b" else 1
        m = p * rng.choice([1, 2, 3]) if v > 1 else rng.choice([1, 2, 5, p, 2 * p + 1])
        equal = rng.random() < 0.5
        one = tuple(rng.random() for _ in range(3))
        costs = [[one if equal else tuple(rng.random() for _ in range(3)) for _ in range(v)] for _ in range(p)]
        message = rng.choice([0.0, 0.0, 0.01, 0.3])
        kind = "zero_bubble" if schedule == "zero_bubble" else "interleaved_1f1b"
        finish = max(simulate_pipeline(m, v, p, schedule=kind, costs=costs, message_time=message).finish)
        run = dataclasses.make_dataclass("R", ["micro_batches", "schedule"])(m, schedule)
        floor = pipeline_floor(run, _phases(costs), message, H100)
        assert floor <= finish, (p, v, m, costs, message)
        if equal and message == 0.0 and schedule != "zero_bubble":
            f, b, w = one
            formula = (m * v + p - 1) * (f + b + w)  # chunk costs: (p - 1) / v of a stage's F + B + W idle
            assert finish == pytest.approx(formula, rel=1e-12) and floor == pytest.approx(formula, rel=1e-8)


@pytest.mark.parametrize("m,v,p,group,schedule", [(6, 1, 3, None, "interleaved_1f1b"), (8, 2, 4, 4,
                                                  "interleaved_1f1b"), (9, 3, 3, 3, "interleaved_1f1b"),
                                                  (7, 1, 4, None, "zero_bubble")])
def test_compiled_orders_are_the_tables_messages(m, v, p, group, schedule):
    """The simulation's numbered orders: the same operations, each waiting for and sending the message
    ``receives_of`` / ``sends_of`` name (one number per message, a sent message received by the same number);
    1F1B's and interleaved ranks end on chunk 0's backward (what ``pipeline_floor`` reads)."""
    programs = _programs(m, v, p, group or p, schedule)
    names = {}
    for r in range(p):
        ops = rank_operations(m, v, pipeline_parallel_size=p, pipeline_parallel_rank=r,
                              microbatch_group_size_per_vp_stage=group, schedule=schedule)
        assert len(ops) == len(programs[r])
        for op, (kind, chunk, needed, sent) in zip(ops, programs[r]):
            assert kind == (0 if op.forward else {"full": 1, "input": 2, "weight": 3}[op.part]) and chunk == op.chunk
            for number, message in ((needed, receives_of(op, r, p, v)), (sent, sends_of(op, r, p, v))):
                assert (number == -1) == (message is None)
                if message is not None:
                    assert names.setdefault(number, message[1]) == message[1]
        if schedule != "zero_bubble":
            assert not ops[-1].forward and ops[-1].chunk == 0
    assert len(names) == len(set(names.values()))


def _zero_bubble_reference(m, p):
    """ZB-H1's rule spelled out turn by turn (unit costs): every turn, the ranks sorted afresh by (clock, rank),
    the first that can act runs its next F or B (then a W if more than ``rank`` wait in the steady state), a
    waiting W, or idles to its input's arrival."""
    base = [[op if op.forward else dataclasses.replace(op, part="input")
             for op in rank_operations(m, 1, pipeline_parallel_size=p, pipeline_parallel_rank=r)] for r in range(p)]
    out, pending, position, clock, left, arrived = [[] for _ in range(p)], [[] for _ in range(p)], [0] * p, \
        [0.0] * p, [m] * p, {}

    def run(r, op):
        out[r].append(op)
        clock[r] += 1.0
        sent = sends_of(op, r, p, 1)
        if sent:
            arrived[sent[1]] = clock[r]
    while any(position[r] < len(base[r]) or pending[r] for r in range(p)):
        for r in sorted(range(p), key=lambda k: (clock[k], k)):
            if position[r] == len(base[r]):
                if pending[r]:
                    run(r, pending[r].pop(0))
                    break
                continue
            op = base[r][position[r]]
            needed = receives_of(op, r, p, 1)
            ready = 0.0 if needed is None else arrived.get(needed[1])
            if ready is not None and ready <= clock[r]:
                position[r] += 1
                run(r, op)
                if op.forward:
                    left[r] -= 1
                else:
                    pending[r].append(dataclasses.replace(op, part="weight"))
                    if left[r] > 0 and len(pending[r]) > r:
                        run(r, pending[r].pop(0))
            elif pending[r]:
                run(r, pending[r].pop(0))
            elif ready is not None:
                clock[r] = ready
            else:
                continue
            break
    return out


@pytest.mark.parametrize("m,p", [(3, 2), (8, 4), (13, 5), (24, 8)])
def test_zero_bubble_orders_follow_the_turn_rule(m, p):
    """The orders ZB-H1 builds with its clock-sorted queue are those of re-sorting the ranks every turn."""
    assert zero_bubble_orders(m, p) == _zero_bubble_reference(m, p)
