"""Megatron DDP inside the DeepSpeed engine: same training as DeepSpeed's own path, and no double reduction.

A second reduction on top of ours would be caught twice: DeepSpeed's reducer
(``buffered_allreduce_fallback``) is counted and must never run, and the
parameters must equal DeepSpeed's own path.  (The DDP runs used to add
``"gradient_allreduce_op": "sum"``, which the Megatron path now refuses as a
key it does not apply; the guard run, on DeepSpeed's path, still shows that a
summed instead of averaged reduction changes the result on this data.)
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.config import ConfigError
from ds_megatron.distributed import DistributedDataParallelConfig
from ds_megatron.integration.gradients import check_engine_supports_megatron_ddp


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        with torch.no_grad():
            for lin in self.layers:
                lin.weight.copy_(torch.randn(16, 16, generator=g) * 0.3)
                lin.bias.copy_(torch.randn(16, generator=g) * 0.1)

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x.pow(2).mean()


def _config(gas, megatron=None, op=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 6,
        "megatron": dict(megatron or {}),
    }
    if op is not None:
        cfg["gradient_allreduce_op"] = op
    return cfg


def _train(cfg, steps=3):
    state = ds_megatron.initialize_model_parallel(cfg)
    model = MLP()
    engine, _, _, _ = ds_megatron.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                             parallel_state=state)
    ddp = engine.megatron.ddp
    called_deepspeed_reducer = []
    original = engine.buffered_allreduce_fallback
    engine.buffered_allreduce_fallback = lambda *a, **k: (called_deepspeed_reducer.append(1), original(*a, **k))
    gas = cfg["gradient_accumulation_steps"]
    for step in range(steps):
        for mb in range(gas):
            g = torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + mb)
            loss = engine(torch.randn(4, 16, generator=g))
            engine.backward(loss)
            engine.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    info = dict(n_groups=len(ddp.all_bucket_groups) if ddp else 0, deepspeed_reduced=len(called_deepspeed_reducer))
    if engine.megatron.ddp_in_engine is not None:
        engine.megatron.ddp_in_engine.detach()
    state.destroy()
    return flat, info


def _compare_with_deepspeed():
    out = {}
    # The reference is DeepSpeed's own reducer (its optimizer path); the Megatron path always uses the buffers.
    deepspeed_path = {"optimizer_impl": "deepspeed"}
    refs = {gas: _train(_config(gas, deepspeed_path))[0] for gas in (1, 4)}
    guard, _ = _train(_config(1, deepspeed_path, op="sum"))
    out["guard_differs"] = not torch.allclose(guard, refs[1], atol=1e-4)
    start = MLP()
    out["moved"] = not torch.allclose(refs[1], torch.cat([p.detach().flatten() for p in start.parameters()]))
    for overlap in (False, True):
        for gas in (1, 4):
            flat, info = _train(_config(gas, {"overlap_grad_reduce": overlap, "bucket_size": 200}))
            out[(overlap, gas)] = (torch.allclose(flat, refs[gas], atol=1e-6, rtol=1e-5),
                                   float((flat - refs[gas]).abs().max()), info)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_in_engine_trains_like_deepspeed_without_double_reduction(world):
    for res in run_on_ranks(world, _compare_with_deepspeed):
        assert res["moved"] and res["guard_differs"]
        for overlap in (False, True):
            for gas in (1, 4):
                same, max_diff, info = res[(overlap, gas)]
                assert same, (world, overlap, gas, max_diff)
                assert info["deepspeed_reduced"] == 0
                assert info["n_groups"] == (3 if overlap else 1)  # 200-element buckets: one per layer


class _EngineSettings:
    """Just the engine queries the check makes."""

    def __init__(self, stage=0, bf16=False, fp16=False):
        self.zero_optimization_stage = lambda: stage
        self.bfloat16_enabled = lambda: bf16
        self.fp16_enabled = lambda: fp16


def test_engine_settings_that_would_also_own_the_gradients_are_refused():
    cfg = DistributedDataParallelConfig(overlap_grad_reduce=True)
    check_engine_supports_megatron_ddp(_EngineSettings(), cfg)
    with pytest.raises(ConfigError, match="zero_optimization.stage is 1"):
        check_engine_supports_megatron_ddp(_EngineSettings(stage=1), cfg)
    with pytest.raises(ConfigError, match="bf16/fp16"):
        check_engine_supports_megatron_ddp(_EngineSettings(bf16=True), cfg)
    # The distributed optimizer's shards are only read by ds_megatron's DistributedOptimizer.
    with pytest.raises(ConfigError, match="engine's optimizer is not ds_megatron's DistributedOptimizer"):
        check_engine_supports_megatron_ddp(_EngineSettings(), DistributedDataParallelConfig(use_distributed_optimizer=True))


def test_ddp_keys_are_validated_before_anything_starts():
    with pytest.raises(ConfigError, match="megatron.use_megatron_ddp is false but megatron.bucket_size"):
        ds_megatron.validate_config({"megatron": {"use_megatron_ddp": False, "bucket_size": 10}}, world_size=2)
    with pytest.raises(ConfigError, match="megatron.overlap_param_gather"):
        ds_megatron.validate_config({"megatron": {"overlap_param_gather": True}}, world_size=2)
    with pytest.raises(ConfigError, match="megatron.bucket_size"):
        ds_megatron.validate_config({"megatron": {"bucket_size": 0}}, world_size=2)
    _, mcfg = ds_megatron.validate_config({"megatron": {"grad_reduce_in_fp32": True}}, world_size=2)
    assert mcfg.gradient_reducer == "megatron_ddp" and mcfg.ddp.grad_reduce_in_fp32
    # The Megatron path always reduces with the buffers (one reducer per path); DeepSpeed's path never.
    _, plain = ds_megatron.validate_config({"megatron": {}}, world_size=2)
    assert plain.gradient_reducer == "megatron_ddp" and plain.ddp.grad_reduce_in_fp32 is None
    _, theirs = ds_megatron.validate_config({"megatron": {"optimizer_impl": "deepspeed"}}, world_size=2)
    assert theirs.gradient_reducer == "deepspeed"
    with pytest.raises(ConfigError, match="which reduce gradients on the megatron optimizer path only"):
        ds_megatron.validate_config({"megatron": {"overlap_grad_reduce": True, "optimizer_impl": "deepspeed"}},
                                    world_size=2)
    # Engine settings that would also own the gradients are refused from the config alone, before any group.
    with pytest.raises(ConfigError, match="megatron.use_megatron_ddp is on but zero_optimization.stage is 1"):
        ds_megatron.validate_config({"zero_optimization": {"stage": 1},
                                     "megatron": {"use_megatron_ddp": True, "optimizer_impl": "deepspeed"}},
                                    world_size=2)
    with pytest.raises(ConfigError, match="together with DeepSpeed's own bf16 optimizer"):
        ds_megatron.validate_config({"bf16": {"enabled": True},
                                     "megatron": {"overlap_grad_reduce": True, "optimizer_impl": "deepspeed"}},
                                    world_size=2)
