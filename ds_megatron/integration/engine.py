"""``ds_megatron.initialize``: ``deepspeed.initialize`` plus Megatron's process groups and machinery.

The flow a user sees::

    state = ds_megatron.initialize_model_parallel("ds_configs/gpt_cpu_tp2_dp2.json")
    model = GPTModel(gpt_config, state)          # TP layers need their groups at construction
    engine, optimizer, loader, scheduler = ds_megatron.initialize(model=model, config=..., parallel_state=state)

``initialize`` accepts everything ``deepspeed.initialize`` accepts and returns
the same tuple.  The ``"megatron"`` section is parsed and checked before any
process group exists, removed from the config DeepSpeed sees, and turned into
our groups and mpu.  With no section the job is a plain DeepSpeed job (its own
optimizer, precision and clipping; every rank data parallel): the mpu only
names the groups DeepSpeed would have made.  Any section, even ``{}``, selects
the Megatron optimizer path, whose gradients our buffers reduce
(``integration.gradients``).  ``engine.megatron`` holds what was built.

With ``pipeline_model_parallel_size > 1`` the model is this rank's ``GPTModelChunks``:
``initialize`` returns DeepSpeed's plain engine with our pipeline runtime as its
``train_batch(it)`` / ``eval_batch`` (``integration.pipeline_runtime``), which run
``gradient_accumulation_steps`` micro-batches through the stages and step.  A
DeepSpeed ``PipelineModule`` built on ``pipeline_topology`` (a user's, or
``GPTPipelineModule``) gets DeepSpeed's ``PipelineEngine`` (``integration.pipeline``).  Without a section, a DeepSpeed
``PipelineModule`` brings its own topology, as it does to ``deepspeed.initialize``.

Checks that need the built model run here too, before the engine exists: the config alone
cannot know the model a user brings, and two layouts train without an error and give a wrong
result when the model does not take part in them:

* ``tensor_model_parallel_size > 1`` with no tensor-parallel parameter (a plain Hugging Face
  model): the TP ranks of a group read the same batch, no layer splits anything and nothing
  reduces across them, so the group trains identical replicas of one data-parallel share and
  the rest of the batch is never seen by them.  Our layers mark their split weights
  ``tensor_model_parallel=True`` (``tensor_parallel.params``).
* ``expert_model_parallel_size > 1`` with no expert parameter (ours are marked ``is_expert``,
  DeepSpeed's ``allreduce=False``): the expert groups shard nothing.

Both raise a ``ConfigError`` naming the setting and the fix, before the engine exists.  So do,
on DeepSpeed's optimizer path, a layout of our MoE layers that DeepSpeed's MoE checkpoint cannot
save, what DeepSpeed's optimizers get wrong with a user's MoE model (``config.megatron.check_deepspeed_optimizer``,
which the config already applied to our GPT), and an ``lr_scheduler=`` given together with a ``"scheduler"``
section.

On DeepSpeed's optimizer path three more things make its optimizers right with our layouts: ZeRO 1/2 get our
experts in DeepSpeed's MoE param groups and know our MoE layers when they are built
(``integration.moe.zero_expert_param_groups``, ``seams.engines_built_with_moe``); its fp32 clipping without ZeRO
divides by Megatron's true global norm (``clip_fp32_by_the_global_norm``); and the step its 16-bit optimizer
without ZeRO takes at construction is undone (``seams.undo_construction_step``).  The delayed fp8 recipe's amax
histories advance after each of its optimizer steps (``advance_delayed_fp8_after_each_step``), as
``finalize_model_grads`` advances them on ours.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

import deepspeed
import torch
import torch.distributed as dist

from ..config import MegatronConfig, split_config, world_size_from_env
from ..config.megatron import check_deepspeed_optimizer
from ..config.pipeline import pipeline_schedule, virtual_pipeline_size
from ..distributed import DistributedDataParallel, finalize_model_grads
from ..errors import ConfigError
from ..fp8 import delayed_scaling_groups, update_delayed_scaling
from ..models.gpt_chunks import GPTModelChunks
from ..optimizer import clip_grad_by_total_norm_fp32
from ..optimizer.clip_grads import get_grad_norm_with_experts
from ..parallel_state import ParallelState
from ..tensor_parallel.layers import fp8_states
from ..tensor_parallel.params import is_expert_param
from ..utils.collectives import record
from .cuda_graphs import CudaGraphEngineHook, PipelineRuntimeCudaGraphs, attach_cuda_graphs
from .gradients import MegatronDDPInEngine, complete_tp_partial_grads_in_backward
from .moe import (check_deepspeed_moe_checkpoint_layout, hand_expert_groups_to_deepspeed, mark_engine_has_our_moe,
                  moe_layers, our_num_experts, prepare_deepspeed_moe, zero_expert_param_groups)
from .mpu import MegatronMPU
from .optimizer import prepare_optimizer_path
from .pipeline import (GPTPipelineModule, PipelineModule, check_model_stages, destroy_pipeline_module_groups,
                       parallel_config_of, pipeline_deepspeed_config, prepare_pipeline_module,
                       set_routing_loss_scale)
from .pipeline_runtime import PipelineRuntime, attach_pipeline_runtime
from .runtime import adopt_existing_process_group, init_distributed_from_env
from .seams import (after_optimizer_step, count_pipeline_sends, engines_built_with_moe, install_rng_tracker,
                    report_precision, set_fp32_clipping, undo_construction_step)

ConfigLike = Union[str, Dict[str, Any]]
logger = logging.getLogger("ds_megatron")


@dataclass
class MegatronContext:
    """What ``initialize`` attaches to the engine as ``engine.megatron``."""

    config: MegatronConfig
    state: ParallelState
    mpu: MegatronMPU
    ddp: Optional[DistributedDataParallel] = None  # the gradient reducer on the Megatron path
    ddp_in_engine: Optional[MegatronDDPInEngine] = None
    cuda_graphs: Union[CudaGraphEngineHook, PipelineRuntimeCudaGraphs, None] = None  # when graphs are captured
    has_moe: bool = False
    pipeline_module: Optional[PipelineModule] = None  # the stage this rank runs, on DeepSpeed's pipeline engine
    pipeline_runtime: Optional[PipelineRuntime] = None  # our schedule over GPTModelChunks
    stop_counting_sends: Optional[Callable[[], None]] = None  # undoes seams.count_pipeline_sends

    def finalize_model_grads(self) -> None:
        """Finish this window's gradient sync now (the optimizer step would): for a loop that reads the reduced
        gradients (``tensor_parallel.grad_of(param)``) between the last ``engine.backward`` and ``engine.step``."""
        if self.ddp is not None:
            finalize_model_grads([self.ddp], self.state)

    def destroy(self) -> None:
        """End of the job (collective): engine hooks detached, the pipeline module's own groups and ours destroyed.

        A process that builds engine after engine (tests, notebooks) keeps no groups of the old ones; their gloo
        threads end when the groups are collected (engines and optimizers hold reference cycles: ``gc.collect()``
        frees them at once, measured: ~600 threads of 200 destroyed groups back to 5).
        """
        if self.cuda_graphs is not None:
            self.cuda_graphs.detach()
        if self.ddp_in_engine is not None:
            self.ddp_in_engine.detach()
        if self.stop_counting_sends is not None:
            self.stop_counting_sends()
        if self.pipeline_module is not None:
            destroy_pipeline_module_groups(self.pipeline_module)
        if self.pipeline_runtime is not None:
            self.pipeline_runtime.destroy()
        self.state.destroy()


def _config_source(args, config, config_params) -> Tuple[Optional[ConfigLike], Any]:
    """The one config the caller gave, and ``args`` with its config path removed (DeepSpeed refuses two)."""
    sources = []
    if config is not None:
        sources.append(config)
    if config_params is not None:
        sources.append(config_params)
    if args is not None:
        arg_path = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
        if arg_path is not None:
            sources.append(arg_path)
            args = copy.copy(args)
            for name in ("deepspeed_config", "deepscale_config"):
                if hasattr(args, name):
                    setattr(args, name, None)
    if len(sources) > 1:
        raise ConfigError("a DeepSpeed config was given more than once (config=, config_params= or "
                          "args.deepspeed_config); pass exactly one")
    return (sources[0] if sources else None), args


def validate_config(config: ConfigLike, world_size: Optional[int] = None) -> Tuple[Dict[str, Any], MegatronConfig]:
    """Parse and check the config against the job's world size, creating nothing."""
    ds_config, mcfg = split_config(config)
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else world_size_from_env()
    if world_size is not None:
        mcfg.layout(world_size)
    return ds_config, mcfg


