"""Context-parallel attention (zigzag layout; ring, all-gather and all-to-all) against dense one-rank attention, in
float64."""
import math

import pytest
import torch

from ds_megatron.errors import ConfigError
from ds_megatron.transformer.context_parallel import (check_context_parallel_seq_length, context_parallel_attention,
                                                      zigzag_chunk_indices, zigzag_split, zigzag_unsplit)
from harness import run_on_ranks

B, S, D, HEADS = 2, 32, 8, 4
TOL = 1e-10


def _inputs(kv_heads, seed=1234, v_dim=D):
    """``v_dim`` below ``D``: values narrower than keys, as multi-latent attention's."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HEADS, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, kv_heads, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, kv_heads, S, v_dim, generator=g, dtype=torch.float64)
    dout = torch.randn(B, HEADS, S, v_dim, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _dense(q, k, v, dout, causal):
    """softmax(QK^T / sqrt(d) + mask) V on one rank, K/V heads repeated for GQA; output and input grads."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.size(1) // k.size(1)
    ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ ke.transpose(-1, -2) / math.sqrt(q.size(-1))
    if causal:
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ ve
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _cp_rank(cases, v_dim=D):
    """``cases``: [(kv_heads, comm_type, causal, dtype)] run in turn in this job; one (out, dq, dk, dv) per case."""
    import torch.distributed as dist
    from ds_megatron.parallel import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    cp = dist.get_world_size()
    state = ParallelState.build(ParallelLayout(world_size=cp, cp=cp))
    try:
        results = []
        for kv_heads, name, causal, dtype in cases:
            hierarchical = None
            if name.startswith("a2a+p2p"):  # "a2a+p2p:INNER"
                name, inner = name.split(":")
                state.build_hierarchical_context_parallel(int(inner))
                hierarchical = state.hierarchical_context_parallel
            group = state.cp
            q, k, v, dout = (zigzag_split(t, cp, group.rank, seq_dim=2).to(dtype)
                             for t in _inputs(kv_heads, v_dim=v_dim))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = context_parallel_attention(q, k, v, group, comm_type=name, causal=causal,
                                             hierarchical=hierarchical)
            out.backward(dout)
            assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype
            results.append((out.detach(), q.grad, k.grad, v.grad))
        return results
    finally:
        state.destroy()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# a2a with kv_heads 2 at cp = 4 (and 1 at cp = 2, 4): fewer KV heads than cp, expanded before the all-to-all.
CASES = [(cp, comm, kvh) for cp in (2, 4) for comm in ("p2p", "all_gather", "a2a") for kvh in (4, 2, 1)]
# Hierarchical: a2a inside groups of 2 (or 1, 4) consecutive CP ranks, the position-masked ring across them.
CASES += [(4, "a2a+p2p:2", kvh) for kvh in (4, 2, 1)] + [(4, "a2a+p2p:1", 2), (4, "a2a+p2p:4", 2),
                                                         (2, "a2a+p2p:2", 1)]


NOT_CAUSAL = ["p2p", "all_gather", "a2a", "a2a+p2p:2"]  # at cp = 2, kv_heads 2
BF16 = ["p2p", "all_gather", "a2a", "a2a+p2p:2"]  # at cp = 4, kv_heads 2
# (cp, kv_heads, comm_type, causal, dtype) of the tests below that compare a job's result with dense attention
JOBS = ([(cp, kvh, comm, True, torch.float64) for cp, comm, kvh in CASES]
        + [(2, 2, comm, False, torch.float64) for comm in NOT_CAUSAL]
        + [(4, 2, comm, True, torch.bfloat16) for comm in BF16])


@pytest.fixture(scope="module")
def attention():
    """``attention(cp, kv_heads, comm_type, causal, dtype)``: each rank's (out, dq, dk, dv).  The ``JOBS`` of one CP
    size run in one job, the first time one of them is asked for (a job per case spent most of its time starting
    and collecting the workers' garbage)."""
    done = {}

    def get(cp, *case):
        if cp not in done:
            cases = [job[1:] for job in JOBS if job[0] == cp]
            per_rank = run_on_ranks(cp, _cp_rank, cases, timeout=300)
            done[cp] = {c: [r[i] for r in per_rank] for i, c in enumerate(cases)}
        return done[cp][case]
    return get


@pytest.mark.parametrize("cp,comm_type,kv_heads", CASES)
def test_matches_dense_attention(attention, cp, comm_type, kv_heads):
    expected = _dense(*_inputs(kv_heads), causal=True)
    per_rank = attention(cp, kv_heads, comm_type, True, torch.float64)
    for name, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        got = zigzag_unsplit([r[i] for r in per_rank], seq_dim=2)
        err = _rel(got, expected[i])
        print(f"cp={cp} {comm_type} kv_heads={kv_heads} {name}: max relative error {err:.2e}")
        assert err < TOL, (name, err)


