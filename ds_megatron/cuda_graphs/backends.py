"""Capturers: the function that turns modules + static sample inputs into graphed callables.

``CudaGraphHelper`` calls one of these and never a graph API directly, so the
control flow around capture (partial MoE capture, tensor store, micro-batch
assignment, manual hooks) can be tested on a CPU with ``EagerCapturer``.

* ``TransformerEngineCapturer``: ``transformer_engine.pytorch.make_graphed_callables``
  with the pipeline ``_order`` and ``_reuse_graph_input_output_buffers``.
* ``TorchCapturer``: ``torch.cuda.make_graphed_callables`` (no ``_order``:
  one graph pair per layer, the no-pipeline case), used when TE is missing.
* ``EagerCapturer``: "capture" that just calls the module: same outputs,
  same autograd, no graph.

All return, for each forward graph index (TE's per-callable index: chunk-major,
then micro-batch, then layer; one per layer without an order), a callable
taking the layer's positional tensors and returning the captured part's
outputs as a tuple.
"""
from __future__ import annotations

import inspect
import logging
from typing import Callable, List, Optional, Protocol, Sequence, Tuple

import torch

logger = logging.getLogger("ds_megatron.cuda_graphs")

# TE's import fails in more ways than ImportError on machines without CUDA/cuDNN.
_TE_IMPORT_ERRORS = (ImportError, RuntimeError, OSError)


def import_transformer_engine_graph_api() -> Tuple[Optional[Callable], str]:
    """(TE's ``make_graphed_callables`` or None, why not)."""
    try:
        from transformer_engine.pytorch import make_graphed_callables
    except _TE_IMPORT_ERRORS as e:
        return None, f"transformer_engine is not importable ({type(e).__name__}: {e})"
    return make_graphed_callables, ""


class Capturer(Protocol):
    name: str

    def __call__(self, modules: Tuple[torch.nn.Module, ...], sample_args: List[Tuple[torch.Tensor, ...]], *,
                 order: Optional[Sequence[int]], num_layers_per_chunk: Optional[Sequence[int]],
                 num_warmup_iters: int, reuse_buffers: bool, pool=None) -> Sequence[Callable]: ...


class TransformerEngineCapturer:
    """TE's ``make_graphed_callables`` (read from transformer_engine/pytorch/graph.py)."""

    name = "transformer_engine"

    def __init__(self, make_graphed_callables: Optional[Callable] = None):
        if make_graphed_callables is None:
            make_graphed_callables, why = import_transformer_engine_graph_api()
            if make_graphed_callables is None:
                raise RuntimeError(why)
        self._make_graphed_callables = make_graphed_callables
        self._params = set(inspect.signature(make_graphed_callables).parameters)

    def __call__(self, modules, sample_args, *, order, num_layers_per_chunk, num_warmup_iters, reuse_buffers,
                 pool=None):
        kwargs = dict(num_warmup_iters=num_warmup_iters,
                      # The captured part's module owns the whole layer's params; the MLP's are unused
                      # when only attention is captured.
                      allow_unused_input=True, pool=pool)
        if order is not None:
            kwargs["_order"] = list(order)
            if "_num_layers_per_chunk" in self._params and num_layers_per_chunk is not None:
                kwargs["_num_layers_per_chunk"] = list(num_layers_per_chunk)
            if reuse_buffers:
                if "_reuse_graph_input_output_buffers" in self._params:
                    kwargs["_reuse_graph_input_output_buffers"] = True
                    # TE checks both are lists when it reorganizes them for reuse.
                    sample_args = list(sample_args)
                    kwargs["sample_kwargs"] = [{} for _ in sample_args]
                else:
                    logger.info("this transformer_engine has no _reuse_graph_input_output_buffers (TE >= 2.7 has); "
                                "static buffers are still shared as planned, intermediate memory is not")
        if not reuse_buffers or order is None:
            sample_args = tuple(sample_args)
        graphed = self._make_graphed_callables(tuple(modules), sample_args, **kwargs)
        return list(graphed) if isinstance(graphed, (tuple, list)) else [graphed]


class TorchCapturer:
    """``torch.cuda.make_graphed_callables``: one graph pair per layer, captured fwd 1..N then bwd N..1."""

    name = "torch"

    def __call__(self, modules, sample_args, *, order, num_layers_per_chunk, num_warmup_iters, reuse_buffers,
                 pool=None):
        if order is not None:
            raise RuntimeError("pipeline-parallel capture needs Transformer Engine's make_graphed_callables(_order=...); "
                               "torch.cuda.make_graphed_callables has no schedule order: install transformer-engine")
        graphed = torch.cuda.make_graphed_callables(tuple(modules), tuple(sample_args), num_warmup_iters=num_warmup_iters,
                                                    allow_unused_input=True, pool=pool)
        return list(graphed)


class EagerCapturer:
    """Calls the module instead of capturing it: the partial-capture control flow without a GPU."""

    name = "eager"

    def __init__(self):
        self.calls = 0

    def __call__(self, modules, sample_args, *, order, num_layers_per_chunk, num_warmup_iters, reuse_buffers,
                 pool=None):
        self.calls += 1
        if order is None:
            return list(modules)
        # Same indexing as TE: chunk-major, then micro-batch, then layer.
        num_chunks = max(order)
        num_microbatches = len(order) // num_chunks // 2
        per_chunk = list(num_layers_per_chunk or [len(modules) // num_chunks] * num_chunks)
        out, start = [], 0
        for n in per_chunk:
            for _ in range(num_microbatches):
                out.extend(modules[start:start + n])
            start += n
        return out


def default_capturer(impl: str, device=None) -> Tuple[Optional[Capturer], str]:
    """(the capturer for ``megatron.cuda_graph.impl`` on ``device`` or None, one line saying why / what).

    ``device``: where the model runs (the engine's device); graphs need it to be a CUDA device,
    whatever else the machine has (a job pinned to the CPU on a GPU machine runs eagerly).
    """
    if device is not None and torch.device(device).type != "cuda":
        why = "the engine runs on the CPU, not a CUDA device"
        if not torch.cuda.is_available():
            why += " (torch.cuda.is_available() is False)"
        return None, why
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False (no CUDA device)"
    if impl == "local":
        return TorchCapturer(), "whole layers through torch.cuda.make_graphed_callables"
    make_graphed_callables, why = import_transformer_engine_graph_api()
    if make_graphed_callables is None:
        return TorchCapturer(), f"{why}; falling back to torch.cuda.make_graphed_callables"
    return TransformerEngineCapturer(make_graphed_callables), "transformer_engine make_graphed_callables"


__all__ = ["Capturer", "EagerCapturer", "TorchCapturer", "TransformerEngineCapturer", "default_capturer",
           "import_transformer_engine_graph_api"]
