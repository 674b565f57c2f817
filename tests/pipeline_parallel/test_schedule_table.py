"""Megatron's schedule table as each rank executes it: complete, deadlock-free, and with the seed's bubble.

``simulate_pipeline`` runs every rank's order against the data dependencies (a chunk's forward needs the
previous virtual stage's output, its backward the next one's input gradient) with backward = 2 x forward;
the reference is the seed's bubble share of a step, (p - 1) / (v m + p - 1), and Megatron's warm-up count.
``simulate_shared_pipeline`` (ranks sharing fewer cores) against timelines worked by hand, and against
``simulate_pipeline`` when every rank keeps its full rate.
"""
import random

import pytest

from ds_megatron.pipeline_parallel.schedule_table import (channel_messages, check_order, get_order,
                                                          interleaved_bubble, rank_operations, receives_of,
                                                          simulate_pipeline, simulate_shared_pipeline,
                                                          zero_bubble_orders)

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


def test_shared_pipeline_two_stages_on_shared_cores_by_hand():
    """1F1B, 2 stages, 2 micro-batches; rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1.  ``rates`` [1, 1, 0.5]: one
    stage computing keeps its rate, both halve it (2 ranks a stage on 2 cores).  F = 1, B = 2 (all work):
    0-1 r0 F0 alone; 1-3 r0 F1 and r1 F0 at half; 3-5 r1 B0 alone (r0 waits for its gradient); 5-7 r1 F1 and r0 B0
    at half (B0 half done); 7-9 r1 B1 and r0 B0 at half (B0 done, B1 of r1 half); 9-10 r1 B1 alone; 10-12 r0 B1.
    With a collective of 1 s after each forward's work (F = (1, 1)): 0-1 r0 F0, 1-2 its collective; 2-4 r0 F1 and
    r1 F0 at half, 4-5 both collectives; 5-7 r1 B0 alone; 7-9 r0 B0 and r1 F1 at half; 9-10 r1 in its collective
    (no core taken), r0 finishes B0 alone; 10-12 r1 B1; 12-14 r0 B1."""
    work = [[((1.0, 0.0), (1.0, 0.0), (1.0, 0.0))] for _ in range(2)]  # B + W = the full backward's 2
    timing = simulate_shared_pipeline(2, 1, 2, work, [1.0, 1.0, 0.5])
    assert timing.finish == (12.0, 10.0) and timing.busy == (9.0, 9.0)
    assert simulate_pipeline(2, 1, 2).step_time == 9.0  # own cores: (m + p - 1)(F + B)
    collective = [[((1.0, 1.0), (1.0, 0.0), (1.0, 0.0))] for _ in range(2)]
    timing = simulate_shared_pipeline(2, 1, 2, collective, [1.0, 1.0, 0.5])
    assert timing.finish == (14.0, 12.0) and timing.busy == (10.0, 10.0)
    # A tail after the last backward (a collective, then the optimizer's work) runs in the same timeline: r1's
    # collective at 10-11 leaves r0's B1 alone (half done), then r1's 1 s of work and the rest of B1 share: 11-13.
    tails = [[(0.0, 0.0)], [(0.0, 1.0), (1.0, 0.0)]]
    timing = simulate_shared_pipeline(2, 1, 2, work, [1.0, 1.0, 0.5], tails=tails)
    assert timing.finish == (13.0, 13.0) and timing.busy == (10.0, 12.0)
    # Each message's processor time (0.5) is work of the operation sending it and of the one receiving it (every
    # operation here has one): F 1.5, B 2.5.  0-1.5 r0 F0; 1.5-4.5 r0 F1 and r1 F0 at half; 4.5-7 r1 B0 alone;
    # 7-10 r0 B0 and r1 F1 at half (B0 1.5 done); 10-12 r0 B0's last 1 and r1 B1 at half (B1 1 done); 12-13.5 r1
    # B1 alone; 13.5-16 r0 B1.
    timing = simulate_shared_pipeline(2, 1, 2, work, [1.0, 1.0, 0.5], message_work=0.5)
    assert timing.finish == (16.0, 13.5) and timing.busy == (12.0, 12.0)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_shared_pipeline_at_full_rate_is_simulate_pipeline(schedule):
    """Every rank at its own rate: each operation's work plus its collectives, as ``simulate_pipeline`` prices
    it, with the same message time."""
    rng = random.Random(1)
    for _ in range(60):
        p = rng.choice([1, 2, 3, 4])
        v = rng.choice([1, 2, 3]) if schedule != "zero_bubble" and p > 1 else 1
        m = p * rng.choice([1, 2]) if v > 1 else rng.choice([1, 2, 5, p])
        work = [[tuple(rng.random() for _ in range(3)) for _ in range(v)] for _ in range(p)]
        comm = [[tuple(0.3 * rng.random() for _ in range(3)) for _ in range(v)] for _ in range(p)]
        message = rng.choice([0.0, 0.1])
        plain = simulate_pipeline(m, v, p, schedule=schedule, message_time=message,
                                  costs=[[tuple(a + c for a, c in zip(*pair)) for pair in zip(*st)]
                                         for st in zip(work, comm)])
        shared = simulate_shared_pipeline(m, v, p, [[tuple(zip(*pair)) for pair in zip(*st)]
                                                    for st in zip(work, comm)], [1.0] * (p + 1),
                                          schedule=schedule, message_time=message)
        assert shared.finish == pytest.approx(plain.finish, rel=1e-12)
        assert shared.busy == pytest.approx(plain.busy, rel=1e-12)
