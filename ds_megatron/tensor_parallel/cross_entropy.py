"""Cross entropy over vocab-parallel logits, without ever gathering the logits.

Each TP rank holds logits ``[..., V/tp]`` for its vocab slice (the output of
a ColumnParallelLinear / tied embedding with ``gather_output=False``).  The
loss needs only per-token scalars from each rank, so instead of all-gathering
``b*s*V`` logits we communicate ``b*s`` numbers twice (the paper's fused
cross entropy, section 3):

1. all-reduce MAX of the row maxima (numerical stability);
2. one all-reduce SUM of three per-token scalars: the target's logit (only
   the owning rank contributes it), the sum of exp, and the sum of logits
   (the last only when label smoothing needs it).

Backward is local: ``softmax - (1 - ls) * one_hot(target) - ls / K`` on the
real vocab columns, times the incoming per-token gradient.

Memory: one [..., V/tp] buffer for the whole forward and backward, as in
megatron-core: the max is subtracted in place, ``exp`` overwrites the shifted
logits, and backward turns that buffer into the gradient in place.  The buffer
is a copy of the logits, or with ``inplace=True`` the logits themselves.

``linear_vocab_parallel_cross_entropy`` (what the GPT calls) also owns the
output layer's GEMMs: it computes the logits transposed, ``E @ x^T`` into
``[V/tp, tokens]`` (on CPU about 1.3x the rate of ``x @ E^T``), into a
``LogitsBuffer`` kept from step to step (a fresh buffer of 32 MiB or more is a
new mapping and a page fault per page on every step), and the loss reduces
over dim 0.

Label smoothing follows torch's convention (``F.cross_entropy(...,
label_smoothing=ls)``): the ``ls`` mass is spread uniformly over all ``K``
classes *including* the target, i.e. ``loss = (1 - ls) * nll + ls * mean_k(-log
p_k)``.  (Megatron spreads it over the ``K - 1`` other classes instead; the
two differ by a rescaling of ``ls``.)

Vocab padding: pass ``vocab_size`` (the true vocab size) and the padded
columns ``>= vocab_size`` are treated as ``-inf`` logits: they get zero
probability and zero gradient, and ``K = vocab_size`` in the smoothing term.
Without it every column is a real class.

There is no ``ignore_index``: mask the per-token loss with a loss mask, as
Megatron does; targets must lie in ``[0, vocab_size)``.
"""
from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch

from ..parallel_state import ParallelGroup
from ..utils.collectives import MAX, all_reduce
from .utils import vocab_range_from_per_partition_vocab_size
from .weight_grad_store import weight_grad_or_defer


def _cross_entropy_forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: ParallelGroup,
                           label_smoothing: float, vocab_size: Optional[int], dim: int) -> Tuple[torch.Tensor, tuple]:
    """``(loss, tensors to save)`` from ``logits`` (this rank's vocab slice along ``dim``), worked in ``logits``.

    Sets on ``ctx`` the constants ``_cross_entropy_grad_`` needs; the caller saves the tensors.
    ``logits`` ends as exp(logits - max), the unnormalized softmax (backward folds 1/sum into the
    incoming gradient: one pass over the buffer instead of a division here and a product there).
    """
    partition_vocab = logits.size(dim)
    world, rank = group.size, group.rank
    start, end = vocab_range_from_per_partition_vocab_size(partition_vocab, rank, world)
    global_vocab = partition_vocab * world
    num_classes = global_vocab if vocab_size is None else vocab_size
    if not 0 < num_classes <= global_vocab:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {global_vocab}] (the padded vocab "
                         f"size: {partition_vocab} logits per rank x {world} ranks)")
    valid = None
    if num_classes < global_vocab:
        # Entries of this slice that are real vocab entries (the rest is padding).
        valid = torch.arange(start, end, device=logits.device) < num_classes
        logits.masked_fill_(~(valid if dim == -1 else valid.unsqueeze(-1)), float("-inf"))

    # A rank holding only padding has -inf maxima; the MAX over ranks is still finite.
    logits_max = logits.amax(dim=dim)
    all_reduce(logits_max, group, op=MAX)
    logits.sub_(logits_max.unsqueeze(dim))

    target = target.long()  # gather/scatter need int64 indices
    target_outside = (target < start) | (target >= end)
    local_target = (target - start).masked_fill(target_outside, 0)
    target_logit = logits.gather(dim, local_target.unsqueeze(dim)).squeeze(dim).masked_fill(target_outside, 0.0)

    stats = [target_logit]
    if label_smoothing > 0.0:
        shifted = logits if valid is None else logits.masked_fill(
            ~(valid if dim == -1 else valid.unsqueeze(-1)), 0.0)
        stats.append(shifted.sum(dim=dim))
    exp_logits = logits.exp_()  # in the buffer: only exp(logits - max) is needed from here on
    stats.append(exp_logits.sum(dim=dim))
    stats = torch.stack(stats)
    all_reduce(stats, group)
    target_logit, sum_exp = stats[0], stats[-1]

    log_sum_exp = torch.log(sum_exp)
    loss = log_sum_exp - target_logit
    if label_smoothing > 0.0:
        # mean_k(-log p_k) = log_sum_exp - mean_k(shifted logit_k)
        smooth = log_sum_exp - stats[1] / num_classes
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth

    ctx.has_valid = valid is not None
    ctx.label_smoothing = label_smoothing
    ctx.num_classes = num_classes
    ctx.dim = dim
    return loss, (exp_logits, sum_exp, target_outside, local_target, valid if valid is not None else torch.empty(0))


