"""Deferred weight gradients (the zero-bubble schedule's W) are bit-identical to the undeferred ones.

The reference is the same layers without a store (``F.linear`` under autograd): the input and bias
gradients must be equal to it, and the weight gradients too once the store has run, in float64 (the
deferred GEMM is the same product; only when it runs differs).
"""
import torch

from ds_megatron.parallel_state import ParallelGroup
from ds_megatron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, attach_weight_grad_store
from ds_megatron.tensor_parallel.weight_grad_store import WeightGradStore


def _mlp():
    torch.manual_seed(0)
    tp = ParallelGroup.single("tp")
    fc1 = ColumnParallelLinear(8, 16, tp=tp, params_dtype=torch.float64)
    fc2 = RowParallelLinear(16, 8, tp=tp, input_is_parallel=True, params_dtype=torch.float64)
    with torch.no_grad():
        fc1.bias.normal_()
        fc2.bias.normal_()
    return torch.nn.ModuleList([fc1, fc2])


def _loss(mlp, x):
    hidden = torch.nn.functional.gelu(mlp[0](x)[0])
    return (mlp[1](hidden)[0] ** 2).sum()


def test_deferred_weight_grads_equal_autograd_and_arrive_only_when_run():
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    reference = _mlp()
    x_ref = x.clone().requires_grad_()
    _loss(reference, x_ref).backward()

    mlp = _mlp()
    store = WeightGradStore()
    assert attach_weight_grad_store(mlp, store) == 2
    x_def = x.clone().requires_grad_()
    with store.deferring("mb0"):
        _loss(mlp, x_def).backward()
    assert torch.equal(x_def.grad, x_ref.grad)  # B: the input gradient, at once
    assert mlp[0].weight.grad is None and mlp[1].weight.grad is None  # W: not yet
    assert torch.equal(mlp[0].bias.grad, reference[0].bias.grad)
    assert torch.equal(mlp[1].bias.grad, reference[1].bias.grad)
    assert store.pending == ["mb0"]
    store.run("mb0")
    assert torch.equal(mlp[0].weight.grad, reference[0].weight.grad)
    assert torch.equal(mlp[1].weight.grad, reference[1].weight.grad)
    assert store.pending == []


def test_without_deferring_the_store_changes_nothing_and_accumulates():
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    reference, mlp = _mlp(), _mlp()
    attach_weight_grad_store(mlp, WeightGradStore())
    for model in (reference, mlp):
        for _ in range(2):  # two micro-batches accumulate into .grad
            _loss(model, x).backward()
    for a, b in zip(reference.parameters(), mlp.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_two_deferred_micro_batches_accumulate_in_run_order():
    xs = [torch.randn(4, 2, 8, dtype=torch.float64) for _ in range(2)]
    reference, mlp = _mlp(), _mlp()
    for x in xs:
        _loss(reference, x).backward()
    store = WeightGradStore()
    attach_weight_grad_store(mlp, store)
    for i, x in enumerate(xs):
        with store.deferring(i):
            _loss(mlp, x).backward()
    store.run(0)
    store.run(1)
    for a, b in zip(reference.parameters(), mlp.parameters()):
        assert torch.equal(a.grad, b.grad)
