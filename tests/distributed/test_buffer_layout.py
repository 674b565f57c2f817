"""Buffer index maps against the seed's rules, for many random param lists, bucket sizes and DP sizes.

The checks below restate the rules independently of ``build_buffer_layout``:
what every offset must be, given the previous one, and what must hold of the
buckets.  ``ParamAndGradBuffer`` is then built (no process group needed) and
each ``main_grad`` / re-pointed param checked to be a view at its mapped offset.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_megatron.distributed import (DistributedDataParallelConfig, bucket_shard_param_ranges, build_buffer_layout,
                                     default_bucket_size)
from ds_megatron.distributed.param_and_grad_buffer import ParamAndGradBuffer


def _ceil_to(x, m):
    return -(-x // m) * m


def check_layout(numels, dp, bucket_size, use_do, high_busbw, shared):
    """Assert the seed's rules on one layout; independent of the implementation's helpers."""
    lay = build_buffer_layout(numels, dp, bucket_size, use_do, high_busbw, shared)
    n = len(numels)
    divisor = math.lcm(dp, 128, 2 ** 16) if high_busbw else math.lcm(dp, 128)
    own_bucket = [bool(s) and use_do for s in shared]
    if n == 0:
        assert lay.numel == lay.numel_unpadded == 0 and lay.bucket_indices == ()
        return lay

    # Buckets tile [0, numel) in order, without gaps or overlap, and none is empty.
    assert lay.bucket_indices[0][0] == 0 and lay.bucket_indices[-1][1] == lay.numel
    for (s0, e0), (s1, _) in zip(lay.bucket_indices, lay.bucket_indices[1:]):
        assert e0 == s1
    assert all(s < e for s, e in lay.bucket_indices)
    assert sorted(i for b in lay.bucket_params for i in b) == list(range(n))

    # Reverse model order: buckets and the params inside them follow params[::-1].
    assert [i for b in lay.bucket_params for i in b] == list(reversed(range(n)))

    unpadded = 0
    for b, ((b_start, b_end), members) in enumerate(zip(lay.bucket_indices, lay.bucket_params)):
        expected_start = b_start
        for k, i in enumerate(members):
            start, end, bid = lay.param_index_map[i]
            assert bid == b and end - start == numels[i]
            # Each param starts right after the previous one (64-aligned with the distributed optimizer).
            assert start == (_ceil_to(expected_start, 64) if use_do else expected_start), (i, start, expected_start)
            assert b_start <= start and end <= b_end  # never split across buckets
            expected_start = end
            is_last = k == len(members) - 1
            # A bucket closes as soon as it holds >= bucket_size elements (or for a shared embedding).
            if not is_last:
                assert bucket_size is None or end - b_start < bucket_size
                assert not own_bucket[i]
        last_end = expected_start
        closed_for_next = (use_do and b < lay.num_buckets - 1 and own_bucket[lay.bucket_params[b + 1][0]]
                           and not own_bucket[members[-1]]
                           and not (bucket_size is not None and last_end - b_start >= bucket_size))
        # A bucket closed for a shared embedding ends at that param's 64-aligned start (megatron-core 0.16).
        counted_end = _ceil_to(last_end, 64) if closed_for_next else last_end
        unpadded += counted_end - b_start
        assert lay.per_bucket_numel_unpadded[b] == counted_end - b_start
        if use_do:
            assert b_end == _ceil_to(last_end, divisor) and b_start % divisor == 0
        else:
            assert b_end == last_end
        if b < lay.num_buckets - 1:
            nxt = lay.bucket_params[b + 1][0]
            reached = bucket_size is not None and last_end - b_start >= bucket_size
            assert reached or own_bucket[members[-1]] or own_bucket[nxt]
    for i in range(n):
        if own_bucket[i]:
            assert lay.bucket_params[lay.param_index_map[i][2]] == (i,)
    assert lay.numel_unpadded == unpadded
    if use_do:
        assert lay.numel % dp == 0
    else:
        assert lay.numel == lay.numel_unpadded == sum(numels)
    return lay


layouts = st.tuples(
    st.lists(st.integers(1, 5000), min_size=0, max_size=25),
    st.integers(1, 24),
    st.one_of(st.none(), st.integers(1, 20000)),
    st.booleans(), st.booleans(), st.integers(0, 2 ** 30))


@settings(max_examples=400, deadline=None)
@given(layouts)
def test_index_maps_follow_the_seed_rules(case):
    numels, dp, bucket_size, use_do, high_busbw, seed = case
    shared = [(seed >> (i % 30)) & 7 == 0 for i in range(len(numels))]  # a few shared-embedding flags
    check_layout(numels, dp, bucket_size, use_do, high_busbw, shared)


@settings(max_examples=200, deadline=None)
@given(layouts)
def test_dp_shards_cover_each_bucket_param_exactly_once(case):
    numels, dp, bucket_size, _, high_busbw, _ = case
    lay = build_buffer_layout(numels, dp, bucket_size, True, high_busbw)
    for b, (b_start, b_end) in enumerate(lay.bucket_indices):
        shards = lay.bucket_shard_ranges(b)
        assert [s.size for s in shards] == [(b_end - b_start) // dp] * dp
        covered = {i: [] for i in lay.bucket_params[b]}
        for r in range(dp):
            for i, rng in bucket_shard_param_ranges(lay, b, r).items():
                p_start = lay.param_index_map[i][0]
                assert rng.gbuf_world.start == p_start + rng.param.start
                assert rng.gbuf_world_in_bucket.start == rng.gbuf_world.start - b_start
                assert rng.gbuf_local.start == rng.gbuf_world.start - shards[r].start
                assert 0 <= rng.gbuf_local.start < rng.gbuf_local.end <= shards[r].size
                assert rng.gbuf_world.size == rng.gbuf_local.size == rng.param.size == rng.gbuf_world_in_bucket.size
                covered[i].append((rng.param.start, rng.param.end))
        for i, pieces in covered.items():
            pieces.sort()
            assert pieces[0][0] == 0 and pieces[-1][1] == numels[i]
            assert all(a[1] == b_[0] for a, b_ in zip(pieces, pieces[1:]))


def test_worked_example_with_the_distributed_optimizer():
    # Reverse order: 1000 (param 2) at 0, 100 (param 1) at pad64(1000)=1024, bucket closes at 1124 >= 1100
    # and pads to lcm(4, 128)=128 -> 1152; param 0 alone from 1152, bucket end pad(1152+10) = 1280.
    lay = build_buffer_layout([10, 100, 1000], 4, 1100, True)
    assert lay.param_index_map == ((1152, 1162, 1), (1024, 1124, 0), (0, 1000, 0))
    assert lay.bucket_indices == ((0, 1152), (1152, 1280))
    assert lay.per_bucket_numel_unpadded == (1124, 10) and lay.numel == 1280 and lay.numel_unpadded == 1134
    plain = build_buffer_layout([10, 100, 1000], 4, None, False)
    assert plain.param_index_map == ((1100, 1110, 0), (1000, 1100, 0), (0, 1000, 0)) and plain.numel == 1110


def test_shared_embedding_gets_its_own_bucket_without_overlap():
    # The previous bucket is closed at the shared param's 64-aligned start (320) and padded to 384;
    # the shared param must start at 384, not 320, or the buckets would overlap.
    lay = check_layout([70, 130, 64, 5], 2, None, True, False, [True, False, False, False])
    assert lay.bucket_params[-1] == (0,) and lay.num_buckets == 2
    assert lay.param_index_map[0] == (384, 454, 1) and lay.bucket_indices == ((0, 384), (384, 512))


def _megatron_core_layout(numels, dp, bucket_size, shared, high_busbw):
    """megatron-core 0.16's own _ParamAndGradBuffer on CPU: its index maps, from its own code."""
    import types
    from unittest import mock
    pytest.importorskip("megatron.core")
    from megatron.core.distributed import DistributedDataParallelConfig as McoreDDPConfig
    from megatron.core.distributed import param_and_grad_buffer as mcore
    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    for p, s in zip(params, shared):
        if s:
            p.shared_embedding = True
    group = types.SimpleNamespace(size=lambda: dp, rank=lambda: 0)
    cfg = McoreDDPConfig(use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=high_busbw)
    # It allocates on torch.cuda.current_device() and logs through torch.distributed: neither is the layout.
    with mock.patch("torch.cuda.current_device", return_value="cpu"), \
            mock.patch.object(mcore, "log_on_each_pipeline_stage"):
        buf = mcore._ParamAndGradBuffer(cfg, torch.float32, torch.float32, params, group, bucket_size,
                                        {p: str(i) for i, p in enumerate(params)}, 1.0, list(range(len(params))),
                                        False, types.SimpleNamespace(tp=group, dp_cp=group))
    return (buf.numel, buf.numel_unpadded, tuple(b.numel_unpadded for b in buf.buckets), tuple(buf.bucket_indices),
            tuple(buf.param_index_map[p] for p in params))


