"""RankGenerator and ParallelLayout against the seed's worked examples and an independent reference.

The reference below does not share code with ``rank_generator.py``: it lays
every rank out with the seed's closed form

    global_rank = sum(coord_i * prod(size_j for j before i))   (over the order)

and groups ranks that agree on every coordinate outside the token, numbering
groups by the seed's group_index rule (the same closed form over the
unmasked dimensions only) and listing ranks inside a group in ascending order.
"""
import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel.rank_generator import (DIMENSIONS, RankGenerator, generate_masked_orthogonal_groups,
                                                 generate_masked_orthogonal_rank_groups)

# --- the seed's two 16-rank examples, transcribed literally -------------------------------

SEED_DENSE = {  # TP4-PP2-DP2, order tp-cp-ep-dp-pp
    "tp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
}
SEED_MOE = {  # ETP1-PP2-EP4-EDP2, order tp-cp-ep-dp-pp (etp plays tp, edp plays dp)
    "ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "edp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
}


def test_seed_dense_example():
    gen = RankGenerator(tp=4, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    for token, expected in SEED_DENSE.items():
        assert gen.get_ranks(token) == expected, token


def test_seed_moe_example():
    gen = RankGenerator(tp=1, ep=4, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("ep") == SEED_MOE["ep"]
    assert gen.get_ranks("dp") == SEED_MOE["edp"]
    assert gen.get_ranks("pp") == SEED_MOE["pp"]


def test_seed_examples_through_layout():
    """Both examples are one 16-rank job: dense TP4-PP2-DP2 folded with expert ETP1-EP4-EDP2-PP2."""
    layout = ParallelLayout(world_size=16, tp=4, pp=2, ep=4, etp=1)
    assert (layout.dp, layout.edp) == (2, 2)
    groups = layout.group_ranks()
    for kind, expected in list(SEED_DENSE.items()) + list(SEED_MOE.items()):
        assert groups[kind] == expected, kind


def test_seed_masked_function_directly():
    # sizes in order tp-cp-ep-dp-pp; mask dp
    sizes = [4, 1, 1, 2, 2]
    assert generate_masked_orthogonal_groups(16, sizes, [False, False, False, True, False]) == SEED_DENSE["dp"]
    assert generate_masked_orthogonal_groups is generate_masked_orthogonal_rank_groups


# --- independent reference ------------------------------------------------------------------

def reference_groups(sizes: dict, order: list, token_dims: set) -> list:
    """Groups of ``token_dims`` from the closed-form global rank (see module docstring)."""
    ordered = [sizes[d] for d in order]
    stride = [math.prod(ordered[:i]) for i in range(len(order))]
    free = [i for i, d in enumerate(order) if d not in token_dims]
    free_stride = [math.prod(ordered[j] for j in free[:k]) for k in range(len(free))]
    groups = {}
    # itertools.product varies the last digit fastest; reverse so the first dimension is fastest.
    for rev in itertools.product(*[range(s) for s in reversed(ordered)]):
        coord = rev[::-1]
        rank = sum(c * s for c, s in zip(coord, stride))
        index = sum(coord[i] * s for i, s in zip(free, free_stride))
        groups.setdefault(index, []).append(rank)
    return [sorted(groups[i]) for i in range(len(groups))]


def all_tokens(order):
    """Every non-empty subset of the dimensions, spelled in a scrambled order (mask order must not matter)."""
    for n in range(1, len(order) + 1):
        for combo in itertools.combinations(order, n):
            yield set(combo), "-".join(reversed(combo))


@st.composite
def layouts(draw):
    sizes = {d: draw(st.integers(1, 4)) for d in DIMENSIONS}
    if sizes["ep"] > 1 and sizes["cp"] > 1:
        sizes[draw(st.sampled_from(["ep", "cp"]))] = 1
    order = draw(st.permutations(list(DIMENSIONS)))
    return sizes, list(order)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_generator_matches_closed_form_reference(case):
    sizes, order = case
    gen = RankGenerator(order="-".join(order), **sizes)
    assert gen.world_size == math.prod(sizes.values())
    for dims, token in all_tokens(order):
        assert gen.get_ranks(token) == reference_groups(sizes, order, dims), token


# --- structural properties ------------------------------------------------------------------

def _components(world_size, group_lists):
    """Connected components of 'shares a group' over several group kinds (union-find)."""
    parent = list(range(world_size))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for groups in group_lists:
        for g in groups:
            for r in g[1:]:
                parent[find(r)] = find(g[0])
    comps = {}
    for r in range(world_size):
        comps.setdefault(find(r), set()).add(r)
    return sorted(comps.values(), key=min)


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_partition_orthogonality_and_closure(case):
    sizes, order = case
    gen = RankGenerator(order="-".join(order), **sizes)
    world = set(range(gen.world_size))
    single = {d: gen.get_ranks(d) for d in DIMENSIONS}
    for dims, token in all_tokens(order):
        groups = gen.get_ranks(token)
        # Partition: disjoint, covering the world, all of the same size.
        flat = [r for g in groups for r in g]
        assert sorted(flat) == sorted(world) and len(flat) == len(world), token
        assert {len(g) for g in groups} == {math.prod(sizes[d] for d in dims)}, token
        # A combined group is a union of each constituent's groups, and exactly the
        # closure of them: the components of "shares a group of one constituent".
        for d in dims:
            for g in groups:
                assert all(set(h) <= set(g) or not set(h) & set(g) for h in single[d]), (token, d)
        assert [set(g) for g in sorted(groups, key=min)] == _components(gen.world_size, [single[d] for d in dims])
    # Orthogonal single dimensions: any two groups meet in at most one rank, and a
    # rank's own two groups meet exactly in that rank.
    for a, b in itertools.combinations(DIMENSIONS, 2):
        own_b = {r: set(g) for g in single[b] for r in g}
        for g in single[a]:
            for r in g:
                assert set(g) & own_b[r] == {r}, (a, b, r)


def test_size_one_dimension_left_out_is_appended():
    short = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="dp-tp")
    assert short.order == "dp-tp-cp-ep-pp"
    full = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="dp-tp-cp-ep-pp")
    for token in ("tp", "dp", "pp", "cp", "ep", "tp-dp"):
        assert short.get_ranks(token) == full.get_ranks(token)
    assert short.get_ranks("tp") == [[0, 2], [1, 3]]  # dp varies fastest now