def _cross_entropy_grad_(ctx, grad_loss: torch.Tensor, saved: tuple) -> torch.Tensor:
    """The logits' gradient, made in the saved buffer: ``softmax - (1 - ls) one_hot - ls / K``, times ``grad_loss``.

    A second backward through the same graph (retain_graph) fails on torch's check that
    saved tensors were not modified, never silently.
    """
    exp_logits, sum_exp, target_outside, local_target, valid = saved
    ls, dim = ctx.label_smoothing, ctx.dim
    grad_loss = grad_loss.to(exp_logits.dtype)
    grad = exp_logits.mul_((grad_loss / sum_exp).unsqueeze(dim))  # softmax x incoming gradient
    owned = (~target_outside).to(grad.dtype)
    grad.scatter_add_(dim, local_target.unsqueeze(dim), (-(1.0 - ls) * owned * grad_loss).unsqueeze(dim))
    if ls > 0.0:
        uniform = (ls / ctx.num_classes) * grad_loss.unsqueeze(dim)
        if ctx.has_valid:
            uniform = uniform * valid.to(grad.dtype).view(-1 if dim == -1 else (-1, 1))
        grad.sub_(uniform)
    return grad


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, group, label_smoothing, vocab_size, inplace):
        input_dtype = vocab_parallel_logits.dtype
        # Reduced-precision logits are handled in fp32 (softmax of a large vocab in bf16 is too coarse).
        compute_dtype = torch.promote_types(input_dtype, torch.float32)
        # The work buffer: the caller's logits themselves when they are handed over (inplace) and
        # already in the compute dtype, else a copy this function owns.
        if inplace and input_dtype == compute_dtype and vocab_parallel_logits.is_contiguous():
            logits = vocab_parallel_logits.detach()
        else:
            logits = vocab_parallel_logits.to(compute_dtype, copy=True)
        ctx.input_dtype = input_dtype
        loss, saved = _cross_entropy_forward(ctx, logits, target, group, label_smoothing, vocab_size, dim=-1)
        ctx.save_for_backward(*saved)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad = _cross_entropy_grad_(ctx, grad_loss, ctx.saved_tensors)
        return grad.to(ctx.input_dtype), None, None, None, None, None


