"""Megatron's optimizer path: gradient norms and clipping across model-parallel ranks."""
from .clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32, grads_for_norm

__all__ = ["clip_grad_by_total_norm_fp32", "get_grad_norm_fp32", "grads_for_norm"]
