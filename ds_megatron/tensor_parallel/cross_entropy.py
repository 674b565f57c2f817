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
is a copy of the logits, or with ``inplace=True`` (the GPT's own output-layer
product) the logits themselves.

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

from typing import Optional

import torch

from ..parallel_state import ParallelGroup
from ..utils.collectives import MAX, all_reduce
from .utils import vocab_range_from_per_partition_vocab_size


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, group, label_smoothing, vocab_size, inplace):
        input_dtype = vocab_parallel_logits.dtype
        # Reduced-precision logits are handled in fp32 (softmax of a large vocab in bf16 is too coarse).
        compute_dtype = torch.promote_types(input_dtype, torch.float32)
        partition_vocab = vocab_parallel_logits.size(-1)
        world, rank = group.size, group.rank
        start, end = vocab_range_from_per_partition_vocab_size(partition_vocab, rank, world)
        global_vocab = partition_vocab * world
        num_classes = global_vocab if vocab_size is None else vocab_size
        if not 0 < num_classes <= global_vocab:
            raise ValueError(f"vocab_size={vocab_size} must be in (0, {global_vocab}] (the padded vocab "
                             f"size: {partition_vocab} logits per rank x {world} ranks)")

        # The work buffer: the caller's logits themselves when they are handed over (inplace) and
        # already in the compute dtype, else a copy this function owns.  Either way the softmax is
        # computed in it and backward turns it into the gradient in place: no further [.., V] buffer.
        if inplace and input_dtype == compute_dtype and vocab_parallel_logits.is_contiguous():
            logits = vocab_parallel_logits.detach()
        else:
            logits = vocab_parallel_logits.to(compute_dtype, copy=True)
        valid = None
        if num_classes < global_vocab:
            # Columns of this slice that are real vocab entries (the rest is padding).
            valid = torch.arange(start, end, device=logits.device) < num_classes
            logits.masked_fill_(~valid, float("-inf"))

        # A rank holding only padding has -inf maxima; the MAX over ranks is still finite.
        logits_max = logits.amax(dim=-1)
        all_reduce(logits_max, group, op=MAX)
        logits.sub_(logits_max.unsqueeze(-1))

        target = target.long()  # gather/scatter need int64 indices
        target_outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(target_outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(target_outside, 0.0)

        stats = [target_logit]
        if label_smoothing > 0.0:
            stats.append(logits.sum(dim=-1) if valid is None else logits.masked_fill(~valid, 0.0).sum(dim=-1))
        exp_logits = logits.exp_()  # in the buffer: only exp(logits - max) is needed from here on
        stats.append(exp_logits.sum(dim=-1))
        stats = torch.stack(stats)
        all_reduce(stats, group)
        target_logit, sum_exp = stats[0], stats[-1]

        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - target_logit
        if label_smoothing > 0.0:
            # mean_k(-log p_k) = log_sum_exp - mean_k(shifted logit_k)
            smooth = log_sum_exp - stats[1] / num_classes
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth

        # The softmax stays unnormalized (exp and its row sums): backward folds 1/sum into the
        # incoming gradient, one pass over the buffer instead of a division here and a product there.
        ctx.save_for_backward(exp_logits, sum_exp, target_outside, local_target,
                              valid if valid is not None else torch.empty(0))
        ctx.has_valid = valid is not None
        ctx.label_smoothing = label_smoothing
        ctx.num_classes = num_classes
        ctx.input_dtype = input_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # The saved buffer becomes the gradient, in place: a second backward through the same graph
        # (retain_graph) fails on torch's check that saved tensors were not modified, never silently.
        exp_logits, sum_exp, target_outside, local_target, valid = ctx.saved_tensors
        ls = ctx.label_smoothing
        grad_loss = grad_loss.to(exp_logits.dtype)
        grad = exp_logits.mul_((grad_loss / sum_exp).unsqueeze(-1))  # softmax x incoming gradient
        owned = (~target_outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (-(1.0 - ls) * owned * grad_loss).unsqueeze(-1))
        if ls > 0.0:
            uniform = (ls / ctx.num_classes) * grad_loss.unsqueeze(-1)
            grad.sub_(uniform * valid.to(grad.dtype) if ctx.has_valid else uniform)
        return grad.to(ctx.input_dtype), None, None, None, None, None


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