def test_values_narrower_than_keys_as_multi_latent_attention():
    # MLA: k is qk_head_dim + qk_pos_emb_head_dim wide, v only v_head_dim; K and V travel side by side.
    expected = _dense(*_inputs(4, v_dim=D - 3), causal=True)
    names = ["p2p", "all_gather", "a2a", "a2a+p2p:2"]
    per_rank = run_on_ranks(4, _cp_rank, [(4, name, True, torch.float64) for name in names], D - 3, timeout=120)
    for j, name in enumerate(names):
        for grad, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
            got = zigzag_unsplit([r[j][i] for r in per_rank], seq_dim=2)
            assert got.shape == expected[i].shape, (name, grad)
            assert _rel(got, expected[i]) < TOL, (name, grad, _rel(got, expected[i]))


@pytest.mark.parametrize("comm_type", NOT_CAUSAL)
def test_not_causal(attention, comm_type):
    expected = _dense(*_inputs(2), causal=False)
    per_rank = attention(2, 2, comm_type, False, torch.float64)
    for i in range(4):
        assert _rel(zigzag_unsplit([r[i] for r in per_rank], seq_dim=2), expected[i]) < TOL


@pytest.mark.parametrize("comm_type", BF16)
def test_bfloat16_inputs_match_dense_attention_to_bfloat16_rounding(attention, comm_type):
    # K/V travel in bf16, blocks are computed and dK/dV accumulated in float32: the result is the exact
    # attention of the bf16 inputs up to bf16's rounding of the outputs (2^-8 relative).
    inputs = [t.to(torch.bfloat16).to(torch.float64) for t in _inputs(2)]
    expected = _dense(*inputs, causal=True)
    per_rank = attention(4, 2, comm_type, True, torch.bfloat16)
    for name, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        got = zigzag_unsplit([r[i].double() for r in per_rank], seq_dim=2)
        assert _rel(got, expected[i]) < 2 ** -7, (name, _rel(got, expected[i]))


WINDOW, CAP, SCALE = 5, 1.5, 0.3  # a window over zigzag chunks of 8 tokens; a cap the scores (a few units) bend at


