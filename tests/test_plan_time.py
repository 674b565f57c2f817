"""``ds-megatron plan``'s clock against independent references: FLOPs against hand counts, each schedule's bubble
against its formula, a collective against its profile, the search's memory filter against ``plan``, and the
published runs (Narayanan et al. Table 1, Korthikanti et al. Table 5) within the goal; ranks sharing a CPU's cores
against the step worked out by hand.  Torch-free."""
import dataclasses
import json

import pytest

from ds_megatron.config.model import GPTConfig
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.pipeline_parallel.schedule_table import simulate_pipeline
from ds_megatron.planning import published
from ds_megatron.planning.flops import forward_flops, model_flops, narayanan_flops
from ds_megatron.planning.hardware import (LINK_EFFICIENCY, A100, CollectiveRate, Hardware, hardware_from_dict,
                                          load_hardware)
from ds_megatron.planning.report import main, plan_from_config
from ds_megatron.planning.search import candidate_config, search_layouts
from ds_megatron.planning.step_time import (Run, _after_backward, _Pricer, group_spans_nodes, plan_step_time,
                                            stage_phases)

S, H, L, V = 256, 512, 4, 1024


def _model(**kw):
    base = dict(num_layers=L, hidden_size=H, num_attention_heads=8, seq_length=S, vocab_size=V,
                hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=128)
    base.update(kw)
    return GPTConfig(**base)


def test_dense_flops_are_the_published_formula():
    """GPT-3's layer, 24 s h^2 + 4 s^2 h, and the logits 2 s h V; x3 for a step; Narayanan's eq. 3 is x4 with
    the logits not rerun."""
    cfg = _model()
    per_layer = 24 * S * H * H + 4 * S * S * H
    assert forward_flops(cfg, 2) == 2 * (L * per_layer + 2 * S * H * V)
    assert model_flops(cfg, 2) == 3 * forward_flops(cfg, 2)
    recomputed = 4 * L * per_layer + 6 * S * H * V
    assert narayanan_flops(1, S, L, H, V) == pytest.approx(recomputed, rel=1e-12)


