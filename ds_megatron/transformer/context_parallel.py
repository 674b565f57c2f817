"""Context parallelism's attention core: exact attention over a sequence split across the ``cp`` group.

Layout (Megatron's load balancing for causal masks): the sequence is cut into
``2 * cp`` equal chunks and CP rank ``i`` holds chunks ``i`` and ``2cp-1-i``,
in that order, so every rank has the same share of the causal triangle.
``zigzag_chunk_indices`` gives a rank's token positions (also its RoPE
position ids); ``zigzag_split`` / ``zigzag_unsplit`` move tensors between the
full and the split layout.

``context_parallel_attention(q, k, v, cp_group, comm_type)`` takes this rank's
``q [b, heads, s/cp, d]``, ``k [b, kv_heads, s/cp, d]`` and ``v [b, kv_heads, s/cp, dv]``
(``dv`` may differ from ``d``: multi-latent attention's values are narrower than its keys; K and V
travel side by side in one message, ``d + dv`` channels) and returns the exact attention of its
queries over the whole sequence, ``[b, heads, s/cp, dv]``:

- ``"p2p"`` (ring): K/V of ``kv_heads`` heads go round the group, the next
  block's exchange started before the current block is computed.  Each block
  gives a partial output and per-row log-sum-exp, merged exactly
  (``o = o_a e^(lse_a - lse) + o_b e^(lse_b - lse)``, ``lse = logaddexp``).
  With the zigzag layout a (query chunk, key chunk) pair is either full,
  causal on its diagonal, or masked out and skipped.  Backward (flash-attention
  formulas, recomputing the probabilities from the saved log-sum-exp) sends K/V
  round again with a dK/dV accumulator travelling beside it: it starts on the
  owner's successor and reaches the owner after ``cp - 1`` hops, where the
  owner's own contribution (its first block) is added.  Per layer a rank sends
  ``cp - 1`` K/V blocks forward and ``cp - 1`` K/V blocks plus ``cp - 1``
  dK/dV accumulators backward, a ring's minimum without keeping every block;
  K/V travel in the input dtype, the accumulators in float32 for 16-bit inputs
  (``tests/test_bytes_on_wire.py`` holds both variants to these counts).
- ``"all_gather"``: K/V all-gathered over ``cp`` (in the input dtype), one
  masked attention of the local queries against the whole sequence, the
  gathered K/V kept for backward; dK/dV reduce-scattered back (float32 for
  16-bit inputs).

- ``"a2a"`` (DeepSpeed-Ulysses): an all-to-all over ``cp`` trades the sequence split
  for a head split: each rank sends its ``s/cp`` tokens of head group ``j`` to
  rank ``j`` and receives every rank's tokens of its own ``heads/cp`` heads, runs
  causal attention over the whole sequence for them (the keys in the ranks'
  zigzag order, masked by their positions, so the layout is kept and never
  undone), and a second all-to-all gives every rank its tokens of all heads back.
  Backward is the same all-to-alls in reverse.  Per layer a rank sends
  ``(cp - 1) / cp`` of its q, k, v and output forward and as much of their
  gradients backward.  K/V with fewer heads than ``cp`` (grouped-query attention)
  are expanded to the query heads first, as megatron-core does.

Scores are accumulated in float32 for 16-bit inputs and in the input dtype
otherwise (float64 stays float64).  Grouped-query K/V are expanded per block
on the rank that computes it; only ``kv_heads`` heads are communicated.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from ..config.model import CP_COMM_TYPES as COMM_TYPES, check_context_parallel_seq_length  # noqa: F401
from ..parallel_state import ParallelGroup
from ..utils.collectives import all_gather_into, all_to_all_single, reduce_scatter_into, ring_exchange

_KV_TAG, _DKV_TAG = 0, 1  # both flow to the same neighbour during backward


# ---------------------------------------------------------------- layout (pure index maps)

def zigzag_chunk_ids(cp: int, cp_rank: int) -> Tuple[int, int]:
    """The two of the ``2 * cp`` chunks CP rank ``cp_rank`` holds, in its local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def zigzag_chunk_indices(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions (0-based, int64) of the tokens CP rank ``cp_rank`` holds: its RoPE position ids too."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * cp = {2 * cp}")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in zigzag_chunk_ids(cp, cp_rank)])


