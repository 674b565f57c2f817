"""Layouts a model cannot use are refused at ``ds_megatron.initialize`` (integration/checks.py), on 4 gloo ranks.

A plain model (no tensor-parallel layer, as a Hugging Face model) under TP=2 used to train: each TP
pair read one batch and trained two identical copies on it, so half the global batch was never
seen by anyone and the run reported success.
"""
import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.config import ConfigError


class _PlainModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).pow(2).mean()


def _initialize(megatron, impl):
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 6,
           "megatron": dict(megatron, optimizer_impl=impl)}
    model = _PlainModel()
    try:
        engine, *_ = ds_megatron.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                            config=cfg)
    except ConfigError as e:
        dist.barrier()
        return str(e)
    engine.megatron.state.destroy()
    return None


def test_tensor_and_expert_parallel_sizes_need_parameters_that_use_them():
    for impl in ("megatron", "deepspeed"):
        for msg in run_on_ranks(4, _initialize, {"tensor_model_parallel_size": 2}, impl):
            assert msg.startswith("megatron.tensor_model_parallel_size=2 but the model has no tensor-parallel "
                                  "parameter") and "set tensor_model_parallel_size to 1" in msg, msg
    for msg in run_on_ranks(4, _initialize, {"expert_model_parallel_size": 2}, "megatron"):
        assert msg.startswith("megatron.expert_model_parallel_size=2 but the model has no expert parameter"), msg
    assert run_on_ranks(4, _initialize, {}, "megatron") == [None] * 4  # plain data parallel is fine