def _init_distributed(dist_init_required: Optional[bool] = None, mcfg: Optional[MegatronConfig] = None) -> None:
    if dist.is_initialized():
        adopt_existing_process_group(dist_init_required)
    elif mcfg is None:
        init_distributed_from_env()
    else:  # megatron.train.collective_timeout_minutes bounds every collective's wait for a peer
        init_distributed_from_env(timeout=datetime.timedelta(minutes=mcfg.train.collective_timeout_minutes))


def initialize_model_parallel(config: Union[ConfigLike, MegatronConfig]) -> ParallelState:
    """Validate, start torch.distributed if needed, and build every group: a ``ParallelState``."""
    mcfg = config if isinstance(config, MegatronConfig) else validate_config(config)[1]
    _init_distributed(mcfg=mcfg)
    return build_parallel_state(mcfg, mcfg.layout(dist.get_world_size()))


def build_parallel_state(mcfg: MegatronConfig, layout) -> ParallelState:
    """Every group of ``layout``, and Megatron's hierarchical CP groups when the config asks for them."""
    state = ParallelState.build(layout)
    sizes = mcfg.parallel.hierarchical_context_parallel_sizes
    if sizes is not None:
        state.build_hierarchical_context_parallel(sizes[0])
    return state


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required: Optional[bool] = None, collate_fn=None,
               config: Optional[ConfigLike] = None, config_params: Optional[ConfigLike] = None,
               parallel_state: Optional[ParallelState] = None, **deepspeed_kwargs):
    """Like ``deepspeed.initialize`` (same arguments, same return tuple), with our groups and mpu.

    ``parallel_state``: the ``ParallelState`` the model was built with (from
    ``initialize_model_parallel``); built here from the config when omitted.
    """
    source, args = _config_source(args, config, config_params)
    if source is None:
        raise ConfigError("no DeepSpeed config given; pass config= (a path or a dict) or args with "
                          "--deepspeed_config")
    ds_config, mcfg = validate_config(source)
    check_one_scheduler(ds_config, lr_scheduler)
    if mpu is not None:
        raise ConfigError("mpu= was given to ds_megatron.initialize, which builds its own from the "
                          "\"megatron\" section; drop mpu= or call deepspeed.initialize directly")
    if isinstance(model, PipelineModule) and not mcfg.section_given:
        # A plain DeepSpeed pipeline job: its module's topology is the layout, as deepspeed.initialize takes it.
        mcfg.parallel = parallel_config_of(model)
    if model is not None:  # before any group exists
        parallel = mcfg.parallel
        check_model_stages(model, parallel.pipeline_model_parallel_size, pipeline_schedule(parallel),
                           virtual_pipeline_size(parallel, getattr(getattr(model, "config", None), "num_layers", None),
                                                 parallel.pipeline_model_parallel_size))
    _init_distributed(dist_init_required, mcfg)
    layout = mcfg.layout(dist.get_world_size())
    if parallel_state is None:
        parallel_state = build_parallel_state(mcfg, layout)
    elif parallel_state.layout != layout:
        raise ConfigError(f"parallel_state was built for {parallel_state.layout} but the config asks for {layout}; "
                          "build it from the same config")
    chunked = isinstance(model, GPTModelChunks)  # our pipeline runtime, on DeepSpeed's plain engine
    # DeepSpeed's PipelineEngine: every PipelineModule, one stage too (it takes the module's grid, never an mpu)
    pipeline = isinstance(model, PipelineModule) or (layout.pp > 1 and not chunked)
    if pipeline:
        # Before the buffers are built: the tied embedding's copies are marked for their layout.
        prepare_pipeline_module(model, parallel_state, our_buffers=mcfg.precision.owns_optimizer)
        if mcfg.section_given:  # a plain DeepSpeed job keeps DeepSpeed's own pipeline defaults
            ds_config = pipeline_deepspeed_config(ds_config)
    rng_tracker = getattr(model, "rng_tracker", None)
    if rng_tracker is not None:
        install_rng_tracker(rng_tracker)
    our_mpu = MegatronMPU(parallel_state, rng_tracker=rng_tracker)
    # DeepSpeed's own MoE layers: their expert groups, made before our buffers are built.
    optimizer_state = prepare_deepspeed_moe(model, parallel_state, mcfg, ds_config, our_mpu)
    # The section's sizes must be ones the model takes part in (a GPT stage may hold no MoE layer; a plain
    # DeepSpeed job takes its sizes from its own PipelineModule).
    if mcfg.section_given and not isinstance(model, (GPTPipelineModule, GPTModelChunks)):
        check_model_uses_layout(model, parallel_state)
    is_last_stage = parallel_state.pp.rank == parallel_state.pp.size - 1
    opt_path = prepare_optimizer_path(ds_config, mcfg, model, optimizer, model_parameters, optimizer_state,
                                      outputs_feed_the_loss=is_last_stage)
    # The whole model's question (a pipeline stage may hold no MoE layer): it decides collectives at checkpoints.
    has_moe = model is not None and (bool(model.config.num_experts)
                                     if isinstance(model, (GPTPipelineModule, GPTModelChunks))
                                     else bool(moe_layers(model)))
    moe_on_deepspeed_path = has_moe and not mcfg.precision.owns_optimizer
    if mcfg.section_given and not mcfg.precision.owns_optimizer:  # a user's model: its experts are known now
        notice = check_deepspeed_optimizer(mcfg.precision, mcfg.deepspeed_batch.zero_stage, layout.tp, layout.pp,
                                           has_moe)
        if notice and notice not in mcfg.notices:
            mcfg.notices.append(notice)
    if has_moe:
        if moe_on_deepspeed_path:
            check_deepspeed_moe_checkpoint_layout(parallel_state)
        # DeepSpeed's own expert groups need EP to divide DP (folding breaks that): hand it ours.
        hand_expert_groups_to_deepspeed(parallel_state)
    building = contextlib.nullcontext()
    if moe_on_deepspeed_path and moe_layers(model) and mcfg.deepspeed_batch.zero_stage in (1, 2):
        # ZeRO partitions this rank's experts over their own groups, which it must know of when it is built
        opt_path.optimizer, opt_path.model_parameters, lr_scheduler = zero_expert_param_groups(
            model, opt_path.optimizer, opt_path.model_parameters, lr_scheduler)
        building = engines_built_with_moe(our_num_experts(model))

    # A PipelineModule brings DeepSpeed its grid (our groups, check_topology_matches); DeepSpeed refuses an mpu then.
    with building:
        engine, opt, loader, sched = deepspeed.initialize(
            args=args, model=model, optimizer=opt_path.optimizer, model_parameters=opt_path.model_parameters,
            training_data=training_data, lr_scheduler=lr_scheduler, mpu=None if pipeline else our_mpu,
            dist_init_required=dist_init_required, collate_fn=collate_fn, config=opt_path.ds_config,
            **deepspeed_kwargs)
    if isinstance(model, GPTPipelineModule) or (chunked and layout.pp > 1):  # a GPTPipelineModule: one stage too
        set_routing_loss_scale(model, opt_path.optimizer, engine.gradient_accumulation_steps())
    context = MegatronContext(config=mcfg, state=parallel_state, mpu=our_mpu, ddp=opt_path.ddp, has_moe=has_moe,
                              pipeline_module=model if pipeline else None)
    if pipeline:  # the stage-to-stage sends DeepSpeed's engine makes, counted inside count_bytes() like ours
        pp_group = parallel_state.pp
        context.stop_counting_sends = count_pipeline_sends(lambda tensor: record("send", pp_group, tensor))
    engine.megatron = context
    if chunked:  # engine.train_batch / eval_batch run our schedule; its buffers are the reducer
        context.pipeline_runtime = attach_pipeline_runtime(engine, model, parallel_state, opt_path.ddp,
                                                           mcfg.parallel.microbatch_group_size_per_vp_stage,
                                                           pipeline_schedule(mcfg.parallel))
    elif opt_path.ddp is not None:  # our buffers are the reducer: DeepSpeed's own reduction off
        context.ddp_in_engine = MegatronDDPInEngine(engine, opt_path.ddp)
    elif model is not None:  # DeepSpeed reduces over data parallel; TP-partial grads are completed in backward
        complete_tp_partial_grads_in_backward(model, parallel_state)
        if mcfg.section_given and not pipeline:
            clip_fp32_by_the_global_norm(engine, model, parallel_state)
        advance_delayed_fp8_after_each_step(engine, model, parallel_state)
    if moe_on_deepspeed_path:  # DeepSpeed reduces and checkpoints the experts: its path only
        mark_engine_has_our_moe(engine)
    if mcfg.section_given and not mcfg.precision.owns_optimizer:
        undo_construction_step(engine)  # its 16-bit optimizer without ZeRO then takes Adam's first step as the first
    if mcfg.precision.owns_optimizer and model is not None:
        report_precision(engine, mcfg.precision)  # engine.bfloat16_enabled(), gradient_clipping(), ... tell the truth
    if dist.get_rank() == 0:
        for notice in mcfg.notices:  # DeepSpeed keys without effect on our path, named once
            logger.warning(notice)
    if mcfg.cuda_graph.enabled:  # capture after warmup_steps, then replay; without CUDA: one log line
        context.cuda_graphs = attach_cuda_graphs(engine, mcfg.cuda_graph)
    return engine, opt, loader, sched


