"""The test harness: multi-rank tests pinned to the CPU path on every machine, GPU or not; workers that free the
groups a test destroyed, and are replaced when they hold too many."""
import os

import pytest
import torch

from harness import run_on_ranks
from ds_megatron.integration.local_job import local_rank_env
from ds_megatron.utils.runtime_env import use_cuda


def _device_view():
    from deepspeed.accelerator import get_accelerator
    return (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("DS_ACCELERATOR"), torch.cuda.is_available(),
            get_accelerator().device_name(), torch.distributed.get_backend())


def test_workers_see_no_gpu_and_run_gloo():
    for view in run_on_ranks(2, _device_view):
        assert view == ("", "cpu", False, "cpu", "gloo"), view


def test_cpu_only_rank_env_hides_the_gpu():
    env = local_rank_env(0, 2, 12345, cpu_only=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["DS_ACCELERATOR"] == "cpu"


@pytest.mark.parametrize("accelerator, gpu, expected", [("cpu", True, False), ("", True, True), ("", False, False),
                                                         ("cuda", False, False)])
def test_one_rule_decides_the_device(monkeypatch, accelerator, gpu, expected):
    monkeypatch.setenv("DS_ACCELERATOR", accelerator)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert use_cuda() is expected


def _threads_after(groups_left: int, groups_destroyed: int):
    """Make groups, destroy some of them (kept in a reference cycle, as engines keep theirs), return the pid."""
    import torch.distributed as dist
    cycle = {}
    cycle["self"] = cycle
    cycle["groups"] = [dist.new_group([0, 1]) for _ in range(groups_destroyed)]
    for g in cycle["groups"]:
        dist.destroy_process_group(g)
    leaked = [dist.new_group([0, 1]) for _ in range(groups_left)]
    _LEAKED.extend(leaked)  # never destroyed: alive after the test
    return os.getpid()


_LEAKED = []


def test_destroyed_groups_free_their_threads_and_a_pool_holding_many_is_replaced():
    from harness import _POOLS, _threads
    if 2 in _POOLS:  # fresh workers: what earlier tests left in a reused pool is not this test's count
        _POOLS[2].close()
    first = run_on_ranks(2, _threads_after, 0, 30)
    # Without the collection, the 30 destroyed groups' 90 threads (each waking every few ms) stay.
    assert 2 in _POOLS and all(0 < _threads(pid) < 20 for pid in first)
    assert run_on_ranks(2, _threads_after, 30, 0) == first  # the same workers ran it...
    assert 2 not in _POOLS  # ...and, holding 90 threads more, were let go
    assert all(pid not in first for pid in run_on_ranks(2, os.getpid))
