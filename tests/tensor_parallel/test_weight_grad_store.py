"""Deferred weight gradients (the zero-bubble schedule's W) are bit-identical to the undeferred ones.

The reference is the same layers without a store (``F.linear`` under autograd): the input and bias
gradients must be equal to it, and the weight gradients too once the store has run, in float64 (the
deferred GEMM is the same product; only when it runs differs).  The same for the experts (both
implementations, the grouped GEMM's padded and ``torch._grouped_mm`` paths) and the tied output layer
(the fused loss and the separate GEMM).
"""
import pytest
import torch

from ds_megatron.config.model import GPTConfig
from ds_megatron.models.gpt import language_model_head
from ds_megatron.moe.experts import GroupedMLP, SequentialMLP
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


def _deferred_then_run(module, loss_of, x):
    """Backward of ``loss_of(module, x)`` deferring, checked to leave every weight gradient for W; then W.
    Returns (input gradient, {name: gradient}) after W."""
    store = WeightGradStore()
    assert attach_weight_grad_store(module, store) > 0
    x = x.clone().requires_grad_()
    with store.deferring("mb0"):
        loss_of(module, x).backward()
    assert all(p.grad is None for p in module.parameters())
    assert store.pending == ["mb0"]
    store.run("mb0")
    return x.grad, {n: p.grad for n, p in module.named_parameters()}


def _autograd(module, loss_of, x):
    x = x.clone().requires_grad_()
    loss_of(module, x).backward()
    return x.grad, {n: p.grad for n, p in module.named_parameters()}


def _experts(cls, dtype, grouped_mm=None):
    torch.manual_seed(0)
    experts = cls(4, 8, 12, ep=ParallelGroup.single("ep"), etp=ParallelGroup.single("etp"), params_dtype=dtype,
                  gated_linear_unit=True, activation="silu")
    if grouped_mm is not None:
        experts.use_grouped_mm = grouped_mm
    return experts


TOKENS_PER_EXPERT = [3, 0, 5, 2]  # an expert without tokens too


def _experts_loss(experts, x):
    probs = torch.linspace(0.1, 0.9, x.size(0), dtype=x.dtype)
    return (experts(x, TOKENS_PER_EXPERT, probs) ** 2).sum()


@pytest.mark.parametrize("cls, dtype, grouped_mm", [
    (SequentialMLP, torch.float64, None), (GroupedMLP, torch.float64, False),
    pytest.param(GroupedMLP, torch.float32, True, marks=pytest.mark.skipif(
        not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm missing"))],
    ids=["sequential", "grouped-padded-bmm", "grouped-mm"])
def test_deferred_expert_weight_grads_equal_autograd(cls, dtype, grouped_mm):
    x = torch.randn(sum(TOKENS_PER_EXPERT), 8, dtype=dtype)
    ref_x, ref = _autograd(_experts(cls, dtype, grouped_mm), _experts_loss, x)
    got_x, got = _deferred_then_run(_experts(cls, dtype, grouped_mm), _experts_loss, x)
    assert torch.equal(got_x, ref_x)
    assert ref.keys() == got.keys() and all(torch.equal(got[n], ref[n]) for n in ref), \
        {n: (got[n] - ref[n]).abs().max().item() for n in ref}


class _TiedHead(torch.nn.Module):
    """The tied output layer and loss of a GPT (``language_model_head``), its weight the word embedding's."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(64, 8, dtype=dtype))
        self.weight_grad_store = None
        self.config = GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=6, vocab_size=60,
                                make_vocab_size_divisible_by=64)

    def forward(self, hidden, labels):
        return language_model_head(hidden, self.weight, None, labels, None, self.config, ParallelGroup.single("tp"),
                                   ParallelGroup.single("cp"), None, self.weight_grad_store)


LABELS = torch.randint(0, 60, (2, 6), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("path", ["fused-loss", "logits"])
def test_deferred_tied_output_weight_grad_equals_autograd(path):
    """The fused loss (fp32/float64 weights with labels) and the separate GEMM (the logits, here without labels
    and a float64 loss of them) defer the tied weight's gradient."""
    def loss_of(head, hidden):
        if path == "fused-loss":
            return head(hidden, LABELS)
        return (head(hidden, None) ** 2).sum()
    hidden = torch.randn(6, 2, 8, dtype=torch.float64)  # [s, b, h]
    ref_x, ref = _autograd(_TiedHead(torch.float64), loss_of, hidden)
    got_x, got = _deferred_then_run(_TiedHead(torch.float64), loss_of, hidden)
    assert torch.equal(got_x, ref_x)
    assert torch.equal(got["weight"], ref["weight"])


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential-experts", "grouped-experts"])
def test_a_moe_gpt_defers_every_linear_and_expert_weight_and_the_tied_output(grouped):
    """A whole MoE GPT (tied, float64, one rank): under deferring, backward leaves the gradients of every
    column / row-parallel weight, every expert weight and the output layer's part of the tied embedding for W;
    what arrives at once is the rest (norms, biases, router, the embedding lookups); after W every
    gradient equals plain autograd's."""
    from ds_megatron.models.gpt import GPTModel

    def model():
        torch.manual_seed(0)
        return GPTModel(GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=64,
                                  num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_grouped_gemm=grouped,
                                  hidden_dropout=0.0, attention_dropout=0.0)).double()
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    reference = model()
    reference(batch).backward()
    gpt = model()
    store = WeightGradStore()
    attach_weight_grad_store(gpt, store)
    with store.deferring("mb0"):
        gpt(batch).backward()
    at_once = {n for n, p in gpt.named_parameters() if p.grad is not None}
    expected_at_once = {n for n, p in gpt.named_parameters()
                        if p.dim() == 1 or ".router." in n or n.endswith("embeddings.weight")}
    assert at_once == expected_at_once
    assert not torch.equal(gpt.word_embeddings.weight.grad, reference.word_embeddings.weight.grad)  # W still due
    store.run("mb0")
    for (name, p), q in zip(gpt.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-12), name
