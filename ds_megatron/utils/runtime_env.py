"""Which device a job runs on: one rule, used by the launch helpers, the tests and the DeepSpeed seams.

CUDA when torch sees a GPU, unless ``DS_ACCELERATOR=cpu`` pins DeepSpeed's CPU
accelerator (gloo), which is what the test suite and a user's CPU run on a GPU
machine do.
"""
from __future__ import annotations

import os


def use_cuda() -> bool:
    """True when this process runs on a GPU: torch sees one and DS_ACCELERATOR does not pin the CPU."""
    if os.environ.get("DS_ACCELERATOR", "").lower() == "cpu":
        return False
    import torch  # here: launch helpers build a rank's environment before torch loads
    return torch.cuda.is_available()
