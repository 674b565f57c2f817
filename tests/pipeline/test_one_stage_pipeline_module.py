"""A one-stage DeepSpeed ``PipelineModule`` trains through ``ds_megatron.initialize`` as through
``deepspeed.initialize``: on one rank (``num_stages=1``, as DeepSpeed's ``TestPipeModuleCheckpointInterval``
builds it) and on four data-parallel ranks (``PipeDataParallelTopology(num_pp=1, num_dp=4)``, as its
``TestPipeDynamicShape`` does).  With one stage the first and the last stage are one rank, whose embedding group
is that rank alone.

The same module, seed and batches go through each entry point (``test_user_pipeline_module``'s helpers); the
losses of every step and the final weights must be bit-identical, since the same DeepSpeed engine runs both.
Our own ``GPTPipelineModule`` with one stage (MoE, routing loss on) trains as with two; an order that puts
DeepSpeed's data and model axes on other ranks than ours is still refused.
"""
import pytest
import torch

from harness import run_on_ranks
from test_user_pipeline_module import _config, _module, _train

GAS = 2


def _initial_weights(case: str):
    from ds_megatron.integration.pipeline import destroy_pipeline_module_groups
    model = _module(case)  # seeded: the weights both runs start from
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    destroy_pipeline_module_groups(model)
    return weights


@pytest.mark.parametrize("ranks,case", [(1, "one-stage"), (4, "one-stage-topology")])
def test_a_one_stage_pipeline_module_trains_as_with_deepspeed_initialize(ranks, case):
    theirs = run_on_ranks(ranks, _train, case, False, GAS)
    ours = run_on_ranks(ranks, _train, case, True, GAS)
    for (our_losses, our_weights, sizes, _), (their_losses, their_weights, _, _) in zip(ours, theirs):
        assert sizes == (1, ranks, 1)  # pp, dp, tp read off the module's topology
        assert our_losses == their_losses
        assert our_weights.keys() == their_weights.keys()
        assert all(torch.equal(our_weights[k], their_weights[k]) for k in our_weights)
    # The steps did something: every weight moved from where both runs started.
    start = run_on_ranks(ranks, _initial_weights, case)[0]
    assert start.keys() == ours[0][1].keys()
    assert not any(torch.equal(start[k], ours[0][1][k]) for k in start)
    assert all(torch.isfinite(torch.tensor(ours[0][0])))
    # Data parallel: every rank saw other batches, the engine reports their mean on each.
    assert all(r[0] == ours[0][0] for r in ours)


def _one_stage_with_crossed_order():
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    import ds_megatron
    from ds_megatron.integration.pipeline import destroy_pipeline_module_groups
    model = PipelineModule(layers=[torch.nn.Linear(8, 8)], loss_fn=torch.nn.MSELoss(),
                           topology=PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2))
    config = {**_config(GAS), "megatron": {"tensor_model_parallel_size": 2, "order": "dp-tp-pp"}}
    state = ds_megatron.initialize_model_parallel(config)
    try:
        ds_megatron.initialize(model=model, model_parameters=list(model.parameters()), config=config,
                               parallel_state=state)
    except ds_megatron.ConfigError as e:
        return str(e)
    finally:
        destroy_pipeline_module_groups(model)
        state.destroy()
    return "accepted"


def test_an_order_deepspeed_cannot_express_is_still_refused():
    """DeepSpeed's model axis is its fastest (ranks 0-1); megatron.order "dp-tp-pp" puts dp there instead."""
    messages = run_on_ranks(4, _one_stage_with_crossed_order)
    assert all(m.startswith("megatron.order 'dp-tp-pp': DeepSpeed's pipeline topology gives dp groups") for m in
               messages), messages


GPT = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, seq_length=8, vocab_size=40,
           hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=4, num_experts=2,
           moe_aux_loss_coeff=0.01)


def _gpt_losses(pp: int):
    import ds_megatron
    from ds_megatron.models import GPTConfig
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "eps": 1e-4}},
              "megatron": {"pipeline_model_parallel_size": pp}}
    state = ds_megatron.initialize_model_parallel(config)
    torch.manual_seed(5)
    model = ds_megatron.GPTPipelineModule(GPTConfig(**GPT), state)
    engine, _, _, _ = ds_megatron.initialize(model=model, config=config, parallel_state=state)
    losses = []
    for step in range(3):  # every data-parallel rank the same batches: 4 x DP and 2 x DP average the same gradient
        tokens = torch.randint(0, GPT["vocab_size"], (GAS, 2, GPT["seq_length"] + 1),
                               generator=torch.Generator().manual_seed(step))
        batches = iter([(t[:, :-1], (t[:, 1:], torch.ones(2, GPT["seq_length"]))) for t in tokens])
        losses.append(float(engine.train_batch(batches)))
    engine.megatron.destroy()
    return losses


def test_a_one_stage_gpt_pipeline_module_trains_as_two_stages():
    one, two = run_on_ranks(4, _gpt_losses, 1), run_on_ranks(4, _gpt_losses, 2)
    # The two may sum the tied embedding's gradients in another order: float32 noise, which Adam's eps of 1e-4 keeps
    # from growing (test_pipeline_equivalence.py derives the 1e-5).  Seen: equal; 6e-8 in the third loss at eps 1e-8.
    torch.testing.assert_close(torch.tensor(one), torch.tensor(two), rtol=1e-5, atol=1e-5)
