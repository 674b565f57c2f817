"""Shared helpers for the tensor-parallel tests: TP groups inside a gloo job, a
dense float64 reference built independently of the code under test, and
gathers that use plain torch.distributed (not the mappings under test)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelGroup, ParallelState

SEED = 1234
STD = 0.5  # large enough that every product matters at float64 tolerance


@contextlib.contextmanager
def tp_group(tp: int):
    """Yield ``(group, tp_rank, tp_size)`` for a TP group (a ``ParallelGroup``) of size ``tp`` in the running job.

    TP equal to the world uses WORLD; a smaller TP builds the job's groups with
    ParallelState (so the group rank differs from the global rank) and tears
    them down afterwards."""
    world = dist.get_world_size()
    if tp == world:
        yield ParallelGroup("tp", tuple(range(world)), dist.get_rank(), dist.group.WORLD), dist.get_rank(), tp
        return
    state = ParallelState.build(ParallelLayout(world_size=world, tp=tp))
    try:
        yield state.tp, state.tp.rank, tp
    finally:
        state.destroy()


def dense_weight(seed: int, *shape: int) -> torch.Tensor:
    """The full weight a single-rank model draws after ``torch.manual_seed(seed)``: N(0, STD) in fp32."""
    torch.manual_seed(seed)
    w = torch.empty(*shape, dtype=torch.float32)
    torch.nn.init.normal_(w, mean=0.0, std=STD)
    return w.double()


def randn(seed: int, *shape: int) -> torch.Tensor:
    """Deterministic float64 data, identical on every rank, without touching the global RNG."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def part(x: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    n = x.size(dim) // size
    return x.narrow(dim, rank * n, n)


def all_gather_cat(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    group = group.group if isinstance(group, ParallelGroup) else group
    """Concatenate every rank's ``x`` along ``dim`` using plain ``dist.all_gather``."""
    bufs = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(bufs, x.contiguous(), group=group)
    return torch.cat(bufs, dim=dim)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol=1e-10, atol=1e-12) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"rank {dist.get_rank()}: {what}: {m}")
