"""The GPT puts fp8 on its transformer layers' linears only (not the embeddings, the output layer or MTP's
projection), keeps the first / last layers 16-bit when asked, and trains a step in bf16 with fp8 engaged."""
from __future__ import annotations

import torch

from ds_megatron.config.model import GPTConfig
from ds_megatron.models.gpt import GPTModel
from ds_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear

CFG = dict(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100, hidden_dropout=0.0,
           attention_dropout=0.0, untie_embeddings_and_output_weights=True, mtp_num_layers=1)


def build(**extra) -> GPTModel:
    torch.manual_seed(7)
    return GPTModel(GPTConfig(**{**CFG, **extra})).bfloat16()


def test_only_the_transformer_layers_linears_run_fp8_and_first_last_stay_bf16():
    model = build(fp8="hybrid", first_last_layers_bf16=True)
    linears = {name: m.fp8 for name, m in model.named_modules() if isinstance(m, (ColumnParallelLinear,
                                                                                   RowParallelLinear))}
    on = sorted(name for name, state in linears.items() if state is not None)
    assert on == sorted(f"layers.1.{p}" for p in ("self_attention.query_key_value", "self_attention.dense",
                                                  "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")), on
    assert all(state.recipe.fp8 == "hybrid" for name, state in linears.items() if state is not None)
    # Without first_last_layers_bf16 every layer, the MTP layer's too, but never eh_proj.
    model = build(fp8="e4m3")
    on = {name for name, m in model.named_modules() if getattr(m, "fp8", None) is not None}
    assert len(on) == 4 * 4 and not any("eh_proj" in name or "output_layer" in name for name in on)


def test_a_bf16_training_step_with_fp8_is_close_to_bf16_but_not_equal():
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, 1)
    losses, grads = [], []
    for extra in ({}, {"fp8": "e4m3"}):
        model = build(**extra)
        loss = model(tokens, labels)
        loss.backward()
        losses.append(loss.float().item())
        grads.append(model.layers[1].mlp.dense_h_to_4h.weight.grad.float())
    assert losses[0] != losses[1] and abs(losses[1] - losses[0]) < 0.02 * losses[0], losses
    rel = ((grads[1] - grads[0]).norm() / grads[0].norm()).item()
    assert 1e-3 < rel < 0.2, rel


def test_moe_gpt_runs_experts_and_shared_expert_in_fp8_and_the_router_in_16_bit():
    from ds_megatron.fp8.recipe import FP8LinearState
    from ds_megatron.moe.experts import GroupedMLP, SequentialMLP
    from ds_megatron.tensor_parallel.layers import fp8_states
    moe = dict(num_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=64, mtp_num_layers=None,
               moe_grouped_gemm=True)
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for extra in ({}, {"fp8": "e4m3"}):
        model = build(**{**moe, **extra})
        loss = model(tokens, torch.roll(tokens, -1, 1))
        loss.backward()
        losses.append(loss.float().item())
    # per layer: QKV, attention output, the shared expert's fc1 / fc2, and fc1 / fc2 of each of the 4 experts
    states = fp8_states(model)
    assert len(states) == 3 * (2 + 2 + 2 * 4) and all(isinstance(s, FP8LinearState) for s in states)
    experts = [m for m in model.modules() if isinstance(m, (GroupedMLP, SequentialMLP))]
    assert all(len(e.fp8) == 8 for e in experts) and not hasattr(model.layers[0].mlp.router, "fp8")
    assert model.layers[0].mlp.experts.weight1.grad is not None
    assert losses[0] != losses[1] and abs(losses[1] - losses[0]) < 0.02 * losses[0], losses


def test_every_linear_given_an_fp8_state_runs_its_gemms_in_fp8_mla_included():
    """Each linear the model gives an fp8 state runs in fp8 (its weight reaches ``fp8_linear``), the multi-latent
    attention's up-projections too: they skip the column-parallel layer's forward (their input went through *f*
    once) and once ran in 16-bit beside their unused fp8 states."""
    from unittest import mock
    from ds_megatron.tensor_parallel import weight_grad_store
    mla = dict(position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16,
               qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, mtp_num_layers=None)
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    for extra in ({}, mla):
        model = build(fp8="e4m3", **extra)
        stated = {id(m.weight): name for name, m in model.named_modules() if getattr(m, "fp8", None) is not None}
        ran = set()

        def spy(x, weight, *args, _real=weight_grad_store.fp8_linear):
            ran.add(id(weight))
            return _real(x, weight, *args)
        with mock.patch.object(weight_grad_store, "fp8_linear", spy):
            model(tokens, torch.roll(tokens, -1, 1)).backward()
        assert set(stated) == ran, sorted(stated[w] for w in set(stated) - ran)
        if extra:
            assert any("kv_b_proj" in name for name in stated.values())
