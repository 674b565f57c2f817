"""vocab_parallel_cross_entropy against torch's cross_entropy on the full
logits (loss and gradient), with label smoothing and vocab padding, and a
check that the full logits are never communicated."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run_on_ranks
from ds_megatron.parallel_state import ParallelGroup
from tp_helpers import close, part, randn, tp_group
from ds_megatron.tensor_parallel import LogitsBuffer, linear_vocab_parallel_cross_entropy, vocab_parallel_cross_entropy

S, B, VP = 3, 2, 16  # [seq, batch, padded vocab]


ONE = ParallelGroup.single("tp")


def _check(tp, label_smoothing, vocab_size, inplace=False):
    with tp_group(tp) as (g, r, n):
        true_v = vocab_size or VP
        L = 3.0 * randn(1, S, B, VP)
        L[..., true_v:] = 50.0  # padding columns with huge logits: must never win
        target = torch.randint(0, true_v, (S, B), generator=torch.Generator().manual_seed(2))
        target[0, 0], target[0, 1] = 0, true_v - 1
        w = randn(3, S, B)  # per-token weights, like a loss mask

        Ld = L[..., :true_v].clone().requires_grad_()
        ref = F.cross_entropy(Ld.reshape(-1, true_v), target.reshape(-1), reduction="none",
                              label_smoothing=label_smoothing).view(S, B)
        (ref * w).sum().backward()
        want_grad = torch.cat([Ld.grad, torch.zeros(S, B, VP - true_v, dtype=torch.float64)], dim=-1)

        local = part(L, -1, r, n).clone().requires_grad_()
        before = local.detach().clone()
        # In place: the logits handed over are a product made just before (as the GPT's output layer).
        logits = local * 1.0 if inplace else local
        loss = vocab_parallel_cross_entropy(logits, target, g, label_smoothing=label_smoothing, vocab_size=vocab_size,
                                            inplace=inplace)
        assert loss.shape == target.shape
        close(loss, ref.detach(), "per-token loss")
        (loss * w).sum().backward()
        close(local.grad, part(want_grad, -1, r, n), "logits grad slice")
        assert torch.equal(local.detach(), before), "the logits were modified in place"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("vocab_size", [None, 11])  # 11 of 16: at TP=4 the last rank holds only padding
def test_matches_torch_cross_entropy(tp, label_smoothing, vocab_size):
    run_on_ranks(tp, _check, tp, label_smoothing, vocab_size)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("vocab_size", [None, 11])
def test_in_place_matches_torch_cross_entropy(label_smoothing, vocab_size):
    run_on_ranks(4, _check, 4, label_smoothing, vocab_size, True)


def test_in_place_computes_the_gradient_in_the_logits_storage():
    leaf = randn(3, S, B, VP).requires_grad_()
    logits = leaf * 1.0
    seen = []
    logits.register_hook(lambda grad: seen.append(grad.data_ptr()))
    target = torch.randint(0, VP, (S, B), generator=torch.Generator().manual_seed(2))
    vocab_parallel_cross_entropy(logits, target, ONE, inplace=True).sum().backward()
    assert seen == [logits.data_ptr()], "the gradient was made in another [.., V] buffer"
    ref = leaf.detach().clone().requires_grad_()
    F.cross_entropy(ref.view(-1, VP), target.view(-1), reduction="sum").backward()
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("inplace", [False, True])
def test_a_second_backward_through_the_same_graph_fails_loudly(inplace):
    # backward turns the saved softmax into the gradient in place; torch's saved-tensor check refuses reuse.
    leaf = randn(4, S, B, VP).requires_grad_()
    target = torch.randint(0, VP, (S, B), generator=torch.Generator().manual_seed(2))
    loss = vocab_parallel_cross_entropy(leaf * 1.0, target, ONE, inplace=inplace).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


HID = 5


def _check_linear(tp, label_smoothing, vocab_size):
    """The output layer + loss against F.linear + torch's cross entropy, on the full weight."""
    with tp_group(tp) as (g, r, n):
        true_v = vocab_size or VP
        hidden = randn(5, S, B, HID)
        weight = randn(6, VP, HID)
        weight[true_v:] = 10.0  # padding rows with large logits: must never win
        target = torch.randint(0, true_v, (S, B), generator=torch.Generator().manual_seed(2))
        w = randn(3, S, B)
        ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        ref = F.cross_entropy(F.linear(ref_h, ref_w[:true_v]).reshape(-1, true_v), target.reshape(-1),
                              reduction="none", label_smoothing=label_smoothing).view(S, B)
        (ref * w).sum().backward()

        h = hidden.clone().requires_grad_()
        shard = part(weight, 0, r, n).clone().requires_grad_()
        buffer = LogitsBuffer()
        for step in range(2):  # the second step reuses the first one's buffer
            h.grad = shard.grad = None
            loss = linear_vocab_parallel_cross_entropy(h, shard, target, g, label_smoothing=label_smoothing,
                                                       vocab_size=vocab_size, buffer=buffer)
            close(loss, ref.detach(), "per-token loss")
            (loss * w).sum().backward()
            grad_h = h.grad.clone()
            dist.all_reduce(grad_h, group=g.group)  # the copy-to region's backward sums it over TP
            close(grad_h, ref_h.grad, "hidden grad")
            close(shard.grad, part(ref_w.grad, 0, r, n), "weight grad slice")


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("vocab_size", [None, 11])
def test_output_layer_and_loss_match_linear_then_torch_cross_entropy(tp, label_smoothing, vocab_size):
    run_on_ranks(tp, _check_linear, tp, label_smoothing, vocab_size)


