"""What fp8 cannot run yet is refused at start, one line naming the setting and the fix (ConfigError from the
config layer, before any process group); what it runs is accepted and lands in the model."""
from __future__ import annotations

import pytest

from ds_megatron.config import split_config
from ds_megatron.errors import ConfigError


def job(model=None, bf16=True, **megatron):
    model = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128, "fp8": "e4m3",
             **(model or {})}
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": bf16}, "megatron": {"model": model, **megatron}}


# blockwise MLA whose widths tile at TP 1: the latents 128, 2 x 64 per head for q and k/v, 2 x 32 for v;
# kv_lora_rank + qk_pos_emb_head_dim = 160 leaves a partial tile, which the recipe quantizes over its own elements
MLA_BLOCKWISE = {"fp8_recipe": "blockwise", "multi_latent_attention": True, "position_embedding_type": "rope",
                 "hidden_size": 128, "q_lora_rank": 128, "kv_lora_rank": 128, "qk_head_dim": 32,
                 "qk_pos_emb_head_dim": 32, "v_head_dim": 32}


def refused(config, world: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        split_config(config)[1].layout(world)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("config,world,names", [
    (job(bf16=False), 1, ("model.fp8", "bf16.enabled")),
    (job(model={"num_query_groups": 1}, tensor_model_parallel_size=2), 2,
     ("num_query_groups=1 below tensor_model_parallel_size=2", "replicated KV")),
    (job(model={"num_experts": 4, "fp8_recipe": "blockwise", "moe_ffn_hidden_size": 128},
         tensor_model_parallel_size=2, sequence_parallel=True), 2,
     ("model.moe_ffn_hidden_size=128", "128 x expert_tensor_parallel_size=256")),
    (job(model={"num_experts": 4, "attention_dropout": 0.0}, context_parallel_size=2), 2,
     ("num_experts", "tp=1, cp=2", "ep=1, etp=1", "multiple of tp x cp")),
    (job(model={"num_experts": 4}, tensor_model_parallel_size=2, expert_tensor_parallel_size=1), 2,
     ("tp=2, cp=1", "ep=1, etp=1")),
    (job(model={"fp8_recipe": "blockwise", "seq_length": 256, "attention_dropout": 0.0}, context_parallel_size=2), 2,
     ("model.seq_length=256", "context_parallel_size=2", "multiple of 512")),
    (job(model={"fp8_recipe": "blockwise", "seq_length": 512, "attention_dropout": 0.0}, context_parallel_size=2,
         data={"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}), 2,
     ("data packs documents", "\"tensorwise\"")),
    (job(model={"fp8_recipe": "blockwise", "seq_length": 512, "attention_dropout": 0.0, "num_experts": 4},
         context_parallel_size=2, expert_model_parallel_size=2), 2, ("num_experts", "rank order", "\"tensorwise\"")),
    (job(model={"fp8": "e5m2"}), 1, ("model.fp8='e5m2'", "'hybrid'")),
    (job(model={"fp8_recipe": "mxfp8"}), 1, ("model.fp8_recipe='mxfp8'", "'blockwise'")),
    (job(model={"fp8_margin": -1}), 1, ("model.fp8_margin", ">= 0")),
    (job(model={"fp8_recipe": "blockwise", "hidden_size": 192, "num_attention_heads": 3}), 1,
     ("model.hidden_size=192", "multiple of 128")),
    (job(model={"fp8_recipe": "blockwise", "seq_length": 96}), 1, ("model.seq_length=96", "multiple of 128")),
    (job(model={"fp8_recipe": "blockwise", "ffn_hidden_size": 384}, tensor_model_parallel_size=2), 2,
     ("model.ffn_hidden_size=384", "128 x tensor_model_parallel_size=256")),
    (job(model={**MLA_BLOCKWISE, "kv_lora_rank": 64}), 1, ("model.kv_lora_rank=64", "multiple of 128")),
    (job(model=MLA_BLOCKWISE, tensor_model_parallel_size=2), 2,
     ("model.num_attention_heads * v_head_dim=128", "128 x tensor_model_parallel_size=256")),
    (job(fp8_param_gather=True), 1, ("fp8_param_gather",)),
])
def test_refused_at_start_naming_the_setting_and_the_fix(config, world, names):
    message = refused(config, world)
    for name in names:
        assert name in message, message


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
@pytest.mark.parametrize("cuda_graph", [{"impl": "local"}, {"impl": "transformer_engine", "scope": ["attn"]},
                                        {"impl": "transformer_engine", "scope": ["attn", "moe_router"]}])
def test_every_recipe_is_accepted_with_cuda_graphs(recipe, cuda_graph):
    experts = {"num_experts": 4} if "moe_router" in cuda_graph.get("scope", ()) else {}
    cfg = split_config(job(model={"fp8_recipe": recipe, "fp8": "hybrid", **experts}, cuda_graph=cuda_graph))[1]
    cfg.layout(1)
    assert cfg.cuda_graph.enabled and cfg.model.fp8_recipe == recipe
    if recipe == "tensorwise":  # fp8_param_gather too
        cfg = split_config(job(model=experts, cuda_graph=cuda_graph, fp8_param_gather=True,
                               use_distributed_optimizer=True))[1]
        cfg.layout(1)
        assert cfg.cuda_graph.enabled and cfg.ddp.fp8_param_gather


def test_blockwise_mla_whose_widths_tile_is_accepted():
    split_config(job(model=MLA_BLOCKWISE))[1].layout(1)
    split_config(job(model={**MLA_BLOCKWISE, "num_attention_heads": 8}, tensor_model_parallel_size=2))[1].layout(2)


def test_accepted_recipes_and_the_bf16_layers():
    cfg = split_config(job(model={"fp8": "hybrid", "fp8_recipe": "blockwise", "first_last_layers_bf16": True,
                                  "num_layers_at_end_in_bf16": 2}))[1]
    cfg.layout(1)
    model = cfg.model
    assert (model.fp8, model.fp8_recipe) == ("hybrid", "blockwise")
    # 4 layers, 1 at the start and 2 at the end in bf16: only layer 1 runs fp8.
    assert [model.fp8_layer(i) for i in range(4)] == [False, True, False, False]
    assert split_config(job(model={"fp8": None}))[1].model.fp8_layer(1) is False


@pytest.mark.parametrize("megatron", [
    {"context_parallel_size": 2},  # each rank's sequence slice: amaxes agreed over TP x CP
    {"context_parallel_size": 2, "expert_model_parallel_size": 2, "model": {"num_experts": 4}},  # EP covers CP
    {"tensor_model_parallel_size": 2, "sequence_parallel": True, "model": {"num_experts": 4}},  # ETP = TP
    {"expert_model_parallel_size": 2, "model": {"num_experts": 4, "fp8_recipe": "delayed"}},  # ETP x expert-DP
])
def test_accepted_with_context_parallelism_and_experts(megatron):
    megatron = dict(megatron)
    model = {"attention_dropout": 0.0, **megatron.pop("model", {})}
    split_config(job(model=model, **megatron))[1].layout(2)


def test_the_plan_counts_every_fp8_setting_it_accepts():
    from ds_megatron.planning.report import plan_from_config
    mla = {"multi_latent_attention": True, "position_embedding_type": "rope", "q_lora_rank": 64, "kv_lora_rank": 32,
           "qk_head_dim": 32, "qk_pos_emb_head_dim": 16, "v_head_dim": 32}
    # Counted (tests/fp8/test_fp8_plan.py, tests/optimizer/test_planning.py): every recipe, experts (with a shared
    # expert), CP, ZB-H1 and MLA.
    zero_bubble = {"pipeline_model_parallel_size": 2, "pipeline_schedule": "zero_bubble"}
    for model, megatron in ((mla, {}), ({"fp8_recipe": "blockwise"}, {}), ({"fp8_recipe": "delayed"}, {}),
                            ({"num_experts": 4, "moe_shared_expert_intermediate_size": 256}, {}),
                            ({"attention_dropout": 0.0}, {"context_parallel_size": 2}),
                            ({}, zero_bubble), ({"num_experts": 4}, zero_bubble)):
        header, plans, comm = plan_from_config({**job(model=model, **megatron), "gradient_accumulation_steps": 4}, 2)
        assert plans[0].activation_bytes > 0


@pytest.mark.parametrize("experts", [None, 4])  # experts with ZB-H1: their fp8 weight gradients deferred too
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zero_bubble"])
def test_the_delayed_recipe_with_every_pipeline_schedule_is_accepted(schedule, experts):
    extra = {"num_layers_per_virtual_pipeline_stage": 1} if schedule == "interleaved_1f1b" else {}
    cfg = split_config({**job(model={"fp8_recipe": "delayed", "num_experts": experts}, pipeline_model_parallel_size=2,
                              pipeline_schedule=schedule, **extra), "gradient_accumulation_steps": 4})[1]
    cfg.layout(2)
    assert cfg.model.fp8_recipe == "delayed"
