"""When the pipeline runtime lets go of a send (``schedule_table.send_releases``), against a simulation of the orders.

The reference runs every rank's order with the ranks interleaved at random (any interleaving the data dependencies
allow): a rank takes a message when an operation needs it, and each message a rank sends carries the set of the
receiver's messages the sender had taken by then.  A send may be released exactly when its sender receives a message
whose set holds it (it was taken: waiting on it cannot block), and must be at the first such receive (later holds its
tensor for nothing).  Whatever the interleaving, the sets are the same (they follow each rank's own order).  Then the
count of sends held at once: at most 2 v pp, the same at 4 x pp and 8 x pp micro-batches; and a chunk's sent output
let go by its backward (the memory plan counts it with the chunk's activations, no longer).
"""
import random

import pytest

from ds_megatron.pipeline_parallel.schedule_table import rank_operations, receives_of, send_releases, sends_of

CASES = [(schedule, v, p, m) for p in (2, 3, 4) for m in (p, 3 * p)
         for schedule, v in (("interleaved_1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
                             ("zero_bubble", 1))]


def _simulated_releases(schedule, v, p, m, seed):
    """Per rank, per operation, the sends (destination, message) that the receive of that operation proves taken and
    that no earlier receive did: a random interleaving of all ranks' orders."""
    orders = [rank_operations(m, v, pipeline_parallel_size=p, pipeline_parallel_rank=r, schedule=schedule)
              for r in range(p)]
    position = [0] * p
    taken = [set() for _ in range(p)]  # per rank: the (source, message) pairs it has received
    arrived = {}  # message -> the messages its sender had taken from its destination when it sent it
    held = [set() for _ in range(p)]  # per rank: its (destination, message) sends not yet proven taken
    out = [[set() for _ in order] for order in orders]
    rng = random.Random(seed)

    def _has_input(op, rank):
        got = receives_of(op, rank, p, v)
        return got is None or got[1] in arrived

    while any(position[r] < len(orders[r]) for r in range(p)):
        ready = [r for r in range(p) if position[r] < len(orders[r]) and _has_input(orders[r][position[r]], r)]
        assert ready, "the orders deadlock"
        r = rng.choice(ready)
        i, op = position[r], orders[r][position[r]]
        got = receives_of(op, r, p, v)
        if got is not None:  # an operation takes its input, then computes, then sends
            src, message = got
            taken[r].add((src, message))
            out[r][i] = {(dst, sent) for dst, sent in held[r] if dst == src and sent in arrived[message]}
            held[r] -= out[r][i]
        sent = sends_of(op, r, p, v)
        if sent is not None:
            dst, message = sent
            arrived[message] = {m for src, m in taken[r] if src == dst}
            held[r].add((dst, message))
        position[r] += 1
    return out


@pytest.mark.parametrize("schedule,v,p,m", CASES)
def test_each_send_is_released_at_the_first_receive_that_proves_it_taken(schedule, v, p, m):
    for seed in range(2):
        simulated = _simulated_releases(schedule, v, p, m, seed)
        for rank in range(p):
            releases = send_releases(m, v, p, rank, None, schedule)
            assert [set(entry) for entry in releases] == simulated[rank], (rank, seed)


@pytest.mark.parametrize("schedule,v", [("interleaved_1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
                                        ("zero_bubble", 1)])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_sends_held_at_once_do_not_grow_with_the_micro_batches(schedule, v, p):
    def peak(m):
        most = 0
        for rank in range(p):
            ops = rank_operations(m, v, pipeline_parallel_size=p, pipeline_parallel_rank=rank, schedule=schedule)
            held = 0
            for op, released in zip(ops, send_releases(m, v, p, rank, None, schedule)):
                held += (sends_of(op, rank, p, v) is not None) - len(released)
                most = max(most, held)
        return most
    assert peak(8 * p) == peak(4 * p) <= 2 * v * p


@pytest.mark.parametrize("schedule,v,p,m", CASES)
def test_a_sent_output_is_released_by_its_backward(schedule, v, p, m):
    """The memory plan counts a chunk's sent output with the chunk's activations, alive to its backward: so the send
    must be let go by then (at the latest at the receive of the gradient its backward takes: its receiver sent that
    gradient after taking the output)."""
    for rank in range(p):
        ops = rank_operations(m, v, pipeline_parallel_size=p, pipeline_parallel_rank=rank, schedule=schedule)
        released_at = {message: i for i, entry in enumerate(send_releases(m, v, p, rank, None, schedule))
                       for _, message in entry}
        for i, op in enumerate(ops):
            sent = sends_of(op, rank, p, v) if op.forward else None
            if sent is not None:
                backward = next(j for j, later in enumerate(ops) if not later.forward and later.part != "weight"
                                and (later.chunk, later.microbatch) == (op.chunk, op.microbatch))
                assert released_at[sent[1]] <= backward, (rank, op)
