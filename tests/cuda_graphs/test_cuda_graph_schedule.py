"""Schedule orders against the seed's worked example (8 micro-batches, PP=4, VPP=2) and structural properties."""
import pytest
from hypothesis import given, settings, strategies as st

from ds_megatron.cuda_graphs.schedule import (check_order, convert_schedule_table_to_order, get_num_warmup_microbatches,
                                              get_order, get_pp_rank_microbatches, get_schedule_table,
                                              plan_cuda_graphs, simulate_buffer_reuse)


def test_seed_schedule_table():
    assert get_schedule_table(8, 2, 4) == [
        (0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1),
        (4, 0), (5, 0), (6, 0), (7, 0), (4, 1), (5, 1), (6, 1), (7, 1)]


def test_seed_order_for_pp_rank_0():
    warmup = get_num_warmup_microbatches(8, 2, 4, pipeline_parallel_size=4, pipeline_parallel_rank=0)
    assert warmup == 10  # (4 - 0 - 1) * 2 + (2 - 1) * 4
    order = convert_schedule_table_to_order(warmup, 2, get_schedule_table(8, 2, 4))
    assert order == ([1, 1, 1, 1, 2, 2, 2, 2, 1, 1]                      # warm-up: forward_order[:10]
                     + [1, -2, 1, -2, 2, -2, 2, -2, 2, -1, 2, -1]        # 1F1B, i = 10..15
                     + [-1, -1, -2, -2, -2, -2, -1, -1, -1, -1])         # cool-down: backward_order[-10:]
    assert get_order(8, 2, pipeline_parallel_size=4, pipeline_parallel_rank=0) == order


def test_megatron_docstring_example_pp2_m5_vp2():
    # convert_schedule_table_to_order's own example: PP2, N=3, M=5, VP2, 5 warm-up micro-batches.
    table = get_schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert convert_schedule_table_to_order(5, 2, table) == [1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1,
                                                            -2, -2, -1, -1]


def test_no_pipeline_is_one_forward_then_its_backward():
    assert get_order(4, 1, pipeline_parallel_size=1, pipeline_parallel_rank=0) == [1, -1] * 4
    assert get_order(4, 1, pipeline_parallel_size=4, pipeline_parallel_rank=0) == [1, 1, 1, 1, -1, -1, -1, -1]
    assert get_pp_rank_microbatches(8, 1, None, pipeline_parallel_size=4, pipeline_parallel_rank=1)[2] == 2


def test_warmup_is_capped_at_the_total():
    total, all_in_warmup, warmup, remaining = get_pp_rank_microbatches(
        2, 2, 2, pipeline_parallel_size=4, pipeline_parallel_rank=0)
    assert (total, all_in_warmup, warmup, remaining) == (4, True, 4, 0)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="pipeline_parallel_rank=4"):
        get_num_warmup_microbatches(8, 2, 4, pipeline_parallel_size=4, pipeline_parallel_rank=4)
    with pytest.raises(ValueError, match="num_model_chunks=2 needs pipeline_parallel_size"):
        get_num_warmup_microbatches(8, 2, 4, pipeline_parallel_size=1, pipeline_parallel_rank=0)
    with pytest.raises(ValueError, match="backward #1 of chunk 0"):
        check_order([-1, 1], 1, 1)


