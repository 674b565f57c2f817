"""ds_megatron.initialize under the real DeepSpeed engine on 4 and 8 gloo ranks."""
import glob
import os

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.config import ConfigError
from ds_megatron.tensor_parallel import grad_of


def _ds_config(tp, extra=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "megatron": {"tensor_model_parallel_size": tp},
    }
    cfg.update(extra or {})
    return cfg


class TinyTPModel(torch.nn.Module):
    """A model whose first weight is a TP shard (different per TP rank) and whose second is replicated."""

    def __init__(self, tp_rank):
        super().__init__()
        g = torch.Generator().manual_seed(10 + tp_rank)
        self.shard = torch.nn.Parameter(torch.randn(3, 4, generator=g))
        self.shard.tensor_model_parallel = True
        g = torch.Generator().manual_seed(99)
        self.replicated = torch.nn.Parameter(torch.randn(4, generator=g))

    def forward(self, x):
        return ((x @ self.shard) * self.replicated).pow(2).mean()


def _local_grads(model, x):
    ref = TinyTPModel(0)
    ref.load_state_dict(model.state_dict())
    ref(x).backward()
    return torch.cat([ref.shard.grad.flatten(), ref.replicated.grad.flatten()])


def _dp_averaging_uses_our_groups(tp, optimizer_impl):
    world = dist.get_world_size()
    cfg = _ds_config(tp)
    cfg["megatron"]["optimizer_impl"] = optimizer_impl
    state = ds_megatron.initialize_model_parallel(cfg)
    model = TinyTPModel(state.tp.rank)
    engine, _, _, _ = ds_megatron.initialize(model=model, model_parameters=model.parameters(),
                                             config=cfg, parallel_state=state)
    assert engine.mpu is engine.megatron.mpu
    assert engine.seq_data_parallel_group is state.dp_cp.group
    # Each rank feeds data of its own global rank, so its local gradient is unique.
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    x = torch.randn(2, 3, generator=g)
    local = _local_grads(model, x)
    loss = engine(x)
    engine.backward(loss)
    # DeepSpeed's path reduces in backward; ours in the step (finished here to read the result).
    engine.megatron.finalize_model_grads()
    reduced = torch.cat([grad_of(model.shard).flatten(), grad_of(model.replicated).flatten()])
    everyone = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)
    expected = torch.stack([everyone[r] for r in state.dp.ranks]).mean(0)
    wrong = torch.stack(everyone).mean(0)  # what averaging over the whole world would give
    engine.step()
    out = dict(dp_ranks=list(state.dp.ranks), ok=torch.allclose(reduced, expected, atol=1e-6),
               differs_from_world=not torch.allclose(expected, wrong, atol=1e-4),
               dp_size=engine.dp_world_size, mp_size=engine.mp_world_size)
    state.destroy()
    return out


@pytest.mark.parametrize("optimizer_impl", ["deepspeed", "megatron"])
@pytest.mark.parametrize("world,tp", [(4, 2), (8, 2), (8, 4)])
def test_deepspeed_averages_gradients_over_our_dp_groups_only(world, tp, optimizer_impl):
    res = run_on_ranks(world, _dp_averaging_uses_our_groups, tp, optimizer_impl)
    for r, out in enumerate(res):
        assert out["ok"], (r, out)
        assert out["differs_from_world"], "test data cannot tell DP from world averaging"
        assert out["dp_size"] == world // tp and out["mp_size"] == tp


def _checkpoint_named_by_mp_rank(tmpdir):
    state = ds_megatron.initialize_model_parallel(_ds_config(2))
    model = TinyTPModel(state.tp.rank)
    engine, _, _, _ = ds_megatron.initialize(model=model, model_parameters=model.parameters(),
                                             config=_ds_config(2), parallel_state=state)
    before = model.shard.detach().clone()
    engine.save_checkpoint(tmpdir, tag="step1")
    dist.barrier()
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(tmpdir, "step1", "*model_states.pt")))
    saved = torch.load(os.path.join(tmpdir, "step1", f"mp_rank_{state.tp.rank:02d}_model_states.pt"),
                       map_location="cpu", weights_only=False)["module"]["shard"]
    with torch.no_grad():
        model.shard.zero_()
    engine.load_checkpoint(tmpdir, tag="step1")
    restored = torch.equal(model.shard, before)
    state.destroy()
    return files, torch.equal(saved, before), restored


def test_checkpoint_files_are_named_by_our_model_parallel_rank(tmp_path):
    res = run_on_ranks(4, _checkpoint_named_by_mp_rank, str(tmp_path))
    for files, saved_ok, restored in res:
        assert files == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
        assert saved_ok and restored


def _plain_initialize_without_section():
    from ds_megatron.optimizer import MegatronOptimizer
    out = []
    for section in (None, {}):
        model = TinyTPModel(0)
        cfg = _ds_config(1)
        del cfg["megatron"]
        if section is not None:
            cfg["megatron"] = section
        engine, opt, _, _ = ds_megatron.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        out.append((engine.dp_world_size, engine.mp_world_size, isinstance(opt, MegatronOptimizer)))
        engine.megatron.state.destroy()
    return out


def test_without_megatron_section_it_is_plain_deepspeed():
    # No section: DeepSpeed's own optimizer path, all ranks data parallel; an (empty) section opts in to ours.
    assert run_on_ranks(4, _plain_initialize_without_section) == [[(4, 1, False), (4, 1, True)]] * 4


def test_bad_config_is_refused_before_any_group():
    with pytest.raises(ConfigError, match="megatron.tensor_model_parallel_size"):
        ds_megatron.validate_config({"megatron": {"tensor_model_parallel_size": "two"}}, world_size=4)
    with pytest.raises(ConfigError, match="not divisible by tp\\*cp\\*pp"):
        ds_megatron.validate_config({"megatron": {"tensor_model_parallel_size": 3}}, world_size=4)
    with pytest.raises(ConfigError, match="etp\\*ep\\*pp"):
        ds_megatron.validate_config({"megatron": {"expert_model_parallel_size": 3}}, world_size=4)
    with pytest.raises(ConfigError, match="unknown key megatron.tp"):
        ds_megatron.validate_config({"megatron": {"tp": 2}}, world_size=4)


def _initialize_from_args(path):
    import argparse
    parser = ds_megatron.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
    model = TinyTPModel(0)
    engine, _, _, _ = ds_megatron.initialize(args=args, model=model, model_parameters=model.parameters())
    out = (engine.dp_world_size, engine.megatron.state.tp.size, args.deepspeed_config == path)
    engine.megatron.state.destroy()
    return out


def test_args_with_deepspeed_config_path_work_like_deepspeed(tmp_path):
    import json
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_ds_config(2)))
    # The caller's args are not modified (DeepSpeed refuses a config given twice, so we pass a copy).
    assert run_on_ranks(4, _initialize_from_args, str(path)) == [(2, 2, True)] * 4
    with pytest.raises(ConfigError, match="given more than once"):
        ds_megatron.initialize(args=type("A", (), {"deepspeed_config": str(path)})(), config=_ds_config(2))
