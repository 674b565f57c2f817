"""DeepSpeed's pipeline grid equals our groups rank for rank, for every order; bad pipeline layouts fail at start.

The pure tests read DeepSpeed's ``ProcessTopology`` (what its
``PipelineParallelGrid`` builds every group from) for 120 orders x several
layouts without starting anything; the multi-rank test builds the real grid
inside ``GPTPipelineModule`` and compares its groups, stage ids, p2p
neighbours and tied-weight groups with our ``ParallelState``.
"""
import itertools

import pytest
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.config import ConfigError, split_config
from ds_megatron.config.pipeline import partition_balanced, stage_layer_counts
from ds_megatron.integration.pipeline import pipeline_topology
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.parallel.layout import ParallelLayout

ORDERS = ["-".join(p) for p in itertools.permutations(["tp", "cp", "ep", "dp", "pp"])]
LAYOUTS = [dict(world_size=8, tp=2, pp=2), dict(world_size=8, tp=1, pp=4), dict(world_size=16, tp=2, pp=4),
           dict(world_size=16, tp=4, pp=2), dict(world_size=12, tp=2, pp=3), dict(world_size=8, tp=2, pp=2, ep=2)]


def _layouts():
    for kwargs, order in itertools.product(LAYOUTS, ORDERS):
        try:
            yield ParallelLayout(order=order, **kwargs)
        except ConfigError:  # e.g. expert and dense pp groups differ: refused by the layout itself
            continue


def test_topology_groups_equal_ours_for_every_order():
    checked = 0
    for layout in _layouts():
        topo = pipeline_topology(layout)
        ours = layout.group_ranks()
        for axis, kind in (("pipe", "pp"), ("data", "dp"), ("model", "tp")):
            assert sorted(topo.get_axis_comm_lists(axis)) == sorted(ours[kind]), (layout, axis)
        for rank in range(layout.world_size):
            coord = topo.get_coord(rank)
            mine = layout.coordinates(rank)
            assert (coord.pipe, coord.data, coord.model) == (mine["pp"], mine["dp"], mine["tp"]), (layout, rank)
            # DeepSpeed's p2p neighbour (stage_to_global of the next stage) is the next rank of our pp group.
            pp_group = next(g for g in ours["pp"] if rank in g)
            nxt = topo.get_rank(**coord._replace(pipe=(coord.pipe + 1) % layout.pp)._asdict())
            assert nxt == pp_group[(pp_group.index(rank) + 1) % layout.pp], (layout, rank)
        # Tied weights: DeepSpeed ties stage 0 and stage pp-1 of each (data, model) slice: our embedding groups.
        tied = sorted(sorted([topo.get_rank(pipe=0, data=d, model=m), topo.get_rank(pipe=layout.pp - 1, data=d,
                                                                                      model=m)])
                      for d in range(layout.dp) for m in range(layout.tp))
        assert tied == sorted(sorted(g) for g in ours["embedding"]), layout
        checked += 1
    assert checked > 400


def test_context_parallel_joins_the_data_axis_or_is_refused():
    # DeepSpeed's data axis is our dp-cp (cp replicas hold the same weights); orders where cp is not next to
    # dp cannot be a grid axis and are refused naming the order.
    built = refused = 0
    for order in ORDERS:
        for kwargs in (dict(world_size=8, tp=2, pp=2, cp=2), dict(world_size=16, tp=2, pp=2, cp=2)):
            try:
                layout = ParallelLayout(order=order, **kwargs)
            except ConfigError:
                continue
            try:
                topo = pipeline_topology(layout)
            except ConfigError as err:
                assert "megatron.order" in str(err) and "cp next to dp" in str(err)
                refused += 1
                continue
            ours = layout.group_ranks()
            for axis, kind in (("pipe", "pp"), ("data", "dp-cp"), ("model", "tp")):
                assert sorted(topo.get_axis_comm_lists(axis)) == sorted(ours[kind]), (layout, axis)
            tied = sorted(sorted([topo.get_rank(pipe=0, data=d, model=m), topo.get_rank(pipe=layout.pp - 1, data=d,
                                                                                          model=m)])
                          for d in range(layout.dp * layout.cp) for m in range(layout.tp))
            assert tied == sorted(sorted(g) for g in ours["embedding"]), layout
            built += 1
    assert built > 20 and refused > 0


