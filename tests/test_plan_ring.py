"""The clock's price of context parallelism's p2p ring on a CPU (``planning.step_time._Pricer.ring_blocks``) counts
what ``transformer.context_parallel`` runs: per (query half, key half) block pair its GEMMs and its passes over the
fp32 scores and over its output rows, counted at torch's dispatcher on 2 real gloo ranks, forward and backward."""

from harness import run_on_ranks

from ds_megatron.planning.step_time import RING_MASK_PASSES, RING_PAIR_PASSES

GEMMS = {"bmm", "mm", "matmul", "baddbmm", "addmm"}
NOT_DATA = {"_unsafe_view"}  # a GEMM's reshape of its operands, a view in all but name


def _count(heads: int, seq: int, width: int, batch: int):
    """Per phase (forward, backward): GEMMs, and the float tensors of each operator (inputs and outputs, read and
    written counted apart) the size of a block pair's scores ``[b, heads, c, c]`` and of its output rows
    ``[b, heads, c, width]`` (the sizes chosen apart from every other tensor of the ring)."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from ds_megatron.parallel_state import ParallelGroup
    from ds_megatron.transformer.context_parallel import context_parallel_attention
    cp = dist.get_world_size()
    c = seq // (2 * cp)
    scores, rows = batch * heads * c * c, batch * heads * c * width

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.gemms = self.scores = self.rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in GEMMS:
                self.gemms += 1
            elif name not in NOT_DATA and not func.is_view:
                for t in tree_leaves((args, kwargs, out)):
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        self.scores += t.numel() == scores
                        self.rows += t.numel() == rows
            return out

    group = ParallelGroup("cp", tuple(range(cp)), dist.get_rank(), dist.group.WORLD)
    torch.manual_seed(dist.get_rank())
    q, k, v = (torch.randn(batch, heads, seq // cp, width, dtype=torch.float32, requires_grad=True)
               for _ in range(3))
    with Count() as forward:
        out = context_parallel_attention(q, k, v, group, causal=True)
    with Count() as backward:
        out.backward(torch.randn_like(out))
    return [(p.gemms, p.scores, p.rows) for p in (forward, backward)]


def test_ring_blocks_price_the_gemms_and_passes_the_ring_runs():
    """CP 2, causal: each rank computes 2 cp + 1 = 5 block pairs, two of them diagonal (masked); forward 2 GEMMs a
    pair, backward 5; the passes as ``RING_PAIR_PASSES`` and ``RING_MASK_PASSES`` count them."""
    pairs, diagonal = 5, 2
    for rank in run_on_ranks(2, _count, 4, 256, 8, 2):
        (f_gemms, f_scores, f_rows), (b_gemms, b_scores, b_rows) = rank
        assert (f_gemms, b_gemms) == (2 * pairs, 5 * pairs)
        assert f_scores == RING_PAIR_PASSES["forward"][0] * pairs + RING_MASK_PASSES * diagonal
        assert f_rows == RING_PAIR_PASSES["forward"][1] * pairs
        assert b_scores == RING_PAIR_PASSES["backward"][0] * pairs + RING_MASK_PASSES * diagonal
        assert b_rows == RING_PAIR_PASSES["backward"][1] * pairs