class LogitsBuffer:
    """One ``[V/tp, tokens]`` logits buffer kept from step to step for ``linear_vocab_parallel_cross_entropy``.

    Busy from a forward until that forward's backward has run (or its graph
    was dropped); a forward that finds it busy (two forwards before a
    backward) gets a fresh tensor instead, so reuse never overwrites logits a
    pending backward still needs.
    """

    def __init__(self):
        self._tensor: Optional[torch.Tensor] = None
        self._user = None  # weakref to the autograd ctx whose backward still needs the buffer

    def acquire(self, ctx, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        user = self._user() if self._user is not None else None
        if user is not None and not getattr(user, "backward_done", False):
            return torch.empty(shape, dtype=dtype, device=device)
        t = self._tensor
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != torch.device(device):
            self._tensor = t = torch.empty(shape, dtype=dtype, device=device)
        self._user = weakref.ref(ctx)
        return t


class _LinearVocabParallelCrossEntropy(torch.autograd.Function):
    """The output layer and the loss: logits^T = weight @ hidden^T, cross entropy over dim 0."""

    @staticmethod
    def forward(ctx, hidden, weight, target, group, label_smoothing, vocab_size, buffer, store):
        x = hidden.reshape(-1, hidden.size(-1))  # [tokens, h]
        ctx.store = store
        shape = (weight.size(0), x.size(0))
        compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
        ctx.backward_done = False
        logits = (buffer.acquire(ctx, shape, compute_dtype, hidden.device) if buffer is not None
                  else torch.empty(shape, dtype=compute_dtype, device=hidden.device))
        if weight.dtype == compute_dtype:
            torch.mm(weight, x.t(), out=logits)
        else:  # 16-bit GEMM, its product widened for the softmax
            logits.copy_(torch.mm(weight, x.t()))
        loss, saved = _cross_entropy_forward(ctx, logits, target.reshape(-1), group, label_smoothing, vocab_size,
                                             dim=0)
        ctx.save_for_backward(*saved, x, weight)
        ctx.hidden_shape = hidden.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        *saved, x, weight = ctx.saved_tensors
        grad = _cross_entropy_grad_(ctx, grad_loss.reshape(-1), saved).to(weight.dtype)  # [V/tp, tokens]
        grad_hidden = torch.mm(grad.t(), weight).view(ctx.hidden_shape) if ctx.needs_input_grad[0] else None
        # W deferred: the logits' gradient lives on to it (never in a buffer, see the caller)
        grad_weight = weight_grad_or_defer(ctx.store, weight, lambda: torch.mm(grad, x)) \
            if ctx.needs_input_grad[1] else None
        ctx.backward_done = True  # the buffer may serve the next forward
        return grad_hidden, grad_weight, None, None, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 tp: ParallelGroup, label_smoothing: float = 0.0,
                                 vocab_size: Optional[int] = None, inplace: bool = False) -> torch.Tensor:
    """Per-token cross entropy of vocab-parallel logits; returns a tensor shaped like ``target``.

    ``vocab_parallel_logits``: ``[..., V_padded / tp]``, this rank's vocab
    slice (contiguous ranges, rank order).  ``target``: ``[...]`` global ids.
    ``vocab_size``: the true vocab size when the vocab was padded (padding
    columns are excluded); None means every column is real.  The loss is in
    fp32 for fp16/bf16 logits (float64 stays float64); the logits' gradient
    has their dtype.

    ``inplace=True`` hands the logits over (megatron-core's fused cross entropy
    always does this): fp32/float64 logits are overwritten with the softmax and
    then with their own gradient, so no [..., V] copy is made.  Pass it only for
    logits nothing else reads, such as the output layer's product made just
    before the call; leaving it False keeps the caller's tensor intact.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if tuple(vocab_parallel_logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"target shape {tuple(target.shape)} must equal the logits' leading shape "
                         f"{tuple(vocab_parallel_logits.shape[:-1])}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp, float(label_smoothing),
                                            vocab_size, inplace)


def linear_vocab_parallel_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                        tp: ParallelGroup, label_smoothing: float = 0.0,
                                        vocab_size: Optional[int] = None,
                                        buffer: Optional[LogitsBuffer] = None,
                                        weight_grad_store=None) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(F.linear(hidden, weight), target, ...)``, the output layer included.

    ``hidden``: ``[..., h]``, the same on every TP rank (the caller's copy-to / gather
    region provides it); ``weight``: this rank's ``[V_padded / tp, h]`` vocab rows (the
    tied embedding shard); ``target``: ``hidden.shape[:-1]`` global ids.  Same loss and
    gradients; the logits never reach the caller, which is what lets them be computed
    transposed into ``buffer`` (see the module docstring).  ``weight_grad_store``: the zero-bubble schedule's
    ``WeightGradStore``, which may defer the weight's gradient (then the logits' gradient is kept until it
    runs, so no ``buffer`` with it).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if tuple(hidden.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"target shape {tuple(target.shape)} must equal the hidden states' leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.size(1) != hidden.size(-1):
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not map hidden size {hidden.size(-1)} "
                         "to this rank's vocab slice; pass the [V_padded / tp, h] embedding shard")
    if buffer is not None and weight_grad_store is not None:
        raise ValueError("a logits buffer is reused by the next forward, but a deferred weight gradient keeps "
                         "the logits' gradient (which lives there) until it runs: pass one of them")
    return _LinearVocabParallelCrossEntropy.apply(hidden, weight, target, tp, float(label_smoothing), vocab_size,
                                                  buffer, weight_grad_store)
