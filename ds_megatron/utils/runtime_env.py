"""Process-level settings a CPU job needs before DeepSpeed initializes.

On a machine without CUDA DeepSpeed picks its CPU accelerator (gloo) but
prints a warning unless ``DS_ACCELERATOR=cpu`` is set, and its first
``init_distributed`` JIT-compiles a shared-memory all-reduce op (~40 s) that
only inference uses; we mark that op unavailable so training starts at once.
"""
from __future__ import annotations

import os


def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def prepare_cpu_runtime() -> None:
    """Idempotent; does nothing on a CUDA machine."""
    if cuda_available():
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
