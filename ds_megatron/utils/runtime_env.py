"""Which device a job runs on, and the process-level settings a CPU job needs before DeepSpeed initializes.

One rule decides the device: CUDA when torch sees a GPU, unless
``DS_ACCELERATOR=cpu`` pins DeepSpeed's CPU accelerator (gloo), which is what
the test suite and a user's CPU run on a GPU machine do.  On the CPU path
DeepSpeed prints a warning unless ``DS_ACCELERATOR=cpu`` is set, and its first
``init_distributed`` JIT-compiles a shared-memory all-reduce op (~40 s) that
only inference uses; we mark that op unavailable so training starts at once.
"""
from __future__ import annotations

import os


def use_cuda() -> bool:
    """True when this process runs on a GPU: torch sees one and DS_ACCELERATOR does not pin the CPU."""
    if os.environ.get("DS_ACCELERATOR", "").lower() == "cpu":
        return False
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def prepare_cpu_runtime() -> None:
    """Idempotent; does nothing on the CUDA path."""
    if use_cuda():
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
