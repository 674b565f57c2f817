"""Partial CUDA graphs (Megatron-LM's TE path): schedule orders, capture helper, MoE partial capture, engine hook.

* ``schedule``: pure pipeline ``order`` helpers and the graph / static-buffer plan;
* ``partial_capture``: the MoE signal, tensor store and decorator an MoE layer uses;
* ``backends``: TE / torch / eager capturers;
* ``capture``: per-layer capture, assignment per micro-batch, replay, manual hooks;
* ``engine_hook``: capture after ``warmup_steps`` and replay inside DeepSpeed's loop.

The torch-free ``schedule`` module imports without this package's torch parts.
"""
from .schedule import (CudaGraphPlan, check_order, convert_schedule_table_to_order, get_num_warmup_microbatches,
                       get_order, get_pp_rank_microbatches, get_schedule_table, plan_cuda_graphs,
                       simulate_buffer_reuse)

_LAZY = {
    "attach_cuda_graphs": ".engine_hook", "CudaGraphEngineHook": ".engine_hook",
    "CudaGraphHelper": ".capture", "GraphableLayer": ".capture", "layer_is_graphable": ".capture",
    "EagerCapturer": ".backends", "TorchCapturer": ".backends", "TransformerEngineCapturer": ".backends",
    "MoECudaGraphPartialCaptureSignal": ".partial_capture", "MoECudaGraphTensorStore": ".partial_capture",
    "PartialCaptureMoE": ".partial_capture", "maybe_skip_or_early_return_by_cudagraph": ".partial_capture",
    "is_graph_capturing": ".partial_capture",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CudaGraphPlan", "check_order", "convert_schedule_table_to_order", "get_num_warmup_microbatches",
           "get_order", "get_pp_rank_microbatches", "get_schedule_table", "plan_cuda_graphs", "simulate_buffer_reuse",
           *_LAZY]
