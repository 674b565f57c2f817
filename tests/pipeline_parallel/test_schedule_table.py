"""Megatron's schedule table as each rank executes it: complete, deadlock-free, and with the seed's bubble.

``simulate_pipeline`` runs every rank's order against the data dependencies (a chunk's forward needs the
previous virtual stage's output, its backward the next one's input gradient) with backward = 2 x forward;
the reference is the seed's bubble share of a step, (p - 1) / (v m + p - 1), and Megatron's warm-up count.
"""
import pytest

from ds_megatron.pipeline_parallel.schedule_table import (channel_messages, check_order, get_order,
                                                          interleaved_bubble, rank_operations, receives_of,
                                                          simulate_pipeline, zero_bubble_orders)

CASES = [(p, v, m) for p in (2, 3, 4) for v in (1, 2, 4) for m in range(p, 4 * p + 1, p)]


@pytest.mark.parametrize("p,v,m", CASES)
def test_orders_complete_with_the_seeds_bubble(p, v, m):
    timing = simulate_pipeline(m, v, p)
    assert timing.bubble == pytest.approx(interleaved_bubble(m, v, p), abs=1e-12)
    # The ideal step (no bubble) is v * m chunk forwards and backwards per rank.
    assert timing.step_time == pytest.approx(3 * v * m + 3 * (p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 12), (3, 2, 9)])
def test_operations_follow_the_order_and_every_message_is_received_once(p, v, m):
    sent, needed = {}, {}
    for rank in range(p):
        ops = rank_operations(m, v, pipeline_parallel_size=p, pipeline_parallel_rank=rank)
        order = get_order(m, v, pipeline_parallel_size=p, pipeline_parallel_rank=rank)
        assert [(op.chunk + 1) * (1 if op.forward else -1) for op in ops] == order
        check_order(order, v, m)
        per_chunk = {}
        for op in ops:  # per chunk, micro-batches go forward in order and come back in the same order
            per_chunk.setdefault((op.chunk, op.forward), []).append(op.microbatch)
        assert all(mbs == list(range(m)) for mbs in per_chunk.values())
        for dst, messages in channel_messages(ops, rank, p, v).items():
            sent.setdefault((rank, dst), []).extend(messages)
        for op in ops:
            got = receives_of(op, rank, p, v)
            if got is not None:
                needed.setdefault((got[0], rank), []).append(got[1])
    # What each rank needs from a neighbour is exactly what that neighbour sends it (as sets: the receiver
    # posts its receives in the sender's order, and takes them in its own).
    assert {k: sorted(v) for k, v in sent.items()} == {k: sorted(v) for k, v in needed.items()}


def test_warmup_is_megatrons():
    # Rank r of p with v chunks: (p - r - 1) * 2 + (v - 1) * group forwards before the first backward.
    for rank in range(4):
        ops = rank_operations(8, 2, pipeline_parallel_size=4, pipeline_parallel_rank=rank)
        first_backward = next(i for i, op in enumerate(ops) if not op.forward)
        assert first_backward == (4 - rank - 1) * 2 + (2 - 1) * 4 + 1  # + the steady state's first forward
    ops = rank_operations(8, 1, pipeline_parallel_size=4, pipeline_parallel_rank=1)
    assert next(i for i, op in enumerate(ops) if not op.forward) == 4 - 1 - 1 + 1  # plain 1F1B: p - r - 1


def test_forward_only_runs_the_table():
    ops = rank_operations(4, 2, pipeline_parallel_size=2, pipeline_parallel_rank=1, forward_only=True)
    assert all(op.forward for op in ops)
    assert [(op.microbatch, op.chunk) for op in ops] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1),
                                                         (3, 1)]


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4) for m in range(p, 4 * p + 1, p)])
def test_zero_bubble_h1(p, m):
    """ZB-H1 with F = B = W: the paper's bubble, (p - 1) / (3m + p - 1), below 1F1B's; no rank holds more
    micro-batches alive (forwarded, W not yet run) than 1F1B's first rank, p; W's in the order of their B's."""
    orders = zero_bubble_orders(m, p)
    timing = simulate_pipeline(m, 1, p, schedule="zero_bubble")
    assert timing.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert timing.bubble < simulate_pipeline(m, 1, p).bubble
    for rank, ops in enumerate(orders):
        assert [op.microbatch for op in ops if op.forward] == list(range(m))
        assert [op.microbatch for op in ops if op.part == "input"] == list(range(m))
        assert [op.microbatch for op in ops if op.part == "weight"] == list(range(m))
        alive = peak = 0
        done_b = set()
        for op in ops:
            if op.forward:
                alive += 1
                peak = max(peak, alive)
            elif op.part == "input":
                done_b.add(op.microbatch)
            else:
                assert op.microbatch in done_b  # W after its own B
                alive -= 1
        assert peak <= p
        # Forwards and B's keep 1F1B's order (the W's are what moves).
        plain = rank_operations(m, 1, pipeline_parallel_size=p, pipeline_parallel_rank=rank)
        assert [(op.forward, op.microbatch) for op in ops if op.part != "weight"] == \
            [(op.forward, op.microbatch) for op in plain]
