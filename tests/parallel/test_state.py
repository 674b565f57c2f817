import torch
import torch.distributed as dist
import pytest

from harness import run_on_ranks, RankFailure
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState


def _build_and_check(layout_kwargs):
    layout = ParallelLayout(world_size=dist.get_world_size(), **layout_kwargs)
    state = ParallelState.build(layout)
    me = dist.get_rank()
    out = {}
    for kind, g in state.groups.items():
        expected = next(r for r in layout.group_ranks()[kind] if me in r)
        assert list(g.ranks) == expected, (kind, g.ranks, expected)
        # The torch group really contains those ranks: all-gather our global rank over it.
        t = torch.tensor([me])
        got = [torch.zeros(1, dtype=torch.long) for _ in range(g.size)]
        dist.all_gather(got, t, group=g.group)
        assert [int(x) for x in got] == expected, (kind, got, expected)
        out[kind] = g.rank
    state.destroy()
    return out


@pytest.mark.parametrize("world,kw", [
    (4, dict(tp=2)),
    (4, dict(tp=2, ep=4, etp=1)),
    (8, dict(tp=2, pp=2, ep=2)),
    (8, dict(tp=2, cp=2, ep=4, etp=1)),
])
def test_groups_agree_with_generator(world, kw):
    res = run_on_ranks(world, _build_and_check, kw)
    assert len(res) == world


def _boom():
    if dist.get_rank() == 1:
        raise ValueError("rank one fails")
    dist.barrier()


def test_harness_reports_a_failing_rank_instead_of_hanging():
    with pytest.raises(RankFailure, match="rank one fails"):
        run_on_ranks(2, _boom, timeout=60)