def test_logits_buffer_is_reused_and_never_overwritten_before_its_backward():
    hidden = randn(5, S, B, HID).requires_grad_()
    weight = randn(6, VP, HID).requires_grad_()
    targets = [torch.randint(0, VP, (S, B), generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def reference(target):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        F.cross_entropy(F.linear(h, w).reshape(-1, VP), target.reshape(-1), reduction="sum").backward()
        return h.grad, w.grad

    buffer = LogitsBuffer()
    # Two forwards before their backwards (as a pipeline schedule runs them): the second gets its own buffer.
    first = linear_vocab_parallel_cross_entropy(hidden, weight, targets[0], ONE, buffer=buffer).sum()
    second = linear_vocab_parallel_cross_entropy(hidden, weight, targets[1], ONE, buffer=buffer).sum()
    for loss, target in ((second, targets[1]), (first, targets[0])):
        hidden.grad = weight.grad = None
        loss.backward()
        want_h, want_w = reference(target)
        torch.testing.assert_close(hidden.grad, want_h, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(weight.grad, want_w, rtol=1e-10, atol=1e-12)
    # After its backward the buffer serves the next forward: the same storage, step after step.
    ptrs = set()
    for _ in range(3):
        loss = linear_vocab_parallel_cross_entropy(hidden, weight, targets[0], ONE, buffer=buffer).sum()
        ptrs.add(buffer._tensor.data_ptr())
        loss.backward()
    assert len(ptrs) == 1


def test_output_layer_in_bf16_gives_an_fp32_loss_and_bf16_grads():
    # Inputs on a 1/8 grid (|x| < 2): products are multiples of 1/64 and every partial sum of the 5-term dot
    # products is exact in float32, so any bf16 GEMM that accumulates in float32 (in whatever order, AVX2 or
    # AVX-512 BF16 kernels) returns the same bf16 logits: the exact sums rounded once.  With random bf16 inputs,
    # two of these 96 logits sat on a bf16 rounding midpoint, where the summation order picks the neighbour
    # (one bf16 ulp, ~4e-3 in the logit).
    def on_grid(x):
        return (x * 8).round().clamp(-15, 15) / 8

    hidden = on_grid(randn(5, S, B, HID)).bfloat16().requires_grad_()
    weight = on_grid(randn(6, VP, HID)).bfloat16().requires_grad_()
    target = torch.randint(0, VP, (S, B), generator=torch.Generator().manual_seed(2))
    loss = linear_vocab_parallel_cross_entropy(hidden, weight, target, ONE)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    exact = F.linear(hidden.detach().double(), weight.detach().double())
    assert torch.equal(exact.float().double(), exact), "the grid no longer keeps the products exact in float32"
    logits = exact.bfloat16()  # the bf16 GEMM's product, whatever its summation order
    ref = F.cross_entropy(logits.double().view(-1, VP), target.view(-1), reduction="none").view(S, B)
    # Our float32 softmax over 16 logits of |z| < 8 against float64: a few eps32 x (|z| + log 16) ~ 1e-6.
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


def _communication_volume():
    """Record every collective while computing the loss: only per-token scalars may travel."""
    seen = []
    # all_gather_single is torch >= 2.13's name; older torch (2.11 on the GPU machine) has only the older one.
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_gather_into_tensor",
                                                   "all_gather_single", "broadcast") if hasattr(dist, name)}

    def spy(name):
        def call(tensor, *args, **kwargs):
            t = tensor if torch.is_tensor(tensor) else args[0]
            seen.append((name, t.numel()))
            return real[name](tensor, *args, **kwargs)
        return call
    try:
        for name in real:
            setattr(dist, name, spy(name))
        local = randn(1, S, B, VP // 2).requires_grad_()
        target = torch.randint(0, VP, (S, B), generator=torch.Generator().manual_seed(2))
        world = ParallelGroup("tp", tuple(range(dist.get_world_size())), dist.get_rank(), dist.group.WORLD)
        loss = vocab_parallel_cross_entropy(local, target, world, label_smoothing=0.1)
        loss.sum().backward()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return seen


def test_full_logits_are_never_communicated():
    seen = run_on_ranks(2, _communication_volume)[0]
    # one max (S*B) and one stacked sum (3*S*B: target logit, sum of logits, sum of exp); backward is local
    assert seen == [("all_reduce", S * B), ("all_reduce", 3 * S * B)], seen


def test_low_precision_logits_give_an_fp32_loss_and_grads_in_their_dtype():
    # TP=1 (a group of one) exercises the same math without communication.
    L = randn(1, S, B, VP).float()
    target = torch.randint(0, VP, (S, B), generator=torch.Generator().manual_seed(2))
    local = L.bfloat16().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target.int(), ONE)  # int32 ids are accepted
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert local.grad.dtype == torch.bfloat16
    ref = F.cross_entropy(local.detach().double().view(-1, VP), target.view(-1), reduction="none").view(S, B)
    # The same bf16 logits, widened exactly: our float32 softmax against float64, a few eps32 x |loss|.
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


def test_invalid_arguments_are_refused():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_cross_entropy(logits, torch.zeros(3, dtype=torch.long), ONE)
    with pytest.raises(ValueError, match="label_smoothing=1.5"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, dtype=torch.long), ONE, label_smoothing=1.5)
    with pytest.raises(ValueError, match="vocab_size=9"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, dtype=torch.long), ONE, vocab_size=9)
