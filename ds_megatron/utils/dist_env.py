"""The variables torch.distributed needs, from whatever launcher started this process (pure: reads the env).

``deepspeed``, ``torchrun`` and our test harness export torch's variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).  ``mpiexec`` does
not: MPICH/Hydra exports PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
and Open MPI exports OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}.
DeepSpeed's own MPI discovery would take MASTER_ADDR from ``hostname -I``
(not loopback), so we map those variables ourselves:

* MASTER_ADDR defaults to 127.0.0.1 when every rank is on this node; a job
  that spans nodes needs MASTER_ADDR exported (or mpi4py, which broadcasts
  rank 0's host name).
* MASTER_PORT defaults to ``DEFAULT_MASTER_PORT`` (29500, torch's and
  DeepSpeed's default).  With mpi4py importable, rank 0 instead picks a free
  port and broadcasts it, so concurrent mpiexec jobs on one box don't collide.
* A process started by no launcher at all is a one-rank job.

LOCAL_SIZE is always set: DeepSpeed's CPU accelerator reports it as the
device count.  ``ds_megatron.integration.runtime.init_distributed_from_env``
applies these and starts DeepSpeed's comm layer.
"""
from __future__ import annotations

import os
import random
import socket
from typing import Dict, Mapping, Optional, Tuple


DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500

# (rank, size, local rank, local size) variables of each MPI flavour.
MPI_FLAVOURS = {
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
}


def mpi_flavour(environ: Mapping[str, str]) -> Optional[str]:
    """Which MPI launcher started us, judged by its rank variable, or None."""
    for name, (rank_var, size_var, _, _) in MPI_FLAVOURS.items():
        if rank_var in environ and size_var in environ:
            return name
    return None


def torch_env_from_launcher(environ: Mapping[str, str]) -> Dict[str, str]:
    """The torch variables to add to ``environ`` (pure: reads, never writes); variables already set win.

    MASTER_ADDR/MASTER_PORT get the single-node defaults; ``init_distributed_from_env``
    puts values broadcast through mpi4py into ``environ`` first, when it has them.
    """
    env: Dict[str, str] = {}
    if "RANK" not in environ:
        flavour = mpi_flavour(environ)
        if flavour is None:
            rank, size, local_rank, local_size = "0", "1", "0", "1"
        else:
            rank_var, size_var, local_rank_var, local_size_var = MPI_FLAVOURS[flavour]
            rank, size = environ[rank_var], environ[size_var]
            # Without the local variables assume one node, as mpiexec on one box gives.
            local_rank = environ.get(local_rank_var, rank)
            local_size = environ.get(local_size_var, size)
            if "MASTER_ADDR" not in environ and int(local_size) < int(size):
                raise ValueError(f"MASTER_ADDR is not set and this {flavour} job spans several nodes "
                                 f"({local_size} of {size} ranks on this one); export MASTER_ADDR=<rank 0's "
                                 "host> or install mpi4py (pip install 'ds-megatron[mpi]')")
        env.update(RANK=rank, WORLD_SIZE=size, LOCAL_RANK=local_rank, LOCAL_SIZE=local_size)
    else:
        # torchrun calls it LOCAL_WORLD_SIZE; the deepspeed launcher sets LOCAL_SIZE itself.
        env["LOCAL_SIZE"] = environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE", "1"))
        env["LOCAL_RANK"] = environ["RANK"]  # a launcher that gave no LOCAL_RANK: one node
    env["MASTER_ADDR"] = DEFAULT_MASTER_ADDR
    env["MASTER_PORT"] = str(DEFAULT_MASTER_PORT)
    return {k: v for k, v in env.items() if k not in environ}


def _ephemeral_ports() -> Tuple[int, int]:
    """The range the kernel takes a connection's local port from (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = DEFAULT_MASTER_ADDR) -> int:
    """A TCP port free on ``host`` now (loopback by default; "" for every interface, for multi-node), below the
    ephemeral range: a port the kernel hands out (``bind(0)``) can be taken, before the store listens on it, as the
    local end of any new connection (gloo's many), which failed a job's start with EADDRINUSE."""
    low, _ = _ephemeral_ports()
    candidates = random.Random().sample(range(10000, low), min(64, max(low - 10000, 0)))
    for port in candidates + [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {host!r}")


def _rendezvous_from_mpi4py(environ: Mapping[str, str]) -> Optional[Dict[str, str]]:
    """Rank 0's free port (and host, for multi-node jobs), broadcast over MPI; None without mpi4py."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError):  # mpi4py absent, or no MPI library it can load
        return None
    comm = MPI.COMM_WORLD
    on_this_node = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()  # collective: every rank calls it
    mine = None
    if comm.Get_rank() == 0:
        multi_node = on_this_node < comm.Get_size()
        mine = {"MASTER_PORT": str(free_port("" if multi_node else DEFAULT_MASTER_ADDR)),
                "MASTER_ADDR": socket.gethostbyname(socket.gethostname()) if multi_node else DEFAULT_MASTER_ADDR}
    got = comm.bcast(mine, root=0)
    return {k: v for k, v in got.items() if k not in environ}


def launcher_env_for_torch(environ: Mapping[str, str]) -> Dict[str, str]:
    """Every variable to add so torch.distributed can start from ``environ`` (mpi4py's broadcast first)."""
    env: Dict[str, str] = {}
    if "RANK" not in environ and mpi_flavour(environ) and "MASTER_PORT" not in environ:
        env.update(_rendezvous_from_mpi4py(environ) or {})
    env.update(torch_env_from_launcher({**environ, **env}))
    return env
