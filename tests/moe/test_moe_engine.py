"""MoE folding under DeepSpeed's engine on 4 gloo ranks: expert gradients reduced over the right ranks,
the loss falls, expert checkpoints by expert rank survive a save + load round trip."""
import os

import pytest
import torch

from harness import run_on_ranks
from moe_helpers import MOE, expert_grads, moe_config

import ds_megatron
from ds_megatron import validate_config
from ds_megatron.config import ConfigError
from ds_megatron.models import GPTModel
from ds_megatron.tensor_parallel import grad_of

KW = dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def _ds_config(tp, ep, etp, **extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 6, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "megatron": {"tensor_model_parallel_size": tp, "expert_model_parallel_size": ep,
                         "expert_tensor_parallel_size": etp, **extra}}


def _batch(replica):
    g = torch.Generator().manual_seed(200 + replica)
    tokens = torch.randint(0, MOE["vocab_size"], (2, MOE["seq_length"]), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _engine(tp, ep, etp):
    cfg = _ds_config(tp, ep, etp)
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(31)
    model = GPTModel(moe_config(**KW), state)
    engine, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    return engine, state, cfg


def _expert_grads_and_training(tp, ep, etp, save_dir):
    engine, state, cfg = _engine(tp, ep, etp)
    tokens, labels = _batch(state.dp.rank)
    loss = engine(tokens, labels)
    engine.backward(loss)
    engine.megatron.finalize_model_grads()  # reduced now rather than at the step: read them below

    # Reference: one rank, the mean loss over every data-parallel replica's batch, in float64 (the same init,
    # widened exactly), so that only the engine's float32 rounding is compared.  The tolerances are ~1e3 eps32
    # relative (seen: <= 2e-9 off, 0.015 of the tolerance, AVX2 and scalar kernels), while a gradient averaged
    # over the wrong ranks is off by its own size.
    torch.manual_seed(31)
    ref = GPTModel(moe_config(**KW)).double()
    sum(ref(*_batch(r)) for r in range(state.dp.size)).div(state.dp.size).backward()
    mine, theirs = expert_grads(engine.module.layers[0].mlp.experts), expert_grads(ref.layers[0].mlp.experts)
    assert mine, "this rank holds no expert"
    for key, g in mine.items():
        assert torch.allclose(g.double(), theirs[key], rtol=1e-4, atol=1e-7), \
            f"expert {key} gradient is not the global mean"
    router = grad_of(engine.module.layers[0].mlp.router.weight)
    assert torch.allclose(router.double(), ref.layers[0].mlp.router.weight.grad, rtol=1e-4, atol=1e-7)
    # Clipping's global norm counts every expert once (summed over etp-ep, not over tp or dp).
    ref_norm = float(torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters())))
    assert engine.optimizer.get_grad_norm() == pytest.approx(ref_norm, rel=1e-5)  # ~1e2 eps32
    engine.step()

    losses = [float(loss)]
    for _ in range(11):
        loss = engine(tokens, labels)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, f"the loss did not fall: {losses}"

    # Round trip: save, take a step (loss A), reload, take the same step again (loss B == A).
    ds_megatron.save_checkpoint(engine, save_dir, tag="moe")
    def step():
        l = engine(tokens, labels)
        engine.backward(l)
        engine.step()
        return float(engine(tokens, labels).detach())
    after = step()
    ds_megatron.load_checkpoint(engine, save_dir, tag="moe")
    again = step()
    assert again == after, (again, after)
    files = sorted(f for f in os.listdir(os.path.join(save_dir, "moe")) if f.startswith("layer_"))
    state.destroy()
    return losses, files


@pytest.mark.parametrize("tp,ep,etp", [(2, 4, 1), (1, 2, 1)])
def test_folded_moe_trains_under_deepspeed(tmp_path, tp, ep, etp):
    out = run_on_ranks(4, _expert_grads_and_training, tp, ep, etp, str(tmp_path))
    losses, files = out[0]
    # Data-parallel replicas log different losses, TP peers the same ones.
    assert [o[0] for o in out][0] == out[tp - 1][0]
    layers = MOE["num_layers"]
    assert files == sorted(f"layer_{l}_expert_{e}_mp_rank_00_model_states.pt" for l in range(layers)
                           for e in range(MOE["num_experts"]))


def _bad(cfg_kwargs, model_kwargs):
    cfg = _ds_config(**cfg_kwargs)
    state = ds_megatron.initialize_model_parallel(cfg)
    try:
        GPTModel(moe_config(**model_kwargs), state)
    finally:
        state.destroy()


def test_bad_moe_layouts_fail_at_start():
    with pytest.raises(ConfigError, match=r"etp\*ep\*pp = 1\*3\*1 = 3"):
        validate_config(_ds_config(1, 3, 1), world_size=4)
    with pytest.raises(ConfigError, match=r"etp\*ep\*pp = 2\*4\*1 = 8"):
        validate_config(_ds_config(2, 4, 2), world_size=4)
    with pytest.raises(Exception, match="num_experts=6 is not divisible by megatron.expert_model_parallel_size=4"):
        run_on_ranks(4, _bad, dict(tp=1, ep=4, etp=1), dict(num_experts=6))


def test_moe_job_configs_validate_and_bad_ones_fail_at_start():
    import json
    from ds_megatron.config.job import load_job
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name, world in (("moe_ep2.json", 2), ("moe_ep4_tp2.json", 4)):
        job = load_job(os.path.join(root, "ds_configs", name), world)
        assert job.model.num_experts == 4 and job.megatron.parallel.expert_model_parallel_size == world
    cfg = json.load(open(os.path.join(root, "ds_configs", "moe_ep2.json")))
    cfg["megatron"]["model"]["num_experts"] = 3
    with pytest.raises(ConfigError, match="num_experts=3 is not divisible by megatron.expert_model_parallel_size=2"):
        load_job(cfg, 2)
    cfg["megatron"]["model"].update(num_experts=2, moe_router_topk=3)
    with pytest.raises(ConfigError, match="moe_router_topk=3 is larger than model.num_experts=2"):
        load_job(cfg, 2)
