"""Partial CUDA graphs (Megatron-LM's TE path): schedule orders, capture helper, MoE partial capture.

| module | concept |
| --- | --- |
| ``schedule`` | pure pipeline ``order`` helpers and the graph / static-buffer plan |
| ``backends`` | the capturers: Transformer Engine's, torch's, and an eager one for tests |
| ``capture`` | ``CudaGraphHelper``: per-layer capture, assignment per micro-batch, replay, manual hooks |
| ``partial_capture`` | the MoE layer's front inside the graph, its remaining steps after it |

Layers declare themselves graphable by subclassing ``transformer.GraphableLayer``
(and ``moe.BaseMoELayer`` for MoE MLPs).  The hook that captures and replays
inside DeepSpeed's loop is a DeepSpeed seam: ``ds_megatron.integration.cuda_graphs``.
"""
from .backends import Capturer, EagerCapturer, TorchCapturer, TransformerEngineCapturer, default_capturer
from .capture import CudaGraphHelper, LayerGraphRunner, capture_stream, is_moe_layer, layer_is_graphable
from .partial_capture import EarlyReturnLayout, early_return_step, moe_front, moe_rest, prepare_moe_for_scope
from .schedule import (CudaGraphPlan, check_order, convert_schedule_table_to_order, get_num_warmup_microbatches,
                       get_order, get_pp_rank_microbatches, get_schedule_table, plan_cuda_graphs,
                       simulate_buffer_reuse)

__all__ = ["Capturer", "EagerCapturer", "TorchCapturer", "TransformerEngineCapturer", "default_capturer",
           "CudaGraphHelper", "LayerGraphRunner", "capture_stream", "is_moe_layer", "layer_is_graphable",
           "EarlyReturnLayout", "early_return_step", "moe_front", "moe_rest", "prepare_moe_for_scope",
           "CudaGraphPlan", "check_order", "convert_schedule_table_to_order", "get_num_warmup_microbatches",
           "get_order", "get_pp_rank_microbatches", "get_schedule_table", "plan_cuda_graphs", "simulate_buffer_reuse"]
