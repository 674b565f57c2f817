"""Tensor (and sequence) parallelism from section 3 of the Megatron-LM paper.

| module | concept |
| --- | --- |
| ``mappings`` | the conjugate communication operators (f/g, split/gather, sequence-parallel reduce-scatter/gather) |
| ``layers`` | ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding`` |
| ``cross_entropy`` | ``vocab_parallel_cross_entropy``: loss on vocab-split logits without gathering them; ``linear_vocab_parallel_cross_entropy``: the output layer included, logits in a reused ``LogitsBuffer`` |
| ``random`` | ``RNGStatesTracker``: per-TP-rank dropout streams, checkpointable; ``checkpoint`` (recomputation), ``is_recomputing`` (inside any checkpoint's rerun), ``is_reentrant_rerun`` (a rerun whose graph is backpropagated) |
| ``init`` | TP-size-independent weight initialization |
| ``params`` | parameter attributes (TP split, sequence parallel, experts, ``main_grad``) and the grad sync they imply |
| ``utils`` | ``divide``, vocab ranges, vocab padding (pure) |

Every function and layer takes its TP group explicitly, as a ``ParallelGroup``
(``group`` / ``tp``); a group of one means no tensor parallelism.
"""
from .cross_entropy import LogitsBuffer, linear_vocab_parallel_cross_entropy, vocab_parallel_cross_entropy
from .init import init_method_normal, initialize_affine_weight_cpu, scaled_init_method_normal
from .layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                       scatter_to_tensor_model_parallel_region)
from .params import (allreduce_tp_partial_grads, expert_group_name, grad_of, is_expert_param,
                     mark_expert_param, mark_sequence_parallel, mark_tp_replica, param_is_not_tensor_parallel_duplicate,
                     register_tp_partial_grad_hooks, tp_partial_params,
                     set_defaults_if_not_set_tensor_model_parallel_attributes, set_tensor_model_parallel_attributes)
from .random import (RNGStatesTracker, checkpoint, get_cuda_rng_tracker, get_rng_tracker, is_recomputing,
                     is_reentrant_rerun, model_parallel_seed)
from .utils import (divide, pad_vocab_size, vocab_range_from_global_vocab_size,
                    vocab_range_from_per_partition_vocab_size)

__all__ = [
    "ColumnParallelLinear", "ReplicatedLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "linear_vocab_parallel_cross_entropy", "LogitsBuffer",
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "RNGStatesTracker", "checkpoint", "is_recomputing", "is_reentrant_rerun", "get_rng_tracker", "get_cuda_rng_tracker",
    "model_parallel_seed",
    "init_method_normal", "scaled_init_method_normal", "initialize_affine_weight_cpu",
    "allreduce_tp_partial_grads", "register_tp_partial_grad_hooks", "mark_sequence_parallel", "mark_tp_replica",
    "tp_partial_params", "param_is_not_tensor_parallel_duplicate", "expert_group_name", "mark_expert_param",
    "is_expert_param", "grad_of",
    "set_tensor_model_parallel_attributes", "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "divide", "pad_vocab_size", "vocab_range_from_global_vocab_size", "vocab_range_from_per_partition_vocab_size",
]