def _grid_against_state(order, tp):
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
           "megatron": {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": tp, "order": order}}
    state = ds_megatron.initialize_model_parallel(cfg)
    model = ds_megatron.GPTPipelineModule(GPTConfig(num_layers=2, hidden_size=8, num_attention_heads=2,
                                                    seq_length=4, vocab_size=16, make_vocab_size_divisible_by=2),
                                          state)
    grid, me = model._grid, dist.get_rank()
    pp = list(state.pp.ranks)
    out = {
        "stage": grid.get_stage_id() == state.pp.rank,
        "first_last": (grid.is_first_stage, grid.is_last_stage) == (state.pp.rank == 0, state.pp.rank == 1),
        "dp": sorted(grid.dp_group) == sorted(state.dp.ranks),
        "pp": sorted(grid.pp_group) == sorted(pp),
        "tp": sorted(grid.slice_group) == sorted(state.tp.ranks),
        "p2p": grid.p2p_groups[me] == [me, pp[(pp.index(me) + 1) % 2]],
        "tied": sorted(model.tied_comms["word_embeddings"]["ranks"]) == sorted(state["embedding"].ranks),
        "layers": list(model.stage_layers) == [state.pp.rank],
    }
    model.destroy_process_groups()
    state.destroy()
    return out


@pytest.mark.parametrize("order,tp", [("tp-cp-ep-dp-pp", 2), ("tp-cp-ep-dp-pp", 1), ("pp-dp-tp", 1),
                                      ("dp-pp-tp", 2), ("pp-tp-dp", 2)])
def test_deepspeed_grid_is_our_groups(order, tp):
    for rank, checks in enumerate(run_on_ranks(4, _grid_against_state, order, tp)):
        assert all(checks.values()), (rank, checks)


def _job(**megatron):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "megatron": {"pipeline_model_parallel_size": 2,
                        "model": {"num_layers": 4, "hidden_size": 16, "num_attention_heads": 2}}}
    for key, value in megatron.items():
        if key in ("gradient_accumulation_steps", "zero_optimization", "pipeline", "bf16", "gradient_clipping"):
            cfg[key] = value
        elif key == "model":
            cfg["megatron"]["model"].update(value)
        else:
            cfg["megatron"][key] = value
    return cfg


@pytest.mark.parametrize("change,message", [
    (dict(model={"num_layers": 5}), "model.num_layers=5 is not divisible by megatron.pipeline_model_parallel_size=2"),
    (dict(gradient_accumulation_steps=1), "gradient_accumulation_steps=1 is below megatron.pipeline_model_parallel_size=2"),
    (dict(zero_optimization={"stage": 2}, optimizer_impl="deepspeed"),
     "zero_optimization.stage=2 with megatron.pipeline_model_parallel_size=2"),
    (dict(virtual_pipeline_model_parallel_size=2, pipeline_schedule="1f1b"),
     "pipeline_schedule \"1f1b\" runs one model chunk per stage"),
    (dict(context_parallel_size=2, order="cp-tp-ep-dp-pp", model={"attention_dropout": 0.0}),
     "order 'cp-tp-ep-dp-pp' with context_parallel_size 2 and pipeline parallelism"),
    (dict(pipeline_num_layers_per_stage=[3, 2]), r"pipeline_num_layers_per_stage=\[3, 2\] must give 2 stages"),
    (dict(model={"num_layers": 1}), "model.num_layers=1 is below megatron.pipeline_model_parallel_size=2"),
    (dict(model={"num_experts": 2}, optimizer_impl="deepspeed"), "an MoE model with megatron.pipeline_model_parallel"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline={"pipe_partitioned": True}),
     "pipe_partitioned / grad_partitioned with sequence_parallel"),
    (dict(pipeline_partition_method="profile"), "pipeline_partition_method='profile' is unknown"),
    (dict(gradient_clipping=1.0, optimizer_impl="deepspeed"),
     "gradient_clipping=1.0 with megatron.pipeline_model_parallel_size=2 and megatron.optimizer_impl \"deepspeed\""),
])
def test_bad_pipeline_layouts_fail_at_start(change, message):
    with pytest.raises(ConfigError, match=message):
        split_config(_job(**change))[1].layout(8)