def _ours(numels, dp, bucket_size, shared, high_busbw):
    lay = build_buffer_layout(numels, dp, bucket_size, True, high_busbw, shared)
    return lay.numel, lay.numel_unpadded, lay.per_bucket_numel_unpadded, lay.bucket_indices, lay.param_index_map


def test_shared_embedding_after_an_unaligned_param_matches_megatron_core():
    # Reverse order: 5 at 0, 64 at 64, 130 at 128 (ends at 258, not a multiple of 64), then the shared
    # embedding: megatron-core closes the bucket at pad64(258) = 320, so its unpadded size is 320, not 258.
    ours = _ours([70, 130, 64, 5], 2, None, [True, False, False, False], False)
    assert ours[:4] == (512, 390, (320, 70), ((0, 384), (384, 512)))
    assert ours == _megatron_core_layout([70, 130, 64, 5], 2, None, [True, False, False, False], False)


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_distributed_optimizer_layouts_equal_megatron_core(case):
    numels, dp, bucket_size, _, high_busbw, seed = case
    if not numels:
        return
    shared = [(seed >> (i % 30)) & 3 == 0 for i in range(len(numels))]
    assert _ours(numels, dp, bucket_size, shared, high_busbw) == \
        _megatron_core_layout(numels, dp, bucket_size, shared, high_busbw)


