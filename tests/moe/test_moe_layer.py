"""MoELayer with EP=2/4, ETP=2 and MoE folding (TP=2 attention ranks) against EP=1 on one rank, float64.

Each dense data-parallel replica feeds its own micro-batch (TP peers the same
one, or their sequence slices under sequence parallelism).  The reference
runs the single-rank layer on each replica's micro-batch in turn and
accumulates gradients, so outputs, input gradients, the routing losses
(whole-sequence values), router gradients (summed over dp, and over TP for
sequence-parallel slices) and expert gradients (summed over edp) must all match.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from moe_helpers import expert_grads, moe_config
from ds_megatron.moe import MoELayer
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState

S, B, H = 8, 2, 16


def _data(num_replicas):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(S, B * num_replicas, H, generator=g, dtype=torch.float64)
    w = torch.randn(S, B * num_replicas, H, generator=g, dtype=torch.float64)
    return x, w


def _run(layer, x, w):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    ((y * w).sum() + layer.aux_loss).backward()
    return y.detach(), x.grad, layer.aux_loss.detach()


def _compare(tp, ep, etp, sp, dispatcher, grouped):
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, ep=ep, etp=etp))
    cfg = moe_config(sequence_parallel=sp, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped,
                     moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    torch.manual_seed(5)
    layer = MoELayer(cfg, parallel_state=state).double()
    torch.manual_seed(5)
    ref = MoELayer(moe_config(moe_grouped_gemm=grouped, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)).double()

    x, w = _data(state.dp.size)
    d, t = state.dp.rank, state.tp.rank
    batch = slice(d * B, (d + 1) * B)
    seq = slice(t * S // tp, (t + 1) * S // tp) if sp else slice(0, S)
    y, dx, aux = _run(layer, x[seq, batch], w[seq, batch])

    ref_out = {}
    for r in range(state.dp.size):
        b = slice(r * B, (r + 1) * B)
        ref_out[r] = _run(ref, x[:, b], w[:, b])
    ry, rdx, raux = ref_out[d]
    assert torch.allclose(y, ry[seq], rtol=1e-10, atol=1e-12), "outputs differ"
    assert torch.allclose(dx, rdx[seq], rtol=1e-10, atol=1e-12), "input gradients differ"
    assert torch.allclose(aux, raux, rtol=1e-10), (aux, raux)

    router_grad = layer.router.weight.grad.clone()
    if sp:
        dist.all_reduce(router_grad, group=state.tp.group)
    dist.all_reduce(router_grad, group=state.dp.group)
    assert torch.allclose(router_grad, ref.router.weight.grad, rtol=1e-9, atol=1e-12), "router gradient differs"

    grads, ref_grads = expert_grads(layer.experts), expert_grads(ref.experts)
    f = cfg.moe_ffn_hidden_size // etp
    cols = slice(state.etp.rank * f, (state.etp.rank + 1) * f)
    assert sorted({e for e, _ in grads}) == list(range(state.ep.rank * 4 // ep, (state.ep.rank + 1) * 4 // ep))
    for (e, name), g in grads.items():
        g = g.clone()
        dist.all_reduce(g, group=state.edp.group)
        expected = ref_grads[(e, name)][cols] if name == "fc1" else ref_grads[(e, name)][:, cols]
        assert torch.allclose(g, expected, rtol=1e-9, atol=1e-12), f"expert {e} {name} gradient differs"
    state.destroy()
    return float(aux)


@pytest.mark.parametrize("tp,ep,etp,sp,dispatcher,grouped", [
    (1, 2, 1, False, "alltoall", True),     # EP=2, edp=2
    (1, 4, 1, False, "alltoall", False),    # EP=4, one expert per rank
    (1, 2, 2, False, "alltoall", True),     # EP=2 x ETP=2: uneven ETP gather / reduce-scatter
    (2, 4, 1, False, "alltoall", True),     # folding: TP=2 x DP=2 attention, EP=4 experts
    (2, 4, 1, True, "alltoall", False),     # folding with sequence parallelism
    (2, 2, 2, True, "alltoall", True),      # ETP = TP
    (1, 4, 1, False, "allgather", True),
    (2, 2, 2, True, "allgather", False),
])
def test_moe_layer_matches_single_rank(tp, ep, etp, sp, dispatcher, grouped):
    run_on_ranks(4, _compare, tp, ep, etp, sp, dispatcher, grouped)


def test_sequential_and_grouped_experts_agree():
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        outs = []
        for grouped in (True, False):
            torch.manual_seed(3)
            layer = MoELayer(moe_config(moe_grouped_gemm=grouped)).to(dtype)
            x, w = _data(1)
            y, dx, _ = _run(layer, x.to(dtype), w.to(dtype))
            outs.append((y, dx, expert_grads(layer.experts)))
        (y1, dx1, g1), (y2, dx2, g2) = outs
        assert torch.allclose(y1, y2, atol=tol) and torch.allclose(dx1, dx2, atol=tol)
        for k in g1:
            assert torch.allclose(g1[k], g2[k], atol=tol), k


def test_grouped_gemm_kernels_agree():
    from ds_megatron.moe.experts import grouped_gemm
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 8, 4, generator=g, requires_grad=True)
    sizes = [3, 0, 7]
    ref = torch.cat([x[:3] @ w[0], x[3:] @ w[2]])
    rx, rw = torch.autograd.grad(ref.sum(), (x, w))
    # 1e-5 holds for any summation order: two float32 sums of n products differ by at most 2 n eps32/2 x the sum
    # of the products' sizes, which for these inputs (n = 8, 4, 7) is at most 0.56 of 1e-5 + 1e-5 |ref|.
    for use_grouped_mm in (True, False):  # torch._grouped_mm and the padded bmm
        y = grouped_gemm(x, w, sizes, use_grouped_mm)
        assert torch.allclose(y, ref, atol=1e-5)
        gx, gw = torch.autograd.grad(y.sum(), (x, w))
        assert torch.allclose(gx, rx, atol=1e-5) and torch.allclose(gw, rw, atol=1e-5)


def test_init_does_not_depend_on_expert_class_or_layout():
    torch.manual_seed(9)
    a = MoELayer(moe_config(moe_grouped_gemm=True))
    after_a = torch.rand(())
    torch.manual_seed(9)
    b = MoELayer(moe_config(moe_grouped_gemm=False))
    after_b = torch.rand(())
    assert after_a == after_b, "the two expert classes consume the RNG differently"
    for e in range(4):
        wa, wb = a.experts.expert_weights(e), b.experts.expert_weights(e)
        for k in wa:
            assert torch.equal(wa[k], wb[k])
