"""Recomputation with fp8: a recomputed forward quantizes the same X with the same scale (tensorwise: the same
tensor gives the same amax; delayed: the step's scale, which only the optimizer step moves, and MAX folds the
repeated amax into the same one), so loss, gradients and the delayed recipe's step amaxes equal those of the run
without recomputation, bit for bit."""
from __future__ import annotations

import pytest
import torch

from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.tensor_parallel.layers import fp8_states

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64, hidden_dropout=0.0,
             attention_dropout=0.0)
RECOMPUTE = {"none": {}, "full": dict(recompute_granularity="full"),
             "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"])}


MLA = dict(position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16,
           qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)


def _step(recipe, recompute, mla=False):
    torch.manual_seed(5)
    extra = {**RECOMPUTE[recompute], **(MLA if mla else {})}
    model = GPTModel(GPTConfig(**MODEL, fp8="hybrid", fp8_recipe=recipe, **extra))
    for s in fp8_states(model):  # a delayed step after the first: scales other than 1
        if recipe == "delayed":
            s.scale = {r: torch.tensor(v) for r, v in zip(s.scale, (91.0, 3000.0, 2.0 ** 20))}
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    amaxes = [float(a) for s in fp8_states(model) if recipe == "delayed" for a in s.step_amax.values()]
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, amaxes


@pytest.mark.parametrize("recipe,mla", [("tensorwise", False), ("delayed", False), ("delayed", True)])
def test_recomputed_fp8_forward_equals_the_stored_one(recipe, mla):
    """``mla``: multi-latent attention, its down-projections' fp8 too (selective: its core recomputed)."""
    loss, grads, amaxes = _step(recipe, "none", mla)
    for recompute in ("full", "selective"):
        got_loss, got_grads, got_amaxes = _step(recipe, recompute, mla)
        assert torch.equal(got_loss, loss), recompute
        assert all(torch.equal(got_grads[n], g) for n, g in grads.items()), recompute
        assert got_amaxes == amaxes and (recipe == "tensorwise" or min(amaxes) > 0), recompute


def test_an_evaluation_forward_records_no_amax():
    """Only the passes that train feed the delayed recipe's step amaxes: a validation forward between steps leaves
    them alone, so the next scales do not depend on when the job evaluates."""
    model = GPTModel(GPTConfig(**MODEL, fp8="e4m3", fp8_recipe="delayed"))
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(tokens[:, :-1], tokens[:, 1:])
    assert all(float(a) == 0 for s in fp8_states(model) for a in s.step_amax.values())
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert all(float(a) > 0 for s in fp8_states(model) for a in s.step_amax.values())


def _tp_step(recipe, extra):
    """One forward and backward at TP 2 with sequence parallelism on this gloo rank: loss, this rank's gradients and
    the delayed recipe's step amaxes."""
    import torch.distributed as dist
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    from ds_megatron.tensor_parallel import RNGStatesTracker, model_parallel_seed
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=2))
    torch.manual_seed(5)
    tracker = RNGStatesTracker()
    cfg = GPTConfig(**{**MODEL, **extra}, fp8="hybrid", fp8_recipe=recipe, sequence_parallel=True)
    model = GPTModel(cfg, state, rng_tracker=tracker)
    model_parallel_seed(7, state.tp.rank, tracker=tracker)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(11)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    amaxes = [float(a) for s in fp8_states(model) if recipe == "delayed" for a in s.step_amax.values()]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    state.destroy()
    return loss.detach(), grads, amaxes


@pytest.mark.parametrize("recipe,dropout", [("tensorwise", 0.0), ("delayed", 0.1)])
def test_a_fully_recomputed_layer_runs_its_mlp_tiles_as_the_stored_forward_does(recipe, dropout):
    """TP 2 + SP, three MLP tiles over a rank's 8 rows: a layer recomputed whole runs its MLP tile by tile in the
    forward and in the rerun (each tile its own checkpoint, rerun again in its backward), so each tile's amax is the
    one the run without full recomputation reduces: loss, gradients and step amaxes equal that run's, bit for bit.
    Tensorwise, a tile's scale is its own: the untiled full recomputation's loss differs."""
    from harness import run_on_ranks
    tiled = dict(mlp_sequence_tiles=3, hidden_dropout=dropout)
    stored = run_on_ranks(2, _tp_step, recipe, tiled)
    rerun = run_on_ranks(2, _tp_step, recipe, dict(tiled, recompute_granularity="full"))
    for (loss, grads, amaxes), (got_loss, got_grads, got_amaxes) in zip(stored, rerun):
        assert torch.equal(got_loss, loss)
        assert all(torch.equal(got_grads[n], g) for n, g in grads.items())
        assert got_amaxes == amaxes and (recipe == "tensorwise" or min(amaxes) > 0)
    if recipe == "tensorwise":
        untiled = run_on_ranks(2, _tp_step, recipe, dict(hidden_dropout=dropout, recompute_granularity="full"))
        assert all(not torch.equal(u[0], s[0]) for u, s in zip(untiled, stored))