@pytest.mark.parametrize("kwargs,order,needle", [
    (dict(tp=2, ep=1, dp=2, pp=1, cp=1), "tp", "dp"),                 # size > 1 dimension left out
    (dict(tp=2, ep=1, dp=1, pp=1, cp=1), "tp-xp-dp", "xp"),           # unknown dimension
    (dict(tp=2, ep=1, dp=1, pp=1, cp=1), "tp-dp-tp", "twice"),        # duplicate
    (dict(tp=1, ep=2, dp=1, pp=1, cp=2), "tp-cp-ep-dp-pp", "cp"),     # ep and cp in one generator
    (dict(tp=0, ep=1, dp=1, pp=1, cp=1), "tp-cp-ep-dp-pp", "tp"),     # non-positive size
])
def test_bad_generator_arguments_name_the_culprit(kwargs, order, needle):
    with pytest.raises(ValueError, match=needle):
        RankGenerator(order=order, **kwargs)


def test_ep_and_cp_message_names_both():
    with pytest.raises(ValueError) as info:
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    assert "ep=2" in str(info.value) and "cp=2" in str(info.value)


def test_token_outside_order_is_refused():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp")
    with pytest.raises(ValueError, match="zz"):
        gen.get_ranks("tp-zz")


def test_rank_offset_shifts_every_group():
    base = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    shifted = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp", rank_offset=8)
    for token in ("tp", "dp", "pp", "tp-pp", "dp-pp"):
        assert shifted.get_ranks(token) == [[r + 8 for r in g] for g in base.get_ranks(token)]
    with pytest.raises(ValueError, match="rank_offset"):
        RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp", rank_offset=-1)


# --- ParallelLayout -------------------------------------------------------------------------

def test_moe_folding_cp8_ep8_fits_in_8_ranks():
    """CP8 x EP8 would need 64 ranks unfolded; folded, attention and experts share 8."""
    layout = ParallelLayout(world_size=8, cp=8, ep=8, etp=1)
    groups = layout.group_ranks()
    assert groups["cp"] == [list(range(8))]
    assert groups["ep"] == [list(range(8))]
    assert layout.dp == 1 and layout.edp == 1


def test_layout_group_kinds_partition_the_world():
    layout = ParallelLayout(world_size=16, tp=2, pp=2, cp=2, ep=2, etp=1)
    for kind, groups in layout.group_ranks().items():
        if kind in ("embedding", "position-embedding"):
            # Only the first (and last) pipeline stage holds embeddings.
            assert all(len(g) <= 2 for g in groups)
            continue
        assert sorted(r for g in groups for r in g) == list(range(16)), kind
    # The rank's coordinates are its index in its group of each kind.
    for rank in range(16):
        coords = layout.coordinates(rank)
        for kind, c in coords.items():
            g = next(g for g in layout.group_ranks()[kind] if rank in g)
            assert g[c] == rank


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world_size=16, tp=3), "tp\\*cp\\*pp"),
    (dict(world_size=8, tp=2, ep=8), "etp\\*ep\\*pp"),
    (dict(world_size=8, tp=0), "tp"),
    (dict(world_size=8, tp=2, order="tp-cp-ep-xx"), "xx"),
])
def test_layout_rejects_bad_sizes(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ParallelLayout(**kwargs)


def test_layout_pipeline_check_equals_comparing_the_groups():
    """The layout's O(1) check (pp's stride in both generators) refuses exactly the orders whose dense and expert
    pipeline groups differ when listed rank by rank, over every order of the five dimensions."""
    refused = accepted = 0
    for order in itertools.permutations(DIMENSIONS):
        for tp, cp, ep, etp, pp in [(2, 2, 2, 1, 2), (2, 1, 4, 2, 2), (1, 2, 2, 2, 3), (2, 2, 1, 4, 2)]:
            world, order_s = 2 * math.lcm(tp * cp * pp, etp * ep * pp), "-".join(order)
            dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=order_s)
            expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order_s)
            same = dense.get_ranks("pp") == expert.get_ranks("pp")
            try:
                ParallelLayout(world_size=world, tp=tp, cp=cp, ep=ep, etp=etp, pp=pp, order=order_s)
            except ValueError as e:
                assert not same and "different pipeline groups" in str(e), (order_s, tp, cp, ep, etp, pp)
                refused += 1
            else:
                assert same, (order_s, tp, cp, ep, etp, pp)
                accepted += 1
    assert refused and accepted
