"""The conjugate operators on real gloo ranks: forward values and backward
gradients against values each rank computes locally for every rank."""
import pytest
import torch

from harness import run_on_ranks
from ds_megatron.parallel_state import ParallelGroup
from tp_helpers import close, tp_group
from ds_megatron.tensor_parallel import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                                         gather_from_tensor_model_parallel_region,
                                         reduce_from_tensor_model_parallel_region,
                                         reduce_scatter_to_sequence_parallel_region,
                                         scatter_to_sequence_parallel_region, scatter_to_tensor_model_parallel_region)

S, B, H = 4, 2, 4  # [seq, batch, hidden]; seq and hidden divisible by 4


def _noncontig(seed, s, b, h):
    # Built transposed so the operators see non-contiguous inputs.
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h, b, s, generator=g, dtype=torch.float64).permute(2, 1, 0)


def _backward(y, grad):
    # Route the gradient through a permute so the operators also get a non-contiguous grad.
    (y.permute(2, 1, 0) * grad.permute(2, 1, 0)).sum().backward()


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _check_all(tp):
    with tp_group(tp) as (g, r, n):
        # x_k / g_k: what rank k feeds in / gets as output grad (every rank can build every rank's).
        xs = [_noncontig(10 + k, S, B, H) for k in range(n)]
        gs = [_noncontig(20 + k, S, B, H) for k in range(n)]
        sl_h, sl_s = slice(r * H // n, (r + 1) * H // n), slice(r * S // n, (r + 1) * S // n)
        part_h = lambda t, k: t[:, :, k * H // n:(k + 1) * H // n]  # noqa: E731
        part_s = lambda t, k: t[k * S // n:(k + 1) * S // n]  # noqa: E731

        # f: identity forward, all-reduce backward. A second consumer (w) shares the same
        # incoming gradient tensor: its gradient must not be touched by the all-reduce.
        x, w = _leaf(xs[r]), torch.zeros(S, B, H, dtype=torch.float64, requires_grad=True)
        y = copy_to_tensor_model_parallel_region(x, g)
        close(y, xs[r], "copy_to forward")
        _backward(y + w, gs[r])
        close(x.grad, sum(gs), "copy_to backward = sum of grads")
        close(w.grad, gs[r], "copy_to must not modify a gradient shared with another branch")

        # g: all-reduce forward, identity backward.
        x = _leaf(xs[r])
        y = reduce_from_tensor_model_parallel_region(x, g)
        close(y, sum(xs), "reduce_from forward")
        _backward(y, gs[r])
        close(x.grad, gs[r], "reduce_from backward")
        close(x, xs[r], "reduce_from must not modify its input")

        # split last dim / all-gather backward (input identical on all ranks).
        x = _leaf(xs[0])
        y = scatter_to_tensor_model_parallel_region(x, g)
        close(y, xs[0][:, :, sl_h], "scatter last-dim forward")
        _backward(y, part_h(gs[r], r))
        close(x.grad, torch.cat([part_h(gs[k], k) for k in range(n)], dim=-1), "scatter last-dim backward")

        # all-gather last dim / split backward.
        x = _leaf(part_h(xs[r], r))
        y = gather_from_tensor_model_parallel_region(x, g)
        close(y, torch.cat([part_h(xs[k], k) for k in range(n)], dim=-1), "gather last-dim forward")
        _backward(y, gs[r])
        close(x.grad, gs[r][:, :, sl_h], "gather last-dim backward")

        # sequence: split dim 0 / all-gather backward.
        x = _leaf(xs[0])
        y = scatter_to_sequence_parallel_region(x, g)
        close(y, xs[0][sl_s], "scatter seq forward")
        _backward(y, part_s(gs[r], r))
        close(x.grad, torch.cat([part_s(gs[k], k) for k in range(n)]), "scatter seq backward")

        # sequence: all-gather dim 0; backward reduce-scatter (TP consumer) or split (replicated consumer).
        for tp_grad in (True, False):
            x = _leaf(part_s(xs[r], r))
            y = gather_from_sequence_parallel_region(x, g, tensor_parallel_output_grad=tp_grad)
            close(y, torch.cat([part_s(xs[k], k) for k in range(n)]), "gather seq forward")
            _backward(y, gs[r])
            want = sum(gs)[sl_s] if tp_grad else gs[r][sl_s]
            close(x.grad, want, f"gather seq backward (tensor_parallel_output_grad={tp_grad})")

        # sequence: reduce-scatter dim 0 / all-gather backward.
        x = _leaf(xs[r])
        y = reduce_scatter_to_sequence_parallel_region(x, g)
        close(y, sum(xs)[sl_s], "reduce-scatter seq forward")
        _backward(y, part_s(gs[r], r))
        close(x.grad, torch.cat([part_s(gs[k], k) for k in range(n)]), "reduce-scatter seq backward")
        return r


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4), (4, 2)])
def test_conjugate_operators_forward_and_backward(world, tp):
    ranks = run_on_ranks(world, _check_all, tp)
    assert sorted(ranks) == sorted(list(range(tp)) * (world // tp))


def test_group_of_one_is_identity_without_communication():
    x = torch.randn(4, 2, 4, requires_grad=True)
    for op in (copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
               scatter_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region,
               scatter_to_sequence_parallel_region, gather_from_sequence_parallel_region,
               reduce_scatter_to_sequence_parallel_region):
        assert op(x, ParallelGroup.single("tp")) is x, op.__name__
