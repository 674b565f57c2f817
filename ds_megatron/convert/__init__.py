"""Hugging Face import and export at any TP / PP / EP layout (``ds-megatron convert``, ``--load-hf``).

| module | concept |
| --- | --- |
| ``mapping`` | which Hugging Face tensor rows and columns make each tensor of each rank file (torch-free) |
| ``safetensors_io`` | headers without data, slice reads, a writer that streams tensor by tensor |
| ``checkpoint`` | whole directories: validate first, stream, rename at the end (``convert``) |
| ``model_io`` | a built model's own shards in and out (a training job's ``load_hf``, and its export) |
| ``export_fp32`` | a training checkpoint (any TP / PP / EP / DP) consolidated into one fp32 state dict (``ds-megatron export-fp32``) |
"""
from ..config.hf_config import FAMILIES, hf_from_model, model_from_hf
from ..errors import ConvertError
from .mapping import Layout, Mapping

__all__ = ["FAMILIES", "ConvertError", "Layout", "Mapping", "hf_from_model", "model_from_hf"]