def clip_fp32_by_the_global_norm(engine, model: torch.nn.Module, state: ParallelState) -> None:
    """DeepSpeed's fp32 clipping (no fp16, bf16 or ZeRO) by Megatron's true global norm.

    DeepSpeed's ``clip_grad_norm_`` sums squares over the mpu's model-parallel group and then averages the
    norm over data parallel: experts spread over data-parallel ranks (EP folding) give every rank another
    norm (measured at TP 2 x EP 2: 1.1055 where the global norm is 1.1142), and the TP copies of a KV head
    count twice.  Dense params are counted once over tp-pp, experts once over etp-ep-pp.
    """
    if engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization() \
            or engine.gradient_clipping() <= 0:
        return
    params, max_norm = [p for p in model.parameters() if p.requires_grad], engine.gradient_clipping()

    def clip() -> None:
        norm = get_grad_norm_with_experts(params, state.tp.rank, state.mp, state.expert_mp)
        clip_grad_by_total_norm_fp32(params, max_norm, norm)
    set_fp32_clipping(engine, clip)


def advance_delayed_fp8_after_each_step(engine, model: torch.nn.Module, state: ParallelState) -> None:
    """DeepSpeed's optimizer path: the delayed fp8 recipe's histories and scales advance after each optimizer step
    (what ``finalize_model_grads`` does on ours), on every stage, over ``delayed_scaling_groups``."""
    states = [s for s in fp8_states(model) if s.recipe.recipe == "delayed"]
    if states and engine.optimizer is not None:  # an engine without an optimizer takes no step
        after_optimizer_step(engine, functools.partial(update_delayed_scaling, states,
                                                       delayed_scaling_groups(state)))


