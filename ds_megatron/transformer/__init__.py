"""Transformer building blocks made of the tensor-parallel layers (paper, section 3)."""
from .attention import ParallelAttention
from .layer import ParallelTransformerLayer
from .mlp import ParallelMLP

__all__ = ["ParallelAttention", "ParallelMLP", "ParallelTransformerLayer"]