def test_default_bucket_size():
    assert default_bucket_size(8) == 40_000_000 and default_bucket_size(64) == 64_000_000


shapes = st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(shapes, st.integers(1, 8), st.one_of(st.none(), st.integers(1, 300)), st.booleans(),
       st.sampled_from([(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]))
def test_main_grad_and_param_are_views_at_their_mapped_offsets(shape_list, dp, bucket_size, use_do, dtypes):
    param_dtype, fp32_grads = dtypes
    grad_dtype = torch.float32 if fp32_grads else param_dtype
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=use_do, grad_reduce_in_fp32=fp32_grads)
    g = torch.Generator().manual_seed(len(shape_list))
    params = [torch.nn.Parameter(torch.randn(*s, generator=g).to(param_dtype)) for s in shape_list]
    before = [p.detach().clone() for p in params]
    buf = ParamAndGradBuffer(cfg, param_dtype, grad_dtype, params, _layout_only_group(dp), bucket_size, 1.0)
    lay = check_layout([p.numel() for p in params], dp, bucket_size, use_do, False, [False] * len(params))
    assert buf.bucket_indices == list(lay.bucket_indices) and buf.numel == lay.numel
    assert buf.grad_data.dtype == grad_dtype and buf.grad_data.numel() == buf.numel
    for p, old in zip(params, before):
        start, end, bid = buf.param_index_map[p]
        assert p.main_grad.shape == p.shape and p.main_grad.dtype == grad_dtype
        assert p.main_grad.data_ptr() == buf.grad_data.data_ptr() + start * buf.grad_data.element_size()
        p.main_grad.fill_(1.0)
        assert torch.all(buf.grad_data[start:end] == 1.0)
        assert buf.param_to_bucket[p] is buf.buckets[bid]
        if use_do:
            assert p.data_ptr() == buf.param_data.data_ptr() + start * buf.param_data.element_size()
            assert torch.equal(p.detach(), old)  # values preserved by re-pointing
        else:
            assert buf.param_data is None
    assert int((buf.grad_data != 0).sum()) == sum(p.numel() for p in params)  # padding untouched
    buf.reset()
    assert not buf.grad_data.any()
    for b in buf.buckets:
        assert b.grad_data.data_ptr() == buf.grad_data.data_ptr() + b.offset * buf.grad_data.element_size()
        if use_do:
            assert b.grad_data.numel() % dp == 0


def _layout_only_group(dp):
    """A DP group of ``dp`` ranks for laying a buffer out on one process (no process group: nothing is reduced)."""
    from ds_megatron.parallel_state import ParallelGroup
    return ParallelGroup("dp-cp", tuple(range(dp)), 0, None)


def test_buffer_refuses_mixed_dtypes():
    cfg = DistributedDataParallelConfig()
    with pytest.raises(ValueError, match="dtype"):
        ParamAndGradBuffer(cfg, torch.float32, torch.float32,
                           [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2).bfloat16())],
                           _layout_only_group(1), None, 1.0)