def test_good_pipeline_layouts_pass():
    for change in (dict(), dict(model={"num_layers": 5}, pipeline_num_layers_per_stage=[3, 2]),
                   dict(model={"num_layers": 5}, pipeline_partition_method="parameters"),
                   dict(tensor_model_parallel_size=2, sequence_parallel=True)):
        split_config(_job(**change))[1].layout(8)


def test_stage_split():
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    assert stage_layer_counts(5, 2, "parameters") == [2, 3]
    assert stage_layer_counts(6, 3, layers_per_stage=[1, 2, 3]) == [1, 2, 3]
    # Heavy (MoE) layers at even indices: balanced by weight, not by count.
    assert stage_layer_counts(6, 2, "parameters", layer_weights=[5, 1, 5, 1, 5, 1]) == [3, 3]
    assert stage_layer_counts(4, 2, "parameters", layer_weights=[10, 1, 1, 1]) == [1, 3]
    assert partition_balanced([1, 1, 1, 1, 1, 1, 1, 1], 3) == [0, 2, 5, 8]


def _gpt_model_refuses_pp():
    state = ds_megatron.initialize_model_parallel({"train_micro_batch_size_per_gpu": 1,
                                                   "gradient_accumulation_steps": 2,
                                                   "megatron": {"pipeline_model_parallel_size": 2}})
    cfg = GPTConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16)
    model = None
    try:
        with pytest.raises(ValueError, match="build this rank.s part with ds_megatron.GPTModelChunks"):
            GPTModel(cfg, state)
        model = ds_megatron.GPTPipelineModule(cfg, state)
        with pytest.raises(ConfigError, match="has 2 stages but megatron.pipeline_model_parallel_size is 1"):
            ds_megatron.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "megatron": {}})
    finally:
        if model is not None:
            model.destroy_process_groups()
        state.destroy()


def test_pipeline_models_and_layouts_must_agree():
    run_on_ranks(2, _gpt_model_refuses_pp)


def _stage_param_counts():
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
           "megatron": {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2,
                        "pipeline_num_layers_per_stage": [1, 2]}}
    state = ds_megatron.initialize_model_parallel(cfg)
    model = ds_megatron.GPTPipelineModule(GPTConfig(**PLAN_MODEL), state, layers_per_stage=[1, 2])
    out = (state.pp.rank, state.tp.rank, sum(p.numel() for p in model.parameters()))
    model.destroy_process_groups()
    state.destroy()
    return out


PLAN_MODEL = dict(num_layers=3, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=50,
                  make_vocab_size_divisible_by=4, num_experts=None)


def test_plan_per_stage_matches_the_built_stages_and_deepspeeds_schedule():
    from deepspeed.runtime.pipe import schedule as ds_schedule
    from ds_megatron.planning import plan_memory
    layout = ParallelLayout(world_size=4, tp=2, pp=2)
    plans = plan_memory(GPTConfig(**PLAN_MODEL), layout, micro_batches=4, layers_per_stage=[1, 2])
    for stage, tp_rank, params in run_on_ranks(4, _stage_param_counts):
        plan = next(p for p in plans if p.role == f"stage {stage} tp rank {tp_rank}")
        assert plan.params == params and plan.layers == ([0] if stage == 0 else [1, 2])
    # In-flight micro-batches: the most forwards whose backward has not run yet, in DeepSpeed's schedule.
    for pp, m in ((2, 4), (4, 8), (4, 2), (3, 3)):
        layout = ParallelLayout(world_size=pp, pp=pp)
        plans = plan_memory(GPTConfig(**dict(PLAN_MODEL, num_layers=pp)), layout, micro_batches=m)
        for stage, plan in enumerate(plans):
            live, peak = 0, 0
            for step in ds_schedule.TrainSchedule(micro_batches=m, stages=pp, stage_id=stage):
                for cmd in step:
                    live += isinstance(cmd, ds_schedule.ForwardPass) - isinstance(cmd, ds_schedule.BackwardPass)
                    peak = max(peak, live)
            assert plan.in_flight_micro_batches == peak, (pp, m, stage)