def rank_positions(local_len: int, cp_group: ParallelGroup, device) -> Optional[torch.Tensor]:
    """RoPE position ids of this CP rank's ``local_len`` tokens (its two zigzag chunks); None without CP (0..n-1)."""
    if cp_group.size == 1:
        return None
    return zigzag_chunk_indices(local_len * cp_group.size, cp_group.size, cp_group.rank).to(device)


def zigzag_split(x: torch.Tensor, cp: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of the full-sequence ``x`` along ``seq_dim`` (1 for [b, s, ...], 0 for [s, b, ...])."""
    c = x.size(seq_dim) // (2 * cp)
    if c * 2 * cp != x.size(seq_dim):
        raise ValueError(f"sequence length {x.size(seq_dim)} is not divisible by 2 * cp = {2 * cp}")
    return torch.cat([x.narrow(seq_dim, i * c, c) for i in zigzag_chunk_ids(cp, cp_rank)], dim=seq_dim)


def zigzag_unsplit(parts: Sequence[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """The full sequence from every CP rank's ``zigzag_split`` part, ``parts[i]`` being rank i's."""
    cp = len(parts)
    chunks: List[Optional[torch.Tensor]] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=seq_dim)
        a, b = zigzag_chunk_ids(cp, r)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=seq_dim)


class Places:
    """Where tokens sit in their row, which is what causal masking needs: ``index [..., n]`` their positions in the
    row (the causal order) and ``segment [..., n]`` their documents (packed rows; None: each row is one document).

    A leading member dimension holds one entry per member of a group (CP ranks, or the ring members of
    hierarchical CP); a batch dimension ``[..., b, n]`` appears when the rows' documents differ (packed
    micro-batches, ``PackedSeqParams.cp_places``).  A query sees a key of its own document at or before it, and
    with a sliding ``window`` (Megatron's ``window_size[0]``) at most ``window`` positions before it."""

    def __init__(self, index: torch.Tensor, segment: Optional[torch.Tensor] = None, batched: bool = False,
                 window: Optional[int] = None):
        self.index, self.segment, self.batched, self.window = index, segment, batched, window

    @classmethod
    def zigzag(cls, seq_len: int, cp: int, device, window: Optional[int] = None) -> "Places":
        """Every CP rank's two zigzag chunks of one-document rows."""
        return cls(torch.stack([zigzag_chunk_indices(seq_len, cp, r) for r in range(cp)]).to(device), window=window)

    def windowed(self, window: Optional[int]) -> "Places":
        return Places(self.index, self.segment, self.batched, window)

    def member(self, m: int) -> "Places":
        return Places(self.index[m], None if self.segment is None else self.segment[m], self.batched, self.window)

    def joined(self, members: Optional[Sequence[int]] = None) -> "Places":
        """The members' tokens one after the other (the order gathered or all-to-all'd keys arrive in)."""
        members = range(self.index.size(0)) if members is None else members
        index = torch.cat([self.index[m] for m in members], dim=-1)
        segment = None if self.segment is None else torch.cat([self.segment[m] for m in members], dim=-1)
        return Places(index, segment, self.batched, self.window)

    def grouped(self, groups: Sequence[Sequence[int]]) -> "Places":
        """A member dimension of ``groups`` (each the join of its members): a ring of all-to-all groups."""
        joined = [self.joined(g) for g in groups]
        segment = None if self.segment is None else torch.stack([j.segment for j in joined])
        return Places(torch.stack([j.index for j in joined]), segment, self.batched, self.window)

    def rows(self, start: int, stop: int) -> "Places":
        return Places(self.index[..., start:stop], None if self.segment is None else self.segment[..., start:stop],
                      self.batched, self.window)

    def allowed(self, keys: "Places") -> torch.Tensor:
        """Which of ``keys`` each of these query tokens sees: ``[nq, nk]``, or ``[b, 1, nq, nk]`` when batched."""
        allowed = keys.index.unsqueeze(-2) <= self.index.unsqueeze(-1)
        if self.window is not None:  # Hugging Face's sliding_window w: i - j < w, i.e. window = w - 1
            allowed = allowed & (keys.index.unsqueeze(-2) >= self.index.unsqueeze(-1) - self.window)
        if self.segment is not None:
            allowed = allowed & (keys.segment.unsqueeze(-2) == self.segment.unsqueeze(-1))
        return allowed.unsqueeze(-3) if self.batched else allowed


# ---------------------------------------------------------------- one block of attention

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    g = heads // t.size(1)
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def _fold_kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum an expanded [b, heads, n, d] gradient back onto its ``kv_heads`` (each shared by heads/kv_heads)."""
    b, heads, n, d = grad.shape
    return grad if heads == kv_heads else grad.view(b, kv_heads, heads // kv_heads, n, d).sum(2)


class Score:
    """What the scores ``q k^T`` go through before the mask: x ``scale``, then, with ``cap``, Gemma 2's soft-cap
    ``cap * tanh(s / cap)``."""

    def __init__(self, scale: float, cap: Optional[float] = None):
        self.scale, self.cap = scale, cap


def _scores(q, k, score: Score, allowed):
    s = torch.matmul(q, k.transpose(-1, -2)) * score.scale
    if score.cap is not None:
        s = torch.tanh(s / score.cap) * score.cap
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


def _block_forward(q, k, v, score, allowed):
    """Softmax attention of q against one K/V block: output normalised within the block, and per-row lse."""
    s = _scores(q, _expand_kv(k, q.size(1)), score, allowed)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _expand_kv(v, q.size(1))), lse


def _block_backward(q, k, v, dout, lse, delta, score, allowed):
    """dq, dk, dv of one block given the final lse and delta = rowsum(dout * out) (flash-attention's backward)."""
    heads, kv_heads = q.size(1), k.size(1)
    ke, ve = _expand_kv(k, heads), _expand_kv(v, heads)
    s = _scores(q, ke, score, allowed)
    p = torch.exp(s - lse.unsqueeze(-1))  # masked entries: exp(-inf) = 0
    # the cap's derivative d(c tanh(x / c))/dx = 1 - (capped / c)^2, made in the scores' storage (masked entries:
    # ds = 0 there anyway); without a cap the scores go now, as the planned peak has it
    through_cap = None if score.cap is None else s.nan_to_num_(neginf=0.0).div_(score.cap).pow_(2).neg_().add_(1)
    del s
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, ve.transpose(-1, -2)) - delta.unsqueeze(-1))
    if through_cap is not None:
        ds.mul_(through_cap)
    dq = torch.matmul(ds, ke) * score.scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * score.scale
    return dq, _fold_kv_grad(dk, kv_heads), _fold_kv_grad(dv, kv_heads)


