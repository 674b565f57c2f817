"""Transformer building blocks made of the tensor-parallel layers (paper, section 3)."""
from .attention import ParallelAttention
from .layer import GraphableLayer, ParallelTransformerLayer
from .mlp import ParallelMLP

__all__ = ["GraphableLayer", "ParallelAttention", "ParallelMLP", "ParallelTransformerLayer"]
