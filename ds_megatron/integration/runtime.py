"""Starting DeepSpeed's comm layer on the right device, and the workarounds a CPU job needs.

``deepspeed.init_distributed`` over the launcher's variables (gloo on a CPU, nccl on GPUs);
``deepspeed.accelerator.get_accelerator`` names the device the engine runs on.  On the CPU path
the shared-memory all-reduce op is marked unavailable first (``seams.skip_shm_comm_build``: its
JIT build takes about 40 s and only inference uses it), and ``DS_ACCELERATOR=cpu`` is set, without
which DeepSpeed warns.
"""
from __future__ import annotations

import datetime
import os
from typing import Optional

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger as deepspeed_logger

from ..parallel_state import set_collective_timeout
from ..utils.dist_env import launcher_env_for_torch
from ..utils.runtime_env import use_cuda
from .seams import skip_shm_comm_build


def prepare_cpu_runtime() -> None:
    """Idempotent; does nothing on the CUDA path."""
    if use_cuda():
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    skip_shm_comm_build()


def accelerator_device_type() -> str:
    """"cuda" or "cpu": where DeepSpeed's accelerator runs the engine."""
    return "cuda" if get_accelerator().device_name() == "cuda" else "cpu"


def accelerator_device() -> torch.device:
    """The device DeepSpeed's engine puts the model on (this rank's GPU, or the CPU)."""
    return torch.device(get_accelerator().current_device_name())


def init_distributed(backend: Optional[str] = None, timeout: datetime.timedelta = datetime.timedelta(minutes=10),
                     verbose: bool = True) -> None:
    """DeepSpeed's comm layer over the torch variables already in the environment (nccl with CUDA, else gloo)."""
    set_collective_timeout(timeout)  # every group we create gets it too (parallel_state.collective_timeout)
    prepare_cpu_runtime()
    cuda = use_cuda()
    if cuda:
        # One GPU per local rank, as Megatron does; NCCL needs it set before the first collective.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    deepspeed.init_distributed(dist_backend=backend or ("nccl" if cuda else "gloo"), auto_mpi_discovery=False,
                               timeout=timeout, dist_init_required=True, verbose=verbose)


def init_distributed_from_env(backend: Optional[str] = None,
                              timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> None:
    """Map whatever launcher started us to torch's variables (``utils.dist_env``), then ``init_distributed``.

    Does nothing if torch.distributed is already initialized.
    """
    if dist.is_available() and dist.is_initialized():
        return
    os.environ.update(launcher_env_for_torch(os.environ))
    init_distributed(backend, timeout)


def adopt_existing_process_group(dist_init_required: Optional[bool] = None) -> None:
    """The caller initialized torch.distributed (or deepspeed.init_distributed) already: let DeepSpeed's comm
    layer adopt that process group."""
    deepspeed.init_distributed(dist_init_required=False if dist_init_required is None else dist_init_required)


def set_deepspeed_log_level(level: str) -> None:
    """DeepSpeed's own logger (benchmarks and tests keep it to errors)."""
    deepspeed_logger.setLevel(level)