def _merge(out, lse, block_out, block_lse) -> None:
    """Fold a block's (output, lse) into the running ones, in place."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _sink_forward(out, lse, sinks):
    """gpt-oss's attention sinks, one more logit per query row (``sinks [heads]``, None: none), entered once into
    the merged rows: ``out`` rescaled and ``lse`` raised in place; returns them."""
    if sinks is not None:
        merged = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
        out.mul_(torch.exp(lse - merged).unsqueeze(-1))
        lse.copy_(merged)
    return out, lse


def _sink_backward(sinks, lse, delta):
    """The sinks' gradient, ``-sum over rows of p_sink * delta`` (a row's sink probability ``exp(sink - lse)``, the
    sink's value 0), from the final ``lse`` and ``delta = rowsum(dout * out)``; None without sinks."""
    if sinks is None:
        return None
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)


def _chunk_pairs(cp: int, rank: int, src: int, causal: bool):
    """(query chunk slot, key chunk slot, allowed-mask kind) for rank's queries against src's keys.

    Slots are 0/1 within the local two chunks; kind is "full" or "diagonal"; masked-out pairs are left out."""
    pairs = []
    for qi, qc in enumerate(zigzag_chunk_ids(cp, rank)):
        for ki, kc in enumerate(zigzag_chunk_ids(cp, src)):
            if not causal or kc < qc:
                pairs.append((qi, ki, "full"))
            elif kc == qc:
                pairs.append((qi, ki, "diagonal"))
    return pairs


