"""``finalize_model_grads``: where the gradient sync of one step ends (Megatron's function of the same name).

After the last micro-batch's backward, and before the optimizer reads any
gradient, in this order:

1. every model chunk's ``DistributedDataParallel`` finishes its bucketed
   reductions (dense grads averaged over dp-cp, expert grads over their
   expert-data-parallel group; with the distributed optimizer each rank's shard);
2. the all-reduce across model-parallel copies: gradients of parameters that
   are replicated over tensor parallelism but saw only this rank's slice of the
   sequence (``sequence_parallel``: LayerNorm weights, row-parallel biases, the
   router under sequence parallelism) or its heads (q/k norms) are summed over
   TP, and the KV projection's copies (``tp_replica_slot``) over the ranks of
   their group, in one all-reduce;
3. under pipeline parallelism, the two copies of the tied word embedding
   (first stage's input, last stage's output layer; marked ``shared_embedding``),
   and with multi-token prediction those of the word and position embeddings
   (the last stage embeds tokens too), sum their gradients over the ``embedding``
   group, so that both apply the gradient of the one weight they stand for.  With the distributed optimizer
   each copy sits alone in its bucket, whose shards are then the same slice of
   the weight on both stages, so the reduced shard is summed with its peer.

4. the aux-loss-free expert bias of every router that has one moves once, from the step's token counts
   summed over the ranks routing for the same experts (``moe.router.update_expert_bias``: the
   sequence group, then dp), Megatron's place for it.
5. the delayed fp8 recipe's amax histories and scales advance once (``fp8.update_delayed_scaling``: this step's
   amaxes, MAX over TP, then over dp-cp, the ranks whose replicas saw other data; an expert's over ETP, then
   expert-DP: ``fp8.delayed_scaling_groups``), after the last micro-batch's
   backward and before the next step's forward, so the scales stay the same for every micro-batch of a step.  It
   is the once-per-step model state next to the expert bias, and sits before the optimizer's inf/nan check: a
   skipped step advances the history too, as Transformer Engine's update knows nothing of the optimizer (an
   inf/nan amax enters the history and keeps the previous scale while it is the one the algorithm reads).

The Megatron optimizer wrappers call it at the start of ``step()``, the one
point of a DeepSpeed loop that every rank reaches once per accumulation window.
It runs once per window: a second call (a loop that wants the reduced
gradients before the step, ``engine.megatron.finalize_model_grads()``) does
nothing until the buffers are zeroed for the next window.
"""
from __future__ import annotations

from typing import Sequence

from ..fp8 import delayed_scaling_groups, update_delayed_scaling
from ..moe.router import expert_bias_routers, update_expert_bias
from ..parallel_state import ParallelState
from ..tensor_parallel.layers import fp8_states
from ..tensor_parallel.params import allreduce_tp_partial_grads, grad_of, tp_partial_params
from ..utils.collectives import all_reduce
from .distributed_data_parallel import DistributedDataParallel


def finalize_model_grads(model_chunks: Sequence[DistributedDataParallel], parallel_state: ParallelState) -> None:
    chunks = [chunk for chunk in model_chunks if not chunk.grads_finalized]
    for chunk in chunks:
        chunk.finish_grad_sync()
    for chunk in chunks:
        allreduce_tp_partial_grads(tp_partial_params(chunk.module), parallel_state.tp)
    if parallel_state.pp.size > 1:
        tied = [p for chunk in chunks for p in chunk.module.parameters()
                if getattr(p, "shared_embedding", False) and grad_of(p) is not None]
        for p in tied:  # only first and last stage hold them, and those are in the embedding group
            all_reduce(grad_of(p), parallel_state["embedding"])
    update_expert_bias(expert_bias_routers(chunk.module for chunk in chunks))
    update_delayed_scaling([s for chunk in chunks for s in fp8_states(chunk.module)],
                           delayed_scaling_groups(parallel_state))
    for chunk in chunks:
        chunk.grads_finalized = True