@st.composite
def schedules(draw):
    pp = draw(st.integers(2, 6))
    chunks = draw(st.integers(1, 3))
    group = draw(st.integers(pp, 2 * pp)) if chunks > 1 else pp
    m = draw(st.integers(group if chunks > 1 else 1, 4 * pp))
    if chunks > 1 and 0 < m % group < pp:  # Megatron refuses such a last group (dependency bubbles)
        m += pp - m % group
    return pp, draw(st.integers(0, pp - 1)), chunks, group, m


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_every_forward_precedes_its_backward_and_warmup_matches_the_seed(s):
    pp, rank, chunks, group, m = s
    warmup = get_num_warmup_microbatches(m, chunks, group, pipeline_parallel_size=pp, pipeline_parallel_rank=rank)
    expected = (pp - rank - 1) * 2 + (chunks - 1) * group if chunks > 1 else pp - rank - 1
    assert warmup == min(expected, m * chunks)
    order = get_order(m, chunks, pipeline_parallel_size=pp, pipeline_parallel_rank=rank,
                      microbatch_group_size_per_vp_stage=group)
    check_order(order, chunks, m)
    assert order[:warmup] == [c for c in order[:warmup] if c > 0]  # warm-up is forwards only
    # Within one rank, micro-batch k's chunk c forward needs chunk c-1's (earlier layers), and its chunk c
    # backward needs chunk c+1's backward first (gradients flow back from later layers).
    fwd_seen, bwd_seen = [0] * chunks, [0] * chunks
    for c in order:
        k = abs(c) - 1
        if c > 0:
            assert k == 0 or fwd_seen[k - 1] > fwd_seen[k]
            fwd_seen[k] += 1
        else:
            assert k == chunks - 1 or bwd_seen[k + 1] > bwd_seen[k]
            bwd_seen[k] += 1


@settings(max_examples=60, deadline=None)
@given(schedules(), st.integers(1, 3))
def test_static_buffers_grow_with_pp_not_microbatches(s, layers_per_chunk):
    pp, rank, chunks, group, m = s
    plan = plan_cuda_graphs([layers_per_chunk] * chunks, m, pipeline_parallel_size=pp, pipeline_parallel_rank=rank,
                            microbatch_group_size_per_vp_stage=group)
    warmup = get_num_warmup_microbatches(m, chunks, group, pipeline_parallel_size=pp, pipeline_parallel_rank=rank)
    # In flight at most: the warm-up forwards plus the one forward of a 1F1B pair.
    assert plan.peak_in_flight == min(warmup + 1, m * chunks)
    assert plan.num_static_input_buffers == layers_per_chunk * plan.peak_in_flight
    assert plan.num_graphs == 2 * layers_per_chunk * chunks * m
    # Doubling the micro-batches leaves the buffers alone once the pipeline is full.
    if m * chunks > warmup:
        bigger = plan_cuda_graphs([layers_per_chunk] * chunks, 2 * m, pipeline_parallel_size=pp,
                                  pipeline_parallel_rank=rank, microbatch_group_size_per_vp_stage=group)
        assert bigger.num_static_input_buffers == plan.num_static_input_buffers
        assert bigger.num_graphs == 2 * plan.num_graphs


def test_seed_memory_table():
    # Without PP: 2 x layers graphs and one buffer per layer, whatever the micro-batch count.
    plan = plan_cuda_graphs([6], 16)
    assert (plan.order, plan.num_graphs, plan.num_static_input_buffers, plan.graphs_per_layer) == (None, 12, 6, 1)
    # With PP (the seed's example, 4 layers per chunk): 2 x layers x micro-batches graphs; buffers by rank
    # follow the activation peak (PP - rank - 1) * 2 + (VPP - 1) * PP + 1.
    for rank, peak in enumerate([11, 9, 7, 5]):
        plan = plan_cuda_graphs([4, 4], 8, pipeline_parallel_size=4, pipeline_parallel_rank=rank)
        assert plan.num_graphs == 2 * 8 * 8 and plan.graphs_per_layer == 8
        assert plan.peak_in_flight == peak and plan.num_static_input_buffers == 4 * peak


def test_buffer_reuse_keys_by_input_shape():
    order = get_order(4, 1, pipeline_parallel_size=2, pipeline_parallel_rank=0)
    buffers, peak = simulate_buffer_reuse(order, [2], 4, sample_keys=["small", "big"])
    assert peak == 2
    # A layer only takes over buffers of layers with the same input key.
    for idx, buf in enumerate(buffers):
        assert buffers.index(buf) % 2 == idx % 2