def check_model_uses_layout(model: Optional[torch.nn.Module], state: ParallelState) -> None:
    """Refuse a TP / EP size that ``model`` has no parameter for (see the module docstring)."""
    if model is None:
        return
    params = list(model.parameters())
    tp, ep = state.layout.tp, state.layout.ep
    if tp > 1 and not any(getattr(p, "tensor_model_parallel", False) for p in params):
        raise ConfigError(f"megatron.tensor_model_parallel_size={tp} but the model has no tensor-parallel parameter "
                          f"(none is marked tensor_model_parallel), so its {tp} TP ranks would train identical "
                          "copies on the same data; build it from ds_megatron.tensor_parallel layers "
                          "(ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding) or set "
                          "tensor_model_parallel_size to 1")
    if ep > 1 and not any(is_expert_param(p) for p in params):
        raise ConfigError(f"megatron.expert_model_parallel_size={ep} but the model has no expert parameter "
                          "(no MoE layer: none is marked is_expert or allreduce=False); use ds_megatron.moe "
                          "layers or set expert_model_parallel_size to 1")


def check_one_scheduler(ds_config, lr_scheduler) -> None:
    """``lr_scheduler=`` and a ``"scheduler"`` section: DeepSpeed would silently use the section
    (``runtime/engine.py`` ``_configure_lr_scheduler``); refuse instead."""
    if lr_scheduler is not None and "scheduler" in ds_config:
        raise ConfigError("lr_scheduler= was given together with a \"scheduler\" config section, and DeepSpeed would "
                          "silently use the section; keep one of them")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``deepspeed.add_config_arguments`` (``--deepspeed``, ``--deepspeed_config``) for scripts that take args."""
    return deepspeed.add_config_arguments(parser)
