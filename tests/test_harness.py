"""The test harness pins multi-rank tests to the CPU path on every machine, GPU or not."""
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