def test_gqa_swiglu_mla_moe_flops_against_a_hand_count():
    n, d, g, f = 8, 64, 2, 1536
    gqa_swiglu = _model(num_query_groups=g, gated_linear_unit=True, activation="silu", ffn_hidden_size=f,
                        add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope")
    layer = (2 * S * H * (n + 2 * g) * d  # q, k, v
             + 2 * S * S * n * (d + d)  # Q K^T and P V, causal counted in full
             + 2 * S * n * d * H  # output projection
             + 3 * 2 * S * H * f)  # gate, up, down
    assert forward_flops(gqa_swiglu) == L * layer + 2 * S * H * V

    mla = _model(multi_latent_attention=True, q_lora_rank=96, kv_lora_rank=64, qk_head_dim=32,
                 qk_pos_emb_head_dim=16, v_head_dim=48, position_embedding_type="rope", add_bias_linear=False,
                 normalization="RMSNorm")
    qk, vd = 32 + 16, 48
    layer = (2 * S * (H * 96 + H * (64 + 16))  # down-projections of q and of kv (with the shared RoPE key)
             + 2 * S * (96 * n * qk + 64 * n * (32 + vd))  # up-projections
             + 2 * S * S * n * (qk + vd) + 2 * S * n * vd * H + 2 * 2 * S * H * 4 * H)
    assert forward_flops(mla) == L * layer + 2 * S * H * V

    moe = _model(num_experts=8, moe_ffn_hidden_size=256, moe_router_topk=2, add_bias_linear=False,
                 moe_shared_expert_intermediate_size=384)
    layer = (2 * S * H * 3 * H + 2 * S * S * H * 2 + 2 * S * H * H
             + 2 * S * H * 8  # router
             + 2 * (2 * 2 * S * H * 256)  # two experts per token, fc1 and fc2
             + 2 * 2 * S * H * 384)  # the shared expert
    assert forward_flops(moe) == L * layer + 2 * S * H * V


@pytest.mark.parametrize("p,v,m", [(4, 1, 8), (4, 2, 8), (8, 3, 16)])
def test_bubble_of_1f1b_and_interleaved_is_the_formula(p, v, m):
    """From the schedule table with even stages: idle time / ideal time = (p - 1) / (v m)."""
    f, b = 1.0, 2.0
    timing = simulate_pipeline(m, v, p, forward_time=f, backward_time=b)
    ideal = m * v * (f + b)
    assert (timing.step_time - ideal) / ideal == pytest.approx((p - 1) / (v * m), rel=1e-12)


def test_bubble_of_zb_h1_is_its_formula():
    """ZB-H1 (Qi et al.): (p - 1)(F + B - W) of idle time, where 1F1B has (p - 1)(F + B + W)."""
    p, m, f, b, w = 4, 8, 1.0, 1.0, 1.0
    costs = [[(f, b, w)] for _ in range(p)]
    zb = simulate_pipeline(m, 1, p, schedule="zero_bubble", costs=costs)
    plain = simulate_pipeline(m, 1, p, costs=costs)
    assert zb.step_time - m * (f + b + w) == pytest.approx((p - 1) * (f + b - w))
    assert plain.step_time - m * (f + b + w) == pytest.approx((p - 1) * (f + b + w))


# Free links and memory, every GEMM at one rate: the step is the GEMMs and the pipeline.
FREE = Hardware("test", {"fp32": 1e13}, 1e30, 1e12, 1e30, 1e30, hop_latency_s={"intra": 0.0, "inter": 0.0},
                kernel_launch_s=0.0, gemm_table=[[1, 1, 1, 1e13]], attention_kernel="materialized")


def test_plan_step_time_bubble_follows_the_chunks():
    """Through the whole model (small ends: a small vocabulary): the bubble the plan reports is
    (p - 1) / (v m) of the rank's compute, so ignoring v doubles it."""
    cfg = _model(num_layers=8, vocab_size=128, position_embedding_type="rope")
    for v in (1, 2):
        run = Run(cfg, ParallelLayout(world_size=4, pp=4), "fp32", 1, 8, "interleaved_1f1b", v)
        step = plan_step_time(run, FREE)
        compute = sum(s for k, s in step.breakdown.items() if k != "pipeline_bubble_s")
        # the ends (the embedding, the output layer) unbalance the stages by a few percent
        assert step.breakdown["pipeline_bubble_s"] / compute == pytest.approx(3 / (v * 8), rel=0.08)


def test_attention_time_is_half_the_counted_flops_under_a_causal_flash_kernel():
    """The flash kernel skips the masked half: its forward at FlashAttention-2's efficiency."""
    cfg = _model(position_embedding_type="rope")
    run = Run(cfg, ParallelLayout(world_size=1), "bf16", 2, 1)
    step = plan_step_time(run, A100)
    core = 2 * 2 * S * S * 8 * 64 * 2 / 2  # b=2, full count halved
    expected = L * (core / (312e12 * 0.70) + 2.5 * core / (312e12 * 0.55))
    assert step.breakdown["attention_s"] == pytest.approx(expected, rel=1e-9)


def test_a_collective_costs_its_latency_and_bus_bytes_at_the_link_bandwidth():
    nbytes = 3e8
    ring = A100.collective_time("all_reduce", 8, nbytes, inter_node=False)
    assert ring == pytest.approx(2 * 7 * 2e-6 + nbytes / (300e9 * LINK_EFFICIENCY))
    assert A100.collective_time("all_reduce", 8, nbytes, inter_node=True) == pytest.approx(
        2 * 7 * 5e-6 + nbytes / (25e9 * LINK_EFFICIENCY))
    measured = dataclasses.replace(A100, collectives={"intra": {"all_gather": CollectiveRate(1e-4, 2e9)}})
    assert measured.collective_time("all_gather", 4, nbytes, False) == pytest.approx(1e-4 + nbytes / 2e9)
    # Measured over 4 ranks (6 ring steps of an all-reduce), the latency of 2 ranks' (2 steps) is a third of it.
    four = dataclasses.replace(A100, collectives={"intra": {"all_reduce": CollectiveRate(6e-3, 2e9, ranks=4)}})
    assert four.collective_time("all_reduce", 2, nbytes, False) == pytest.approx(2e-3 + nbytes / 2e9)
    assert four.collective_time("all_reduce", 4, nbytes, False) == pytest.approx(6e-3 + nbytes / 2e9)
    assert four.collective_time("send_recv", 2, nbytes, False) == pytest.approx(2e-3 + nbytes / 2e9)
    layout = ParallelLayout(world_size=64, tp=8, pp=2)
    assert not group_spans_nodes(layout, "tp", 8) and group_spans_nodes(layout, "dp-cp", 8)
    assert group_spans_nodes(layout, "pp", 8) and not group_spans_nodes(layout, "pp", 64)


def test_tensor_parallel_collectives_priced_by_kind_by_hand():
    """TP 2, one micro-batch, bf16, on a profile whose all-gather, reduce-scatter and all-reduce cost apart (gloo's
    reduce-scatter is the slowest on a CPU).  Per layer, forward and again backward: with SP two all-gathers and two
    reduce-scatters of the rank's [s, b, h] (bus: half of it), without SP two all-reduces (bus: all of it); the
    embedding's sum (SP: a reduce-scatter), the output layer's gather (SP) forward and its input gradient's
    reduction backward, and the cross entropy's two all-reduces of a float per token."""
    gather, scatter, reduce = CollectiveRate(1e-3, 1e9), CollectiveRate(3e-3, 2e8), CollectiveRate(2e-3, 5e8)
    hw = dataclasses.replace(A100, collectives={"intra": {"all_gather": gather, "reduce_scatter": scatter,
                                                          "all_reduce": reduce}})
    whole = S * H * 2

    def cost(rate, bus):
        return rate.latency_s + bus / rate.bus_bytes_per_s
    stats = 2 * cost(reduce, 4 * S)
    for sp in (True, False):
        run = Run(_model(sequence_parallel=sp), ParallelLayout(world_size=2, tp=2), "bf16", 1, 1)
        if sp:
            g, r = cost(gather, whole / 2), cost(scatter, whole / 2)
            expected = L * 2 * 2 * (g + r) + (g + stats + r) + r
        else:
            r = cost(reduce, whole)
            expected = L * 2 * 2 * r + (stats + r) + r
        step = plan_step_time(run, hw, gpus_per_node=8)
        assert step.breakdown["tp_comm_s"] == pytest.approx(expected, rel=1e-12), sp
    # Measured after a short gap too (a CPU's gloo: cheaper right after another collective), and after a long one
    # shorter than any work here: SP's gathers (right after the previous scatter, a norm between) take the short
    # fit, every reduction (after its block's work) the long one.
    short = dict(gap_s=1e-9, short_gap_s=1e-12, short_latency_s=0.2e-3, short_bus_bytes_per_s=4e9)
    fits = {kind: dataclasses.replace(rate, **short) for kind, rate in
            (("all_gather", gather), ("reduce_scatter", scatter), ("all_reduce", reduce))}
    hw = dataclasses.replace(A100, collectives={"intra": fits})
    g_short, g, r = 0.2e-3 + whole / 2 / 4e9, cost(gather, whole / 2), cost(scatter, whole / 2)
    assert hw.collective_time("all_gather", 2, whole / 2, False, gap=0.0) == pytest.approx(g_short)
    assert hw.collective_time("all_gather", 2, whole / 2, False) == pytest.approx(g) != g_short
    run = Run(_model(sequence_parallel=True), ParallelLayout(world_size=2, tp=2), "bf16", 1, 1)
    step = plan_step_time(run, hw, gpus_per_node=8)
    assert step.breakdown["tp_comm_s"] == pytest.approx(L * 2 * 2 * (g_short + r) + (g_short + stats + r) + r,
                                                        rel=1e-12)


def test_a_collective_priced_by_the_compute_before_it_by_hand():
    """A rate measured after a long and after a short gap of compute: at or past the long gap (or no gap given)
    the long fit, at or below the short gap the short fit, between them on a log scale of the gap (a gap 10x the
    short of a range 100x: halfway); the latency scales by ring steps in both."""
    rate = CollectiveRate(4e-3, 1e9, 4, gap_s=1e-2, short_gap_s=1e-4, short_latency_s=1e-3, short_bus_bytes_per_s=2e9)
    long, short = 4e-3 + 1e6 / 1e9, 1e-3 + 1e6 / 2e9
    assert rate.seconds(1.0, 1e6) == rate.seconds(1.0, 1e6, gap=5e-2) == pytest.approx(long)
    assert rate.seconds(1.0, 1e6, gap=0.0) == rate.seconds(1.0, 1e6, gap=1e-4) == pytest.approx(short)
    assert rate.seconds(1.0, 1e6, gap=1e-3) == pytest.approx((long + short) / 2)
    assert rate.seconds(0.5, 1e6, gap=0.0) == pytest.approx(0.5e-3 + 1e6 / 2e9)
    hw = dataclasses.replace(A100, collectives={"intra": {"all_gather": rate}})
    assert hw.collective_time("all_gather", 2, 1e6, False, gap=1e-3) == pytest.approx(
        (4e-3 / 3 + 1e6 / 1e9 + 1e-3 / 3 + 1e6 / 2e9) / 2)
    without = dataclasses.replace(rate, short_gap_s=0.0)  # no short fit measured: the long one at any gap
    assert without.seconds(1.0, 1e6, gap=0.0) == pytest.approx(long)


def test_moe_exchange_is_the_ep_all_to_all_and_the_etp_gather_and_scatter_by_hand():
    """TP 2 + SP, EP 2, ETP 2 on 4 GPUs of one node, top-2 of 4 experts: per MoE layer, forward and again
    backward, two all-to-alls over EP of the rank's 128 tokens x 2 copies and an all-gather plus a
    reduce-scatter over ETP of the 2 x that its experts take; each at the A100's NVLink step latency and bus
    bandwidth."""
    cfg = _model(num_experts=4, moe_ffn_hidden_size=256, moe_router_topk=2, add_bias_linear=False,
                 sequence_parallel=True)
    run = Run(cfg, ParallelLayout(world_size=4, tp=2, ep=2, etp=2), "bf16", 1, 1)
    sent = (S // 2) * 2 * H * 2  # bytes this rank routes: its SP slice's tokens x top-2, bf16
    a2a_bus, gather_bus = sent / 2, 2 * sent / 2  # (n - 1) / n of what each collective moves, n = 2

    def one(bus):
        return 2e-6 + bus / (300e9 * LINK_EFFICIENCY)  # one step of a 2-rank collective inside the node
    per_way = 2 * one(a2a_bus) + 2 * one(gather_bus)
    step = plan_step_time(run, A100, gpus_per_node=8)
    assert step.breakdown["moe_comm_s"] == pytest.approx(L * 2 * per_way, rel=1e-12)


def test_recomputed_moe_layer_reruns_its_experts_shared_expert_and_exchanges_by_hand():
    """Selective ``moe`` at TP 2 + SP, EP 2, ETP 2 (4 GPUs of one node), top-2 of 4 experts and a shared expert: B
    of each MoE layer carries the layer's rerun, every GEMM of the router, the local experts (fc1 and fc2) and the
    shared expert, its memory-bound work, the forward's exchange (two all-to-alls over EP, an ETP all-gather and
    reduce-scatter) and the shared expert's TP gather and reduce-scatter, priced on the A100 by hand.  A whole
    layer recomputed reruns its forward up to its last saved tensor (un-permuting's indices): all of it but the
    bias-dropout-add after the MLP; without SP or a shared expert, less the TP reduction the forward is priced
    beyond attention's."""
    a, T, t, k, E, ffn, shared = 2, S, 2, 2, 4, 256, 256
    cfg = _model(num_experts=E, moe_ffn_hidden_size=ffn, moe_router_topk=k, add_bias_linear=False,
                 sequence_parallel=True, moe_shared_expert_intermediate_size=shared,
                 recompute_granularity="selective", recompute_modules=["moe"])
    run = Run(cfg, ParallelLayout(world_size=4, tp=2, ep=2, etp=2), "bf16", 1, 1)

    def one(bus):
        return 2e-6 + bus / (300e9 * LINK_EFFICIENCY)  # one step of a 2-rank collective inside the node
    routed, width = T * k * 2 // t, ffn // 2  # rows the rank's experts take (ETP-gathered), fc1's rows per rank
    gemms = (A100.gemm_time(T // t, E, H, "bf16") + A100.gemm_time(routed / 2, width, H, "bf16", batch=2)
             + A100.gemm_time(routed / 2, H, width, "bf16", batch=2) + A100.gemm_time(T, shared // t, H, "bf16")
             + A100.gemm_time(T, H, shared // t, "bf16"))
    memory = A100.memory_time(routed * 2 * width * a + 4 * routed * H * a + T * 2 * (shared // t) * a)
    exchange = 2 * one(routed // 2 * H * a / 2) + 2 * one(routed * H * a / 2)
    shared_tp = 2 * one(T * H * a / 2)
    step = plan_step_time(run, A100, gpus_per_node=8)
    assert step.breakdown["recompute_s"] == pytest.approx(L * (gemms + memory + exchange + shared_tp), rel=1e-12)
    # Whole layers: the forward less the MLP's bias-dropout-add (SP: this rank's rows); with a shared expert under
    # SP the rerun's TP traffic is the forward's (attention's and the shared expert's gathers and scatters).
    for sp, extra in [(True, dict(moe_shared_expert_intermediate_size=shared)), (False, {})]:
        full = _model(num_experts=E, moe_ffn_hidden_size=ffn, moe_router_topk=k, add_bias_linear=False,
                      sequence_parallel=sp, recompute_granularity="full", **extra)
        pricer = _Pricer(Run(full, run.layout, "bf16", 1, 1), A100, 8)
        forward = pricer.layer(0, False)[0].total
        rerun = pricer.layer(0, True)[1].parts["recompute"]
        tail = A100.memory_time((T // t if sp else T) * 3 * H * a)
        # without SP the forward is priced two all-reduces (2 steps, bus 2 x (n-1)/n of T h), the rerun one
        second = 0.0 if sp else 2 * 2e-6 + T * H * a / (300e9 * LINK_EFFICIENCY)
        assert rerun == pytest.approx(forward - tail - second, rel=1e-12), sp


def test_hierarchical_cp_exchange_by_hand():
    """CP 4 as a2a+p2p [2, 2] (one node): per layer, forward an all-to-all over 2 ranks of the rank's Q, K and V
    heads (64 tokens, 8 + 8 heads of 64 + 64 widths, bf16) and one ring step of its K and V; backward the
    all-to-all and two ring steps (K/V and their gradients); all exposed."""
    run = Run(_model(cp_comm_type="a2a+p2p"), ParallelLayout(world_size=4, cp=4), "bf16", 1, 1,
              hierarchical_inner=2)
    pair = (S // 4) * (64 + 64)  # a rank's tokens x (q/k width + v width), per head

    def one(bus):
        return 2e-6 + bus / (300e9 * LINK_EFFICIENCY)  # one step between 2 ranks inside the node
    a2a = one((8 + 8) * pair * 2 / 2)
    ring = one(8 * pair * 2)  # a send/recv's bytes are its message
    step = plan_step_time(run, A100, gpus_per_node=8)
    assert step.breakdown["cp_comm_s"] == pytest.approx(L * (2 * a2a + 3 * ring), rel=1e-12)


def test_cli_prints_the_time_and_its_json(tmp_path, capsys):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                                "bf16": {"enabled": True}, "megatron": {
                                    "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                    "model": dict(num_layers=4, hidden_size=256, num_attention_heads=8,
                                                  seq_length=128, vocab_size=512)}}))
    assert main(["--config", str(path), "--world-size", "8", "--hardware", "h100", "--json"]) == 0
    time = json.loads(capsys.readouterr().out)["time"]
    assert time["step_time_s"] == pytest.approx(sum(time["breakdown"].values()), rel=1e-9)
    assert time["mfu"] == pytest.approx(time["model_tflops_per_gpu"] * 1e12 / 989e12)
    assert main(["--config", str(path), "--world-size", "8", "--hardware", "tpu"]) == 2
    assert "--hardware 'tpu' is neither" in capsys.readouterr().err


def test_search_keeps_exactly_the_layouts_whose_plan_fits(tmp_path):
    """With a memory between the layouts' peaks, every layout the search returns has the plan's peak of its
    config and fits; every variant the plan says fits is returned (limit above their number)."""
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "megatron": {"model": dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128,
                                       vocab_size=512, hidden_dropout=0.0, attention_dropout=0.0)}}
    roomy = dataclasses.replace(A100, memory_bytes=1e12)
    everything = search_layouts(base, 2, roomy, gpus_per_node=2, global_batch=4, limit=10 ** 6).layouts
    peaks = sorted(x.peak_memory_gib for x in everything)
    budget = peaks[len(peaks) // 2]
    tight = dataclasses.replace(A100, memory_bytes=budget * 2 ** 30)
    kept = search_layouts(base, 2, tight, gpus_per_node=2, global_batch=4, limit=10 ** 6).layouts
    assert 0 < len(kept) < len(everything)
    assert len(kept) == sum(x.peak_memory_gib <= budget for x in everything)
    for x in kept:
        choice = dict(tp=x.tp, pp=x.pp, cp=x.cp, cp_comm_type=x.cp_comm_type, ep=x.ep, etp=None, vpp=x.vpp,
                      micro_batch=x.micro_batch, recompute=x.recompute, schedule=x.schedule, first=x.first,
                      last=x.last, distributed_optimizer=x.distributed_optimizer)
        _, plans, _ = plan_from_config(candidate_config(base, choice, 4, x.dp), 2, kernels=tight.kernels)
        assert max(p.total_bytes for p in plans) == pytest.approx(x.peak_memory_gib * 2 ** 30)
        assert x.peak_memory_gib <= budget
    assert [x.step_time_s for x in kept] == sorted(x.step_time_s for x in kept)


def test_published_runs_within_the_goal():
    """Narayanan et al. Table 1 and Korthikanti et al. Table 5, recomputed: mean error <= 10%, none above 20%."""
    rows = published.narayanan_rows() + published.korthikanti_rows()
    errors = [abs(r["error"]) for r in rows]
    assert len(rows) == 18
    assert sum(errors) / len(errors) <= 0.10 and max(errors) <= 0.20, rows


def test_search_beats_the_papers_layout_at_its_gpu_count():
    """Korthikanti's 22B on 8 GPUs, batch 4: the search's first layout is predicted at least as fast."""
    name, h, layers, heads, tp, pp, vpp, gpus, batch, _, _ = published.KORTHIKANTI_TABLE_5[0]
    paper = published.paper_config(h, layers, heads, tp, pp, vpp, 1, batch, "selective")
    step = published.predict(paper, gpus)
    hw = published.A100_2021
    first = search_layouts(paper, gpus, hw, global_batch=batch, limit=1).layouts[0]
    assert first.step_time_s <= step, (first, step)


def test_compute_efficiency_divides_every_compute_part_of_a_gpu_step():
    """On a GPU profile too (its flash attention core priced from the peak, not a GEMM table): at a
    ``compute_efficiency`` of 0.5 every compute part of the step doubles, its collectives do not move (nor a
    kernel's launch, left out here: it is not compute)."""
    run = Run(_model(sequence_parallel=True), ParallelLayout(world_size=2, tp=2), "bf16", 1, 4)
    gpu = dataclasses.replace(A100, kernel_launch_s=0.0)
    one = plan_step_time(run, gpu, gpus_per_node=8).breakdown
    half = plan_step_time(run, dataclasses.replace(gpu, compute_efficiency=0.5), gpus_per_node=8).breakdown
    for part in ("gemm_s", "attention_s", "elementwise_s", "optimizer_s"):
        assert half[part] == pytest.approx(2 * one[part], rel=1e-12), part
    assert half["tp_comm_s"] == one["tp_comm_s"]


def test_cp_ring_blocks_on_a_materialized_profile_by_hand():
    """CP 2, p2p, on a profile whose attention goes through memory (a CPU's): per layer and rank, 5 block pairs of
    c = 64 tokens square (two diagonal), 8 heads of 64, fp32 scores; forward Q K^T and P V per pair, backward the
    scores again, dV, dP, dQ and dK; passes over the scores and the output rows as ``RING_PAIR_PASSES`` (tested
    against the ring itself in test_plan_ring.py), each diagonal pair's mask one more each way."""
    hw = dataclasses.replace(A100, attention_kernel="materialized")
    c, n, d = S // 4, 8, 64
    scores, rows = n * c * c * 4, n * c * d * 4

    def g(m, n_, k):
        return hw.gemm_time(m, n_, k, "bf16", n)
    forward = 5 * (g(c, c, d) + g(c, d, c) + hw.memory_time(7 * scores + 7 * rows)) + 2 * hw.memory_time(2 * scores)
    backward = (5 * (2 * g(c, c, d) + g(c, d, c) + 2 * g(c, d, c) + hw.memory_time(11 * scores + 13 * rows))
                + 2 * hw.memory_time(2 * scores))
    run = Run(_model(), ParallelLayout(world_size=2, cp=2), "bf16", 1, 1)
    step = plan_step_time(run, hw, gpus_per_node=8)
    assert step.breakdown["attention_s"] == pytest.approx(L * (forward + backward), rel=1e-12)


def test_cp_ring_hides_the_profiles_overlap_share_behind_attention():
    """CP 2, p2p ring, one micro-batch: per layer, forward one ring step of the rank's K and V (128 tokens, 8 heads
    of 64 + 64, bf16), backward two messages: K and V again, then their fp32 gradients' accumulator (each a
    latency); each hides ``comm_overlap`` x the part the attention core (flash, causal half of 128 x 256 per head)
    covers.  A GPU profile hides all of it."""
    assert A100.comm_overlap == 1.0
    rate = CollectiveRate(1e-7, 1e12)
    pair = (S // 2) * (64 + 64)
    ring_fwd, ring_bwd = 1e-7 + 8 * pair * 2 / 1e12, 2e-7 + 8 * pair * (2 + 4) / 1e12
    core = 2 * 8 * (S // 2) * S * (64 + 64) / 2
    attn_fwd, attn_bwd = core / (312e12 * 0.70), 2.5 * core / (312e12 * 0.55)
    run = Run(_model(), ParallelLayout(world_size=2, cp=2), "bf16", 1, 1)
    steps = {}
    for f in (0.0, 0.5, 1.0):
        hw = dataclasses.replace(A100, comm_overlap=f, collectives={"intra": {"send_recv": rate, "all_reduce": rate}})
        steps[f] = plan_step_time(run, hw, gpus_per_node=8)
        expected = L * (ring_fwd - f * min(ring_fwd, attn_fwd) + ring_bwd - f * min(ring_bwd, attn_bwd))
        assert steps[f].breakdown.get("cp_comm_s", 0.0) == pytest.approx(expected, rel=1e-9)
    # Nothing else moves: the step grows by the ring exposed.
    assert steps[0.0].step_time_s - steps[1.0].step_time_s == pytest.approx(
        L * (min(ring_fwd, attn_fwd) + min(ring_bwd, attn_bwd)), rel=1e-9)


def test_overlapped_grad_reduce_hides_the_profiles_share_of_all_but_the_last_bucket():
    """DP 2, overlap_grad_reduce with 7M-element buckets: the model's ~13M parameters make two buckets; on a
    fast link the first bucket's reduction (half of it) fits inside the last backward, so ``comm_overlap`` f
    leaves r / 2 + (1 - f) r / 2 of the whole reduction r (the same step without overlap) exposed; likewise the
    distributed optimizer's parameter all-gather behind the next forward."""
    rate = CollectiveRate(1e-6, 1e13)
    base = Run(_model(), ParallelLayout(world_size=2), "bf16", 1, 1)
    for f in (0.0, 0.5, 1.0):
        hw = dataclasses.replace(A100, comm_overlap=f, collectives={"intra": {"all_reduce": rate}})
        whole = plan_step_time(base, hw).breakdown["dp_comm_s"]
        overlapped = dataclasses.replace(base, overlap_grad_reduce=True, bucket_size=7_000_000)
        assert plan_step_time(overlapped, hw).breakdown["dp_comm_s"] == pytest.approx(
            whole / 2 + (1 - f) * whole / 2, rel=1e-9)
    # The distributed optimizer's parameter all-gather g behind the next forward: (1 - f) g exposed.
    base = dataclasses.replace(base, distributed_optimizer=True)
    for f in (0.0, 0.5, 1.0):
        hw = dataclasses.replace(A100, comm_overlap=f, collectives={"intra": {"all_reduce": rate}})
        whole = plan_step_time(base, hw).breakdown["param_gather_s"]
        overlapped = dataclasses.replace(base, overlap_param_gather=True)
        assert plan_step_time(overlapped, hw).breakdown.get("param_gather_s", 0.0) == pytest.approx(
            (1 - f) * whole, rel=1e-9)
    with pytest.raises(ValueError, match="comm_overlap=1.5 is outside 0..1"):
        hardware_from_dict(dict(A100.to_json(), comm_overlap=1.5))


def test_hardware_files_round_trip(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(A100.to_json()))
    assert load_hardware(str(path)) == A100
    doc = dict(A100.to_json(), tflops=1)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="unknown field 'tflops'"):
        load_hardware(str(path))


@pytest.mark.parametrize("pp", [1, 2])
def test_ranks_sharing_cores_by_hand(pp):
    """DP 4, or PP 2 x DP 2 (1F1B, 4 micro-batches), 4 ranks on 2 cores, free links: a stage computing alone has
    the 2 cores to its 2 ranks, both stages computing halve every rank's rate; with no message time a stage waits
    only while the other computes, so the cores never idle and the step is all ranks' work over the cores: world /
    pp ranks x every stage's work (its micro-batches' F, B and W, and its optimizer step) / 2.  The same job on a
    core per rank: PP 2 takes the 1F1B schedule's step; a rate halved throughout (every rank computing at once,
    what the calibration measured before) would take twice that."""
    hw = dataclasses.replace(FREE, gemm_table=[[1, 1, 1, 1e11]], hbm_bytes_per_s=1e10, cores=2)
    run = Run(_model(vocab_size=128, position_embedding_type="rope"), ParallelLayout(world_size=4, pp=pp), "fp32",
              1, 4)
    pricer = _Pricer(run, hw, hw.gpus_per_node)
    phases = stage_phases(run, pricer)
    work = [4 * sum(f.total + b.total + w.total for f, b, w in stage)
            + _after_backward(run, hw, pricer, i, stage)[0]["optimizer_s"] for i, stage in enumerate(phases)]
    step = plan_step_time(run, hw)
    assert step.step_time_s == pytest.approx(4 // pp * sum(work) / 2, rel=1e-12)
    assert sum(step.breakdown.values()) == pytest.approx(step.step_time_s, rel=1e-12)
    alone = plan_step_time(run, dataclasses.replace(hw, cores=4))  # a core per rank
    assert "core_sharing_s" not in alone.breakdown and step.breakdown["core_sharing_s"] > 0
    if pp == 2:  # the bubble's cores lent to the busy stage: 0.81x the step at a rate halved throughout
        assert alone.step_time_s < step.step_time_s < 0.85 * 2 * alone.step_time_s
    else:  # every rank computes throughout: the rate halved
        assert step.step_time_s == pytest.approx(2 * alone.step_time_s, rel=1e-12)
    # Messages whose processor time c is all of their measured wall time at the measured share (no delay left):
    # the cores still never idle, and each stage's ranks add c for each of their 2m messages.
    c = 1e-3
    messages = _measured(hw, 0.0, send_recv_cpu=c, latency=0.0)
    step = plan_step_time(run, messages)
    assert step.step_time_s == pytest.approx(4 // pp * (sum(work) + (pp > 1) * pp * 2 * 4 * c) / 2, rel=1e-12)
    assert sum(step.breakdown.values()) == pytest.approx(step.step_time_s, rel=1e-12)
    assert step.breakdown.get("pp_comm_s", 0.0) == pytest.approx((pp > 1) * 2 * 4 * c, rel=1e-12)


def _measured(hw, cpu_share, send_recv_cpu=0.0, latency=1e-3):
    """``hw`` with collectives measured over 4 ranks (``latency`` + bus bytes at 1 GB/s; free with 0), each taking
    ``cpu_share`` of its wall time in processor time at the measured core share (0.5: 4 ranks on 2 cores), a
    send/recv ``send_recv_cpu`` s of processor time and twice that of wall time."""
    rate = CollectiveRate(latency, 1e9 if latency else 1e30, 4, cpu_share * latency / 2,
                          1e9 / (cpu_share / 2) if cpu_share else 0.0)
    rates = {kind: rate for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    rates["send_recv"] = CollectiveRate(2 * send_recv_cpu, 1e30, 4, send_recv_cpu, 0.0)
    return dataclasses.replace(hw, collectives={"intra": rates})


def test_collectives_processor_time_takes_a_core_by_hand():
    """A measured collective's processor time: its CPU fit (latency scaled by ring steps as the wall time's), 0
    where none was measured; while every rank computes as in the calibration (TP 4 on 2 cores), taking that time
    from a core at the measured share leaves each collective its measured wall time, so the step equals the one
    priced without the CPU fit; PP 2 x TP 2 with collectives that are all processor time: the cores never idle.
    Each pipeline message's processor time is its sender's and its receiver's work
    (``test_ranks_sharing_cores_by_hand``)."""
    base = dataclasses.replace(FREE, gemm_table=[[1, 1, 1, 1e11]], hbm_bytes_per_s=1e10, cores=2)
    hw = _measured(base, 0.6)
    assert hw.measured_core_share() == 0.5 and base.measured_core_share() == 1.0
    assert hw.collective_cpu_time("all_gather", 2, 2e6, False) == pytest.approx(0.3e-3 / 3 + 2e6 * 0.3 / 1e9)
    assert hw.collective_cpu_time("all_reduce", 4, 2e6, False) == pytest.approx(0.3e-3 + 2e6 * 0.3 / 1e9)
    assert _measured(base, 0.0).collective_cpu_time("all_reduce", 4, 2e6, False) == 0.0
    assert A100.collective_cpu_time("all_reduce", 8, 2e6, False) == 0.0
    model = _model(vocab_size=128, sequence_parallel=True)
    tp4 = Run(model, ParallelLayout(world_size=4, tp=4), "fp32", 1, 4)
    with_cpu, without = plan_step_time(tp4, hw), plan_step_time(tp4, _measured(base, 0.0))
    assert with_cpu.breakdown["tp_comm_s"] > 0.2 * with_cpu.step_time_s
    assert with_cpu.step_time_s == pytest.approx(without.step_time_s, rel=1e-12)
    # Collectives all processor time at the measured share (half their wall time; none left to wait) and free
    # messages, PP 2 x TP 2: a stage waits only while the other computes, so the cores never idle and the step is
    # all ranks' work over the 2 cores, each collective's share half its wall time.
    hw = _measured(base, 1.0)
    run = Run(model, ParallelLayout(world_size=4, tp=2, pp=2), "fp32", 1, 4)
    pricer = _Pricer(run, hw, hw.gpus_per_node)
    work = 0.0
    for stage, phases in enumerate(stage_phases(run, pricer)):
        tail = _after_backward(run, hw, pricer, stage, phases)[0]
        work += 4 * sum(c.total - c.comm / 2 for phase in phases for c in phase) + tail["optimizer_s"] + (
            tail.get("dp_comm_s", 0.0) + tail.get("embedding_comm_s", 0.0)) / 2
    step = plan_step_time(run, hw)
    assert step.breakdown["tp_comm_s"] > 0.05 * step.step_time_s
    assert step.step_time_s == pytest.approx(2 * work / 2, rel=1e-12)
    assert step.step_time_s != pytest.approx(plan_step_time(run, _measured(base, 0.0)).step_time_s, rel=1e-3)


def test_profiles_without_cores_give_every_rank_its_own():
    """A GPU profile, and a ``cpu`` profile written before ``cores``, load with ``cores`` None and price a pipeline
    as ever (no rank shares); as many cores as ranks is the same; ``cores`` must be a count; a profile's cores
    are one node's, so a job over several nodes is refused."""
    assert A100.cores is None and A100.core_share(10 ** 6) == 1.0
    old = FREE.to_json()
    del old["cores"]
    hw = hardware_from_dict(dict(old, device="cpu"))
    assert hw.cores is None
    run = Run(_model(vocab_size=128), ParallelLayout(world_size=4, pp=2), "fp32", 1, 4)
    before = plan_step_time(run, hw)
    assert before == plan_step_time(run, dataclasses.replace(hw, cores=4))
    assert "core_sharing_s" not in before.breakdown
    gpu = A100.to_json()
    del gpu["cores"]
    assert hardware_from_dict(gpu) == A100
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"cores={bad!r} is not a positive number of cores"):
            hardware_from_dict(dict(old, cores=bad))
    with pytest.raises(ValueError, match="cores=2 are shared by the ranks of one node, and 4 ranks over 2 per node"):
        plan_step_time(run, dataclasses.replace(hw, cores=2), gpus_per_node=2)
