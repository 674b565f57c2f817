"""``clip_grads.grad_norm_and_found_inf``: the optimizer step's one all-reduce per group for the global norm and
the inf/nan check, on 4 gloo ranks (TP=2 x PP=2), against the arithmetic done by hand.

The reference for the norm is the sum, in exact integers, of the squares each rank's groups cover; for the
check it is a MAX of the flags over the same groups in the same order (what separate flag all-reduces gave
before they were fused into the norm's).
"""
import math

import pytest

from harness import run_on_ranks

WORLD = 4
# TP=2 x PP=2, default order tp-cp-ep-dp-pp: tp groups {0,1}, {2,3}; model parallel (tp-pp) all four.
TP_GROUPS = [[0, 1], [2, 3]]
MP_GROUPS = [[0, 1, 2, 3]]


def _square(rank: int, partition: int) -> float:
    return float((rank + 1) * (partition + 2))  # integers: every sum below is exact in float64


def _expected_norm(rank: int) -> float:
    tp = next(g for g in TP_GROUPS if rank in g)
    return math.sqrt(_square(rank, 0) + sum(_square(r, 1) for r in tp) + sum(_square(r, 2) for r in MP_GROUPS[0]))


def _expected_found(flags, nan_partition, order):
    """MAX of the flags over each group of ``order`` in turn (a rank's non-finite square joins its flag where
    that partition is reduced, or at the end when it is its own)."""
    known = {r: flags.get(r, False) for r in range(WORLD)}
    for kind, members in order:
        for group in (TP_GROUPS if kind == "tp" else MP_GROUPS):
            for r in group:
                known[r] = known[r] or any(nan_partition.get(q) in members for q in group)
            any_known = any(known[r] for r in group)
            for r in group:
                known[r] = any_known
    return [known[r] or nan_partition.get(r) == 0 for r in range(WORLD)]


def _run(flag_ranks, nan_partition, order, check=True):
    import torch
    import torch.distributed as dist

    from ds_megatron.optimizer.clip_grads import grad_norm_and_found_inf
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    state = ParallelState.build(ParallelLayout(world_size=WORLD, tp=2, pp=2))
    rank = dist.get_rank()
    try:
        assert sorted(state.tp.ranks) in TP_GROUPS and sorted(state.mp.ranks) in MP_GROUPS
        squares = [torch.tensor(_square(rank, j), dtype=torch.float64) for j in range(3)]
        if nan_partition.get(rank) is not None:
            squares[nan_partition[rank]] = torch.tensor(float("nan"), dtype=torch.float64)
        flag = torch.tensor(float("inf") if rank in flag_ranks else 0.0, dtype=torch.float64)
        groups = {"tp": state.tp, "mp": state.mp}
        return grad_norm_and_found_inf(squares, [(groups[kind], members) for kind, members in order], flag, check)
    finally:
        state.destroy()


ORDER = [("mp", [2]), ("tp", [1])]  # partition 0 is each rank's own


def test_the_norm_is_the_square_root_of_every_group_sum():
    results = run_on_ranks(WORLD, _run, (), {}, ORDER)
    assert [found for found, _ in results] == [False] * WORLD
    assert [norm for _, norm in results] == [_expected_norm(r) for r in range(WORLD)]


@pytest.mark.parametrize("flags, nans, order", [
    ({3}, {}, ORDER),  # a flag enters the first (whole-world) reduction: every rank skips
    ({1}, {}, [("tp", [1, 2])]),  # only its tp group hears of it
    (set(), {2: 1}, ORDER),  # a nan square in a partition summed over tp, after the world's reduction
    (set(), {0: 2}, ORDER),  # ... summed over the world
    (set(), {3: 0}, ORDER),  # ... of the rank's own partition: that rank alone
], ids=["flag-world", "flag-tp-only", "nan-tp-partition", "nan-world-partition", "nan-own-partition"])
def test_inf_and_nan_are_agreed_as_a_max_over_the_same_groups(flags, nans, order):
    results = run_on_ranks(WORLD, _run, flags, nans, order)
    expected = _expected_found({r: True for r in flags}, nans, order)
    assert [found for found, _ in results] == expected
    assert all(math.isnan(norm) for found, norm in results if found)


def test_without_the_check_a_flag_changes_nothing():
    results = run_on_ranks(WORLD, _run, {0, 1, 2, 3}, {}, ORDER, False)
    assert results == [(False, _expected_norm(r)) for r in range(WORLD)]