def _gemma_dense(q, k, v, dout):
    """Gemma 2's core on one rank: ``softmax(mask(CAP tanh(q k^T SCALE / CAP))) v``, key j seen from query i iff
    ``i - WINDOW <= j <= i``; output and input grads by autograd."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.size(1) // k.size(1)
    ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.tanh(q @ ke.transpose(-1, -2) * SCALE / CAP) * CAP
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    out = torch.softmax(scores.masked_fill((j > i) | (j < i - WINDOW), float("-inf")), dim=-1) @ ve
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _cp_rank_cores(names, window=None, softcap=None, sinks=False):
    """Each comm type's CP core on this rank's zigzag chunks: (out, dq, dk, dv[, the sinks' grad]) per name."""
    import torch.distributed as dist
    from ds_megatron.parallel import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    cp = dist.get_world_size()
    state = ParallelState.build(ParallelLayout(world_size=cp, cp=cp))
    try:
        results = []
        for name in names:
            hierarchical = None
            if name.startswith("a2a+p2p"):
                name, inner = name.split(":")
                state.build_hierarchical_context_parallel(int(inner))
                hierarchical = state.hierarchical_context_parallel
            q, k, v, dout = (zigzag_split(t, cp, state.cp.rank, seq_dim=2) for t in _inputs(2))
            leaves = [t.clone().requires_grad_() for t in (q, k, v) + ((SINKS,) if sinks else ())]
            out = context_parallel_attention(*leaves[:3], state.cp, comm_type=name, softmax_scale=SCALE,
                                             hierarchical=hierarchical, window=window, softcap=softcap,
                                             sinks=leaves[3] if sinks else None)
            out.backward(dout)
            results.append((out.detach(), *(t.grad for t in leaves)))
        return results
    finally:
        state.destroy()


def test_sliding_window_and_soft_cap_match_dense_attention():
    """Gemma's cores under CP: every comm type masks its blocks by the window and soft-caps the scores before the
    log-sum-exp merge, forward and backward (the cap's derivative in the flash-style backward)."""
    names = ["p2p", "all_gather", "a2a", "a2a+p2p:2"]
    expected = _gemma_dense(*_inputs(2))
    per_rank = run_on_ranks(2, _cp_rank_cores, names, WINDOW, CAP, timeout=120)
    for j, name in enumerate(names):
        for grad, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
            got = zigzag_unsplit([r[j][i] for r in per_rank], seq_dim=2)
            assert _rel(got, expected[i]) < TOL, (name, grad, _rel(got, expected[i]))


SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)  # a logit per head, of the scores' size


def _sinks_dense(q, k, v, dout, window):
    """gpt-oss's core on one rank, written here: the softmax over ``[masked q k^T SCALE, the head's sink]`` less
    the sink's column, times v; output and the grads of q, k, v and the sinks by autograd."""
    q, k, v, sinks = (t.clone().requires_grad_() for t in (q, k, v, SINKS))
    rep = q.size(1) // k.size(1)
    ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    hidden = (j > i) | (j < i - window) if window is not None else j > i
    scores = (q @ ke.transpose(-1, -2) * SCALE).masked_fill(hidden, float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(B, -1, S, 1)
    out = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1] @ ve
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad, sinks.grad


@pytest.mark.parametrize("window", [None, WINDOW])
def test_attention_sinks_match_dense_attention(window):
    """gpt-oss's sinks under CP: every comm type enters the sink once into each query row's merged log-sum-exp,
    forward and backward; the sinks' gradient, summed over the CP ranks, is the dense one."""
    names = ["p2p", "all_gather", "a2a", "a2a+p2p:2"]
    expected = _sinks_dense(*_inputs(2), window)
    per_rank = run_on_ranks(2, _cp_rank_cores, names, window, None, True, timeout=120)
    for j, name in enumerate(names):
        for grad, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
            got = zigzag_unsplit([r[j][i] for r in per_rank], seq_dim=2)
            assert _rel(got, expected[i]) < TOL, (name, grad, _rel(got, expected[i]))
        assert _rel(sum(r[j][4] for r in per_rank), expected[4]) < TOL, (name, "dsinks")


def test_one_rank_group_is_dense_attention():
    from ds_megatron.parallel_state import ParallelGroup
    q, k, v, dout = _inputs(2)
    expected = _dense(q, k, v, dout, causal=True)
    for comm_type in ("p2p", "all_gather"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(qq, kk, vv, ParallelGroup.single("cp"), comm_type=comm_type)
        out.backward(dout)
        for got, want in zip((out.detach(), qq.grad, kk.grad, vv.grad), expected):
            assert _rel(got, want) < TOL


def test_zigzag_layout_round_trip():
    x = torch.arange(2 * 16 * 3).view(2, 16, 3)
    for cp in (1, 2, 4):
        parts = [zigzag_split(x, cp, r, seq_dim=1) for r in range(cp)]
        assert torch.equal(zigzag_unsplit(parts, seq_dim=1), x)
        for r, part in enumerate(parts):  # positions (RoPE ids) follow the chunks
            assert torch.equal(part[0, :, 0] // 3, zigzag_chunk_indices(16, cp, r))
    assert zigzag_chunk_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    sb = x.transpose(0, 1).contiguous()  # [s, b, ...]
    assert torch.equal(zigzag_unsplit([zigzag_split(sb, 2, r, seq_dim=0) for r in range(2)], seq_dim=0), sb)


def test_seq_length_refusal_names_the_fields():
    check_context_parallel_seq_length(32, cp=4, tp=2, sequence_parallel=False)
    check_context_parallel_seq_length(32, cp=2, tp=2, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"model.seq_length 12 .*context_parallel_size") as e:
        check_context_parallel_seq_length(12, cp=4)
    assert "tensor_model_parallel_size" not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"model.seq_length 24 .*context_parallel_size.*tensor_model_parallel_size"):
        check_context_parallel_seq_length(24, cp=2, tp=4, sequence_parallel=True)


def _peak_scores_fraction(comm_type, seq):
    """The peak of one a2a / p2p forward + backward on this rank, as a fraction of one [b, heads/cp, s, s] fp32
    score tensor (what an untiled whole-sequence attention would hold at least once)."""
    import torch.distributed as dist
    from ds_megatron.parallel import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    from ds_megatron.utils.memory import peak_allocated_bytes
    cp = dist.get_world_size()
    state = ParallelState.build(ParallelLayout(world_size=cp, cp=cp))
    hierarchical = None
    if comm_type.startswith("a2a+p2p"):
        comm_type, inner = comm_type.split(":")
        state.build_hierarchical_context_parallel(int(inner))
        hierarchical = state.hierarchical_context_parallel
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, HEADS, seq // cp, D, generator=g).requires_grad_() for _ in range(3))

        def step():
            context_parallel_attention(q, k, v, state.cp, comm_type=comm_type, causal=True,
                                       hierarchical=hierarchical).sum().backward()
        step()  # warm-up
        peak = peak_allocated_bytes(step)[0]
        return peak / (HEADS // cp * seq * seq * 4)
    finally:
        state.destroy()


def test_all_to_all_and_hierarchical_attention_hold_score_tiles_not_the_whole_square():
    # Ulysses attends over the whole sequence: in tiles of s/2cp query rows its scores are [b, h/cp, s/2cp, s] at a
    # time (half a ring block), not [b, h/cp, s, s] (untiled: 3.4 squares at the peak, measured), so its peak
    # stays near the ring's.
    # Hierarchical 2 x 2: each position-masked ring block is a [s/2, s/2] square of heads/2, made a quarter of its
    # query rows at a time (whole: 1.9 squares at the peak, measured).
    kinds = ("a2a", "p2p", "a2a+p2p:2")
    fractions = dict(zip(kinds, (run_on_ranks(4, _peak_scores_fraction, c, 512)[0] for c in kinds)))
    assert fractions["a2a"] < 0.75 and fractions["a2a"] < 1.5 * fractions["p2p"], fractions
    assert fractions["a2a+p2p:2"] < 1.0 and fractions["a2a+p2p:2"] < 2 * fractions["p2p"], fractions