def _halves(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return t.chunk(2, dim=2)


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V as one message, side by side in the channels: V may be narrower than K (MLA)."""
    return torch.cat((k, v), dim=-1)


def _unpack(kv: torch.Tensor, k_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Views of a ``_pack``ed (or like-shaped gradient) tensor's K and V channels."""
    return kv[..., :k_dim], kv[..., k_dim:]


# ---------------------------------------------------------------- the ring (p2p)

def _merge_rows(out, lse, block_out, block_lse) -> None:
    """``_merge`` for blocks in which some query rows see no key (their lse is -inf): those rows keep theirs."""
    new = torch.logaddexp(lse, block_lse)
    seen = torch.isfinite(new)
    safe = torch.where(seen, new, torch.zeros_like(new))
    keep = torch.where(torch.isfinite(lse), torch.exp(lse - safe), torch.zeros_like(lse))
    take = torch.where(torch.isfinite(block_lse), torch.exp(block_lse - safe), torch.zeros_like(block_lse))
    out.mul_(keep.unsqueeze(-1)).add_(torch.nan_to_num(block_out) * take.unsqueeze(-1))
    lse.copy_(new)


def _block_forward_rows(q, k, v, score, allowed):
    """``_block_forward`` where a query row may see no key of the block: its output 0, its lse -inf."""
    s = _scores(q, _expand_kv(k, q.size(1)), score, allowed)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.matmul(torch.exp(s - safe.unsqueeze(-1)), _expand_kv(v, q.size(1))), lse


def _row_tiles(rows: int, parts: int = 4):
    """``[(start, end)]`` splitting ``rows`` query rows into ``parts`` tiles (the last may be shorter): a block's
    scores are made a tile at a time, a quarter of the block's square alive at once."""
    size = -(-rows // parts)
    return [(i, min(i + size, rows)) for i in range(0, rows, size)]


class _RingAttention(torch.autograd.Function):
    """The ring over ``cp_group``.  Without ``places`` each member holds its two zigzag chunks (the pair
    shortcut below); with ``places`` (hierarchical CP: a ring of a2a groups; packed rows) member r holds the
    tokens at ``places.member(r)`` and each block is masked by their places."""

    @staticmethod
    def forward(ctx, q, k, v, cp_group: ParallelGroup, causal: bool, score: Score, places=None, sinks=None):
        ctx.has_sinks = sinks is not None
        if places is not None:
            return _RingAttention._forward_places(ctx, q, k, v, cp_group, causal, score, places, sinks)
        cdt = _compute_dtype(q.dtype)
        qc, kv = q.to(cdt), _pack(k, v)  # K and V travel as one message, in their own dtype
        c = q.size(2) // 2
        diagonal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        out = qc.new_zeros(q.shape[:3] + (v.size(-1),))  # V's width (MLA's is narrower than K's)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=cdt, device=q.device)
        cp, rank = cp_group.size, cp_group.rank
        q_h, out_h, lse_h = _halves(qc), _halves(out), lse.chunk(2, dim=2)
        for step in range(cp):
            src = (rank - step) % cp
            if step + 1 < cp:  # start the next block's exchange before computing this one
                incoming = torch.empty_like(kv)
                works = ring_exchange(kv, incoming, cp_group, tag=_KV_TAG)
            block_k, block_v = _unpack(kv.to(cdt), k.size(-1))
            k_h, v_h = _halves(block_k), _halves(block_v)
            for qi, ki, kind in _chunk_pairs(cp, rank, src, causal):
                o, l = _block_forward(q_h[qi], k_h[ki], v_h[ki], score, diagonal if kind == "diagonal" else None)
                _merge(out_h[qi], lse_h[qi], o, l)
            if step + 1 < cp:
                for w in works:
                    w.wait()
                kv = incoming
        _sink_forward(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cp_group, ctx.causal, ctx.score, ctx.places = cp_group, causal, score, None
        return out.to(q.dtype)

    @staticmethod
    def _allowed(places, rank, src, causal):
        if not causal:
            return None
        return places.member(rank).allowed(places.member(src))

    @staticmethod
    def _forward_places(ctx, q, k, v, cp_group, causal, score, places, sinks):
        cdt = _compute_dtype(q.dtype)
        qc, kv = q.to(cdt), _pack(k, v)
        out = qc.new_zeros(q.shape[:3] + (v.size(-1),))  # V's width (MLA's is narrower than K's)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=cdt, device=q.device)
        cp, rank = cp_group.size, cp_group.rank
        for step in range(cp):
            src = (rank - step) % cp
            if step + 1 < cp:
                incoming = torch.empty_like(kv)
                works = ring_exchange(kv, incoming, cp_group, tag=_KV_TAG)
            allowed = _RingAttention._allowed(places, rank, src, causal)
            if allowed is None or bool(allowed.any()):
                block_k, block_v = _unpack(kv.to(cdt), k.size(-1))
                for r0, r1 in _row_tiles(q.size(2)):  # a position-masked block is a whole [local, local] square
                    o, l = _block_forward_rows(qc[:, :, r0:r1], block_k, block_v, score,
                                               None if allowed is None else allowed[..., r0:r1, :])
                    _merge_rows(out[:, :, r0:r1], lse[:, :, r0:r1], o, l)
            if step + 1 < cp:
                for w in works:
                    w.wait()
                kv = incoming
        _sink_forward(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cp_group, ctx.causal, ctx.score, ctx.places = cp_group, causal, score, places
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        sinks = sinks if ctx.has_sinks else None
        cp_group, causal, score = ctx.cp_group, ctx.causal, ctx.score
        if ctx.places is not None:
            return _RingAttention._backward_places(ctx, q, k, v, out, lse, dout, sinks)
        cdt = out.dtype
        qc, kv, dout = q.to(cdt), _pack(k, v), dout.to(cdt)
        delta = (dout * out).sum(-1)
        c = q.size(2) // 2
        diagonal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        dq = torch.zeros_like(qc)
        cp, rank = cp_group.size, cp_group.rank
        q_h, do_h, dq_h = _halves(qc), _halves(dout), _halves(dq)
        lse_h, delta_h = lse.chunk(2, dim=2), delta.chunk(2, dim=2)
        # At step t this rank holds block (rank - t).  Its own block (t = 0) keeps its contribution here; from
        # t = 1 an accumulator for the held block arrives from the previous rank (or starts here at t = 1), takes
        # this rank's contribution and moves on, reaching the block's owner after its last hop.
        own, dkv_in, dkv_works = None, None, []
        for step in range(cp):
            src = (rank - step) % cp
            if step + 1 < cp:
                incoming = torch.empty_like(kv)
                works = ring_exchange(kv, incoming, cp_group, tag=_KV_TAG)
            block = kv.to(cdt)
            block_k, block_v = _unpack(block, k.size(-1))
            k_h, v_h = _halves(block_k), _halves(block_v)
            contribution = torch.zeros_like(block)  # dK and dV side by side, as K and V travel
            dk_h, dv_h = (_halves(t) for t in _unpack(contribution, k.size(-1)))
            for qi, ki, kind in _chunk_pairs(cp, rank, src, causal):
                g_q, g_k, g_v = _block_backward(q_h[qi], k_h[ki], v_h[ki], do_h[qi], lse_h[qi], delta_h[qi], score,
                                                diagonal if kind == "diagonal" else None)
                dq_h[qi].add_(g_q)
                dk_h[ki].add_(g_k)
                dv_h[ki].add_(g_v)
            if step == 0:
                own = contribution
            else:
                for w in dkv_works:  # the previous rank's accumulator for this block, sent during our compute
                    w.wait()
                dkv = contribution if step == 1 else dkv_in.add_(contribution)
                dkv_in = torch.empty_like(dkv)
                dkv_works = ring_exchange(dkv, dkv_in, cp_group, tag=_DKV_TAG)
            if step + 1 < cp:
                for w in works:
                    w.wait()
                kv = incoming
        for w in dkv_works:
            w.wait()
        dkv = own if dkv_in is None else own.add_(dkv_in)
        dk, dv = _unpack(dkv, k.size(-1))
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None,
                _sink_backward(sinks, lse, delta))

    @staticmethod
    def _backward_places(ctx, q, k, v, out, lse, dout, sinks):
        """As ``backward``, each block masked by the tokens' places, a tile of query rows at a time (the accumulators travel
        the same way)."""
        cp_group, causal, score, places = ctx.cp_group, ctx.causal, ctx.score, ctx.places
        cdt = out.dtype
        qc, kv, dout = q.to(cdt), _pack(k, v), dout.to(cdt)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qc)
        cp, rank = cp_group.size, cp_group.rank
        own, dkv_in, dkv_works = None, None, []
        for step in range(cp):
            src = (rank - step) % cp
            if step + 1 < cp:
                incoming = torch.empty_like(kv)
                works = ring_exchange(kv, incoming, cp_group, tag=_KV_TAG)
            block = kv.to(cdt)
            block_k, block_v = _unpack(block, k.size(-1))
            contribution = torch.zeros_like(block)
            contribution_k, contribution_v = _unpack(contribution, k.size(-1))
            allowed = _RingAttention._allowed(places, rank, src, causal)
            if allowed is None or bool(allowed.any()):
                for r0, r1 in _row_tiles(q.size(2)):
                    g_q, g_k, g_v = _block_backward(qc[:, :, r0:r1], block_k, block_v, dout[:, :, r0:r1],
                                                    lse[:, :, r0:r1], delta[:, :, r0:r1], score,
                                                    None if allowed is None else allowed[..., r0:r1, :])
                    dq[:, :, r0:r1].add_(g_q)
                    contribution_k.add_(g_k)
                    contribution_v.add_(g_v)
            if step == 0:
                own = contribution
            else:
                for w in dkv_works:
                    w.wait()
                dkv = contribution if step == 1 else dkv_in.add_(contribution)
                dkv_in = torch.empty_like(dkv)
                dkv_works = ring_exchange(dkv, dkv_in, cp_group, tag=_DKV_TAG)
            if step + 1 < cp:
                for w in works:
                    w.wait()
                kv = incoming
        for w in dkv_works:
            w.wait()
        dkv = own if dkv_in is None else own.add_(dkv_in)
        dk, dv = _unpack(dkv, k.size(-1))
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None,
                _sink_backward(sinks, lse, delta))


# ---------------------------------------------------------------- all-gather

class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp_group: ParallelGroup, causal: bool, score: Score, places: Places, sinks=None):
        cdt = _compute_dtype(q.dtype)
        cp, local = cp_group.size, q.size(2)
        kv = _pack(k, v)  # [b, kv_heads, s/cp, dk + dv], gathered in the input dtype
        b, kv_heads, _, width = kv.shape
        gathered = kv.new_empty((cp,) + tuple(kv.shape))
        all_gather_into(gathered.view((cp * b,) + tuple(kv.shape[1:])), kv, cp_group)
        full = gathered.permute(1, 2, 0, 3, 4).reshape(b, kv_heads, cp * local, width).to(cdt)
        full_k, full_v = _unpack(full, k.size(-1))
        allowed = places.member(cp_group.rank).allowed(places.joined()) if causal else None
        out, lse = _sink_forward(*_block_forward(q.to(cdt), full_k, full_v, score, allowed), sinks)
        ctx.has_sinks = sinks is not None
        ctx.save_for_backward(q, full_k, full_v, out, lse, allowed if allowed is not None else torch.empty(0), sinks)
        ctx.cp_group, ctx.causal, ctx.score, ctx.kv_dtypes = cp_group, causal, score, (k.dtype, v.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, full_k, full_v, out, lse, allowed, sinks = ctx.saved_tensors
        allowed = allowed if ctx.causal else None
        cp_group = ctx.cp_group
        dout = dout.to(out.dtype)
        delta = (dout * out).sum(-1)
        dq, dk, dv = _block_backward(q.to(out.dtype), full_k, full_v, dout, lse, delta, ctx.score, allowed)
        cp, local = cp_group.size, q.size(2)
        b, kv_heads, _, _ = dk.shape
        # [b, kvh, cp * local, dk + dv] -> per-rank blocks on dim 0, summed back to their owners.
        dkv = _pack(dk, dv)
        width = dkv.size(-1)
        dkv = dkv.view(b, kv_heads, cp, local, width).permute(2, 0, 1, 3, 4).contiguous()
        mine = dkv.new_empty((b, kv_heads, local, width))
        reduce_scatter_into(mine, dkv.view((cp * b, kv_heads, local, width)), cp_group)
        k_dtype, v_dtype = ctx.kv_dtypes
        mine_k, mine_v = _unpack(mine, full_k.size(-1))
        return (dq.to(q.dtype), mine_k.to(k_dtype), mine_v.to(v_dtype), None, None, None, None,
                _sink_backward(sinks if ctx.has_sinks else None, lse, delta))


# ---------------------------------------------------------------- all-to-all (Ulysses)

def _heads_to_sequence(x: torch.Tensor, cp_group: ParallelGroup) -> torch.Tensor:
    """``[b, heads, s/cp, d]`` (this rank's tokens, every head) -> ``[b, heads/cp, s, d]`` (every rank's tokens in
    rank order, this rank's head group)."""
    cp = cp_group.size
    b, heads, local, d = x.shape
    send = x.reshape(b, cp, heads // cp, local, d).transpose(0, 1).contiguous()  # [cp (to), b, h/cp, s/cp, d]
    recv = torch.empty_like(send)  # [cp (from), b, h/cp, s/cp, d]
    all_to_all_single(recv, send, None, None, cp_group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, heads // cp, cp * local, d)


def _sequence_to_heads(x: torch.Tensor, cp_group: ParallelGroup) -> torch.Tensor:
    """The inverse of ``_heads_to_sequence``: ``[b, heads/cp, s, d]`` -> ``[b, heads, s/cp, d]``."""
    cp = cp_group.size
    b, group_heads, seq, d = x.shape
    send = x.reshape(b, group_heads, cp, seq // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp (to), ...]
    recv = torch.empty_like(send)  # [cp (from: head group), b, h/cp, s/cp, d]
    all_to_all_single(recv, send, None, None, cp_group)
    return recv.transpose(0, 1).reshape(b, cp * group_heads, seq // cp, d)


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp_group: ParallelGroup):
        ctx.cp_group = cp_group
        return _heads_to_sequence(x, cp_group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad.contiguous(), ctx.cp_group), None


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp_group: ParallelGroup):
        ctx.cp_group = cp_group
        return _sequence_to_heads(x, cp_group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad.contiguous(), ctx.cp_group), None


def _head_group(sinks: Optional[torch.Tensor], group: ParallelGroup) -> Optional[torch.Tensor]:
    """The sinks of the heads ``_heads_to_sequence`` gives this rank of ``group`` (its head group)."""
    return None if sinks is None else sinks.chunk(group.size)[group.rank]


def _all_to_all_attention(q, k, v, cp_group: ParallelGroup, causal: bool, score: Score,
                          places: Places, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    cp, heads = cp_group.size, q.size(1)
    if heads % cp:
        raise ValueError(f"cp_comm_type \"a2a\" splits the {heads} heads of a TP rank over cp={cp}; they must divide")
    if k.size(1) % cp:  # fewer KV heads than cp: every query head gets its own copy
        k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    qs, ks, vs = (_HeadsToSequence.apply(t, cp_group) for t in (q, k, v))
    whole = places.joined() if causal else None  # the keys (and queries) arrive in rank order
    return _SequenceToHeads.apply(_WholeSequenceAttention.apply(qs, ks, vs, whole, score, cp,
                                                                _head_group(sinks, cp_group)), cp_group)


class _WholeSequenceAttention(torch.autograd.Function):
    """Attention of a head group over the whole sequence whose tokens are in the ranks' zigzag order, one zigzag
    chunk of ``s / 2cp`` query rows at a time: a score tile is ``[b, heads/cp, s/2cp, s]`` (a ring step's block of
    ``[b, heads, s/cp, s/cp]`` has twice as many), never ``[b, heads/cp, s, s]``.  The probabilities are recomputed in backward from the saved log-sum-exp
    (flash-attention's way), so only the output and one float per query row are kept."""

    @staticmethod
    def _tiles(seq: int, cp: int):
        rows = seq // (2 * cp)  # the zigzag chunk (check_context_parallel_seq_length: 2cp divides s)
        return [(i, i + rows) for i in range(0, seq, rows)]

    @staticmethod
    def _allowed(places: Optional[Places], i0: int, i1: int):
        return None if places is None else places.rows(i0, i1).allowed(places)

    @staticmethod
    def forward(ctx, q, k, v, places: Optional[Places], score: Score, cp: int, sinks=None):
        """``places``: of the whole sequence's tokens in rank order (None: not causal)."""
        cdt = _compute_dtype(q.dtype)
        qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
        outs, lses = [], []
        for i0, i1 in _WholeSequenceAttention._tiles(q.size(2), cp):
            o, lse = _block_forward(qc[:, :, i0:i1], kc, vc, score, _WholeSequenceAttention._allowed(places, i0, i1))
            outs.append(o)
            lses.append(lse)
        out, lse = _sink_forward(torch.cat(outs, dim=2), torch.cat(lses, dim=-1), sinks)
        ctx.has_sinks = sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.places, ctx.score, ctx.cp = places, score, cp
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cdt = out.dtype
        dout = dout.to(cdt)
        qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
        delta = (dout * out).sum(-1)
        dq = torch.empty_like(qc)
        dk = torch.zeros_like(kc)
        dv = torch.zeros_like(vc)
        for i0, i1 in _WholeSequenceAttention._tiles(q.size(2), ctx.cp):
            dq[:, :, i0:i1], dk_t, dv_t = _block_backward(
                qc[:, :, i0:i1], kc, vc, dout[:, :, i0:i1], lse[..., i0:i1], delta[..., i0:i1], ctx.score,
                _WholeSequenceAttention._allowed(ctx.places, i0, i1))
            dk += dk_t
            dv += dv_t
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None,
                _sink_backward(sinks if ctx.has_sinks else None, lse, delta))


def _hierarchical_attention(q, k, v, cp_group: ParallelGroup, inner: ParallelGroup, outer: ParallelGroup,
                            causal: bool, score: Score, places: Places,
                            sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``"a2a+p2p"``: the all-to-all inside ``inner`` (consecutive CP ranks) gives each rank its a2a group's
    tokens of ``heads / inner`` heads, the ring across ``outer`` runs attention over the whole sequence with
    each block masked by its tokens' places, and the all-to-all back."""
    heads = q.size(1)
    if heads % inner.size:
        raise ValueError(f"cp_comm_type \"a2a+p2p\" splits the {heads} heads of a TP rank over {inner.size} "
                         "ranks; they must divide")
    if k.size(1) % inner.size:
        k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    # Ring member j holds the tokens of CP ranks j * inner + i, i in inner-rank order.
    ring = places.grouped([[j * inner.size + i for i in range(inner.size)] for j in range(outer.size)])
    qs, ks, vs = (_HeadsToSequence.apply(t, inner) for t in (q, k, v))
    out = _RingAttention.apply(qs, ks, vs, outer, causal, score, ring, _head_group(sinks, inner))
    return _SequenceToHeads.apply(out, inner)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: ParallelGroup,
                               comm_type: str = "p2p", causal: bool = True,
                               softmax_scale: Optional[float] = None, hierarchical=None,
                               places: Optional[Places] = None, window: Optional[int] = None,
                               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of this CP rank's queries over the whole sequence; inputs and output in the zigzag layout.

    ``q [b, heads, s/cp, d]``, ``k [b, kv_heads, s/cp, d]``, ``v [b, kv_heads, s/cp, dv]`` with ``kv_heads``
    dividing ``heads``; the output is ``[b, heads, s/cp, dv]`` in q's dtype.  A group of one is plain attention.
    ``places``: where every CP rank's tokens sit (packed rows: ``PackedSeqParams.cp_places``, each document
    zigzagged on its own); None: one document per row in the zigzag layout.  ``window``: a sliding window
    (``Places``), exact in every comm type: the blocks are masked by the tokens' positions.  ``softcap``: Gemma 2's
    ``cap * tanh(s / cap)`` of the scaled scores, forward and backward.  ``sinks [heads]``: gpt-oss's attention sinks,
    one more logit per query row entered once into the merged rows (the output rescaled, the log-sum-exp raised),
    the sinks' gradient from the final rows."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"cp_comm_type {comm_type!r} is not one of {COMM_TYPES}")
    if q.size(1) % k.size(1) or k.shape[:-1] != v.shape[:-1] or k.size(-1) != q.size(-1):
        raise ValueError(f"kv heads {k.size(1)} must divide heads {q.size(1)}, k must be as wide as q and v match "
                         "k but for its width: "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.size(2) % 2:
        raise ValueError(f"each CP rank holds two equal chunks; local sequence length {q.size(2)} is odd")
    score = Score(softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.size(-1)), softcap)
    if places is not None and not causal:
        raise ValueError("packed rows (places) are masked causally; call with causal=True")
    if window is not None:
        if not causal:
            raise ValueError("a sliding window is masked causally; call with causal=True")
        # the ring's zigzag pair shortcut knows no window: every comm type masks by places
        places = (places if places is not None else Places.zigzag(q.size(2) * cp_group.size, cp_group.size,
                                                                  q.device)).windowed(window)
    if comm_type == "p2p":  # without places the ring takes its zigzag pair shortcut
        return _RingAttention.apply(q, k, v, cp_group, causal, score, places, sinks)
    places = places if places is not None else Places.zigzag(q.size(2) * cp_group.size, cp_group.size, q.device)
    if comm_type == "a2a":
        return _all_to_all_attention(q, k, v, cp_group, causal, score, places, sinks)
    if comm_type == "a2a+p2p":
        if hierarchical is None:
            raise ValueError("cp_comm_type \"a2a+p2p\" needs the hierarchical CP groups (ParallelState."
                             "build_hierarchical_context_parallel, from megatron.hierarchical_context_parallel_sizes)")
        return _hierarchical_attention(q, k, v, cp_group, *hierarchical, causal, score, places, sinks)
    return _AllGatherAttention.apply(q, k, v, cp_group, causal, score, places, sinks)
