"""Transformer building blocks made of the tensor-parallel layers (paper, section 3)."""
from .attention import ParallelAttention
from .layer import GraphableLayer, ParallelTransformerLayer
from .mlp import ParallelMLP
from .multi_latent_attention import MLASelfAttention

__all__ = ["GraphableLayer", "MLASelfAttention", "ParallelAttention", "ParallelMLP", "ParallelTransformerLayer"]
