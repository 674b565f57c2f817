"""A DeepSpeed project's own ``PipelineModule`` trains through ``ds_megatron.initialize`` as through
``deepspeed.initialize`` (no ``"megatron"`` section: a drop-in), on 2 and 4 gloo ranks.

Each case trains the same module, built from the same seed, with the same batches, once through each entry
point; the losses of every step and the final weights must be bit-identical (the same DeepSpeed code runs
them).  The cases are DeepSpeed's own pipeline patterns: a sequential model split by parameters, gradient
accumulation, activation checkpointing, a weight tied between stages 0 and 2 of 4 (not the first and the last),
fewer micro-batches than stages, and DeepSpeed's default activation partitioning with a model axis.
``_module`` also builds the one-stage modules ``test_one_stage_pipeline_module.py`` trains with ``_train``.
"""
import pytest
import torch

from harness import run_on_ranks

HIDDEN = 8


def _config(gas: int, extra=None):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, **(extra or {})}


def _module(case: str):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology
    import torch.distributed as dist

    torch.manual_seed(0)
    world = dist.get_world_size()
    layers = [LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN) for _ in range(7)]
    kwargs = {"num_stages": 2}
    if case == "tied-middle-stages":  # 4 stages of two layers, one weight shared by stages 0 and 2
        tied = TiedLayerSpec("shared", torch.nn.Linear, HIDDEN, HIDDEN)
        layers = [LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN), tied, LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN),
                  LayerSpec(torch.nn.Tanh), tied, *(LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN) for _ in range(3))]
        kwargs = {"num_stages": 4, "partition_method": "uniform"}
    elif case == "checkpointing":
        kwargs["activation_checkpoint_interval"] = 1
    elif case == "model-axis":  # DeepSpeed's pipe x data x model grid, its activation partitioning left on
        kwargs = {"topology": PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=world // 4)}
    elif case == "one-stage":  # DeepSpeed's TestPipeModuleCheckpointInterval: one stage, every layer checkpointed
        kwargs = {"num_stages": 1, "activation_checkpoint_interval": 1}
    elif case == "one-stage-topology":  # DeepSpeed's TestPipeDynamicShape with num_pp=1: data parallel only
        kwargs = {"topology": PipeDataParallelTopology(num_pp=1, num_dp=world)}
    return PipelineModule(layers=layers, loss_fn=torch.nn.MSELoss(), **kwargs)


CASES = {  # name: (ranks, gradient accumulation steps)
    "sequential-dp2": (4, 4),
    "checkpointing": (2, 2),
    "tied-middle-stages": (4, 4),
    "fewer-micro-batches-than-stages": (2, 1),
    "model-axis": (4, 2),
}


def _train(case: str, ours: bool, gas: int):
    import deepspeed
    import torch.distributed as dist

    import ds_megatron
    model = _module(case)
    initialize = ds_megatron.initialize if ours else deepspeed.initialize
    engine, _, _, _ = initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                 config=_config(gas))
    g = torch.Generator().manual_seed(1 + engine.grid.get_data_parallel_id())
    batches = [(torch.randn(2, HIDDEN, generator=g), torch.randn(2, HIDDEN, generator=g)) for _ in range(4 * gas)]
    data = iter(batches)
    losses = [float(engine.train_batch(data)) for _ in range(4)]
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    sizes = None
    if ours:
        layout = engine.megatron.state.layout
        sizes = (layout.pp, layout.dp, layout.tp)
        engine.megatron.destroy()  # our groups and the module's own
    else:
        from ds_megatron.integration.pipeline import destroy_pipeline_module_groups
        destroy_pipeline_module_groups(model)
    return losses, weights, sizes, dist.get_rank()


@pytest.mark.parametrize("case", list(CASES))
def test_a_deepspeed_pipeline_module_trains_as_with_deepspeed_initialize(case):
    ranks, gas = CASES[case]
    theirs = run_on_ranks(ranks, _train, case, False, gas)
    ours = run_on_ranks(ranks, _train, case, True, gas)
    stages = 4 if case == "tied-middle-stages" else 2
    model_axis = 2 if case == "model-axis" else 1
    for (our_losses, our_weights, sizes, _), (their_losses, their_weights, _, _) in zip(ours, theirs):
        assert sizes == (stages, ranks // (stages * model_axis), model_axis)  # the layout read off the module
        assert our_losses == their_losses
        assert all(torch.isfinite(torch.tensor(our_losses)))
        assert our_weights.keys() == their_weights.keys()
        assert all(torch.equal(our_weights[k], their_weights[k]) for k in our_weights)
    # The step did something: the last stage's loss moved.
    assert ours[-1][0][-1] != ours[-1][0][0]


def _with_section_still_checked():
    import ds_megatron
    model = _module("sequential-dp2")
    try:
        ds_megatron.initialize(model=model, model_parameters=list(model.parameters()),
                               config={**_config(4), "megatron": {}})
    except ds_megatron.ConfigError as e:
        return str(e)
    return "accepted"


def test_with_a_megatron_section_the_sizes_come_from_the_section():
    """A section opts in to our layout: a 2-stage module against the section's pipeline size 1 is refused."""
    messages = run_on_ranks(4, _with_section_still_checked)
    assert all("has 2 stages but megatron.pipeline_model_parallel_size is 1" in m for m in messages), messages


def _plain_with_clipping():
    import ds_megatron
    model = _module("sequential-dp2")
    try:
        ds_megatron.initialize(model=model, model_parameters=list(model.parameters()),
                               config={**_config(4), "gradient_clipping": 1.0})
    except ds_megatron.ConfigError as e:
        return str(e)
    return "accepted"


def test_what_deepspeed_runs_wrong_is_still_refused():
    """DeepSpeed's pipeline clipping counts replicated parameters on the first stage only: a plain job with
    clipping would clip by a wrong norm, so it is refused in one line naming the fix."""
    messages = run_on_ranks(4, _plain_with_clipping)
    assert all("gradient_clipping=1.0" in m and "set gradient_clipping to 0" in m for m in messages), messages
