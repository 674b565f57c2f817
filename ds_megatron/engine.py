"""``ds_megatron.initialize``: ``deepspeed.initialize`` plus Megatron's process groups.

The flow a user sees::

    state = ds_megatron.initialize_model_parallel("ds_configs/gpt_cpu_tp2_dp2.json")
    model = GPTModel(gpt_config, state)          # TP layers need their groups at construction
    engine, optimizer, loader, scheduler = ds_megatron.initialize(model=model, config=..., parallel_state=state)

``initialize`` accepts everything ``deepspeed.initialize`` accepts and returns
the same tuple.  The ``"megatron"`` section is validated before any process
group exists, removed from the config DeepSpeed sees, and turned into our
groups and mpu; with no section (or all sizes 1) the result is exactly what
``deepspeed.initialize`` gives.
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

from .config import ConfigError, MegatronConfig, split_config, world_size_from_env

ConfigLike = Union[str, Dict[str, Any]]


@dataclass
class MegatronContext:
    """What ``initialize`` attaches to the engine as ``engine.megatron``."""

    config: MegatronConfig
    state: Any  # ParallelState
    mpu: Any  # MegatronMPU
    moe: Any = None  # moe.deepspeed_integration.ExpertCheckpointHooks when the model has MoE layers
    ddp: Any = None  # distributed.DistributedDataParallel when megatron DDP owns the gradients
    cuda_graphs: Any = None  # cuda_graphs.CudaGraphEngineHook when graphs are captured and replayed


def _config_source(args, config, config_params) -> Tuple[Optional[ConfigLike], Any]:
    """The one config the caller gave, and ``args`` with its config path removed (DeepSpeed refuses two)."""
    sources = []
    if config is not None:
        sources.append(config)
    if config_params is not None:
        sources.append(config_params)
    arg_path = None
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
        world_size = _current_world_size()
    if world_size is not None:
        mcfg.layout(world_size)
    return ds_config, mcfg


def _current_world_size() -> Optional[int]:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return world_size_from_env()


def _init_distributed(dist_init_required: Optional[bool] = None) -> None:
    import torch.distributed as dist
    if not dist.is_initialized():
        from .utils.dist_env import init_distributed_from_env
        init_distributed_from_env()
    else:
        # The user initialized torch.distributed (or deepspeed.init_distributed) already:
        # let DeepSpeed's comm layer adopt the existing process group.
        import deepspeed
        deepspeed.init_distributed(dist_init_required=False if dist_init_required is None else dist_init_required)


def initialize_model_parallel(config: Union[ConfigLike, MegatronConfig]):
    """Validate, start torch.distributed if needed, and build every group: a ``ParallelState``."""
    import torch.distributed as dist
    from .parallel.state import ParallelState
    mcfg = config if isinstance(config, MegatronConfig) else validate_config(config)[1]
    _init_distributed()
    return ParallelState.build(mcfg.layout(dist.get_world_size()))


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required: Optional[bool] = None, collate_fn=None,
               config: Optional[ConfigLike] = None, config_params: Optional[ConfigLike] = None,
               parallel_state=None, **deepspeed_kwargs):
    """Like ``deepspeed.initialize`` (same arguments, same return tuple), with our groups and mpu.

    ``parallel_state``: the ``ParallelState`` the model was built with (from
    ``initialize_model_parallel``); built here from the config when omitted.
    The engine gets ``engine.megatron`` (config, state, mpu).
    """
    source, args = _config_source(args, config, config_params)
    if source is None:
        raise ConfigError("no DeepSpeed config given; pass config= (a path or a dict) or args with "
                          "--deepspeed_config")
    ds_config, mcfg = validate_config(source)
    if mpu is not None:
        raise ConfigError("mpu= was given to ds_megatron.initialize, which builds its own from the "
                          "\"megatron\" section; drop mpu= or call deepspeed.initialize directly")
    if mcfg.pipeline_model_parallel_size > 1:
        raise ConfigError("megatron.pipeline_model_parallel_size > 1: the groups are built (see "
                          "`ds-megatron groups`) but no pipeline schedule is wired into the engine yet; set it to 1")

    import deepspeed
    from .parallel.mpu import MegatronMPU
    from .parallel.state import ParallelState

    _init_distributed(dist_init_required)
    import torch.distributed as dist
    layout = mcfg.layout(dist.get_world_size())
    if parallel_state is None:
        parallel_state = ParallelState.build(layout)
    elif parallel_state.layout != layout:
        raise ConfigError(f"parallel_state was built for {parallel_state.layout} but the config asks for {layout}; "
                          "build it from the same config")
    rng_tracker = getattr(model, "rng_tracker", None)
    our_mpu = MegatronMPU(parallel_state, rng_tracker=rng_tracker)
    if rng_tracker is not None:
        # DeepSpeed's activation checkpointing replays dropout with its own module-level
        # tracker (it never asks the mpu); ours must be the one it saves and restores.
        from deepspeed.runtime.activation_checkpointing import checkpointing
        checkpointing._CUDA_RNG_STATE_TRACKER = rng_tracker
    # The Megatron optimizer path casts the model, wraps the optimizer and hands DeepSpeed a
    # config without the precision and clipping it now owns.
    from .optimizer.deepspeed_integration import prepare_optimizer_path
    opt_path = prepare_optimizer_path(ds_config, mcfg, model, optimizer, model_parameters, parallel_state)
    optimizer, model_parameters, ds_config = opt_path.optimizer, opt_path.model_parameters, opt_path.ds_config
    # DeepSpeed's own expert groups need EP to divide DP (folding breaks that): hand it ours.
    from .moe import deepspeed_integration as moe_integration
    has_moe = model is not None and bool(moe_integration.moe_layers(model))
    if has_moe:
        moe_integration.register_expert_groups(parallel_state)

    engine, opt, loader, sched = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
        training_data=training_data, lr_scheduler=lr_scheduler, mpu=our_mpu,
        dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_config, **deepspeed_kwargs)
    engine.megatron = MegatronContext(config=mcfg, state=parallel_state, mpu=our_mpu)
    opt_path.attach(engine)  # takes over the grad all-reduce when our optimizer owns it
    # Expert grads over edp through DeepSpeed's MoE path; expert checkpoints by expert rank.
    engine.megatron.moe = moe_integration.attach_moe(engine, parallel_state) if has_moe else None
    if mcfg.ddp_enabled:  # our bucketed buffers own gradient accumulation and reduction
        from .distributed.deepspeed_hooks import attach_megatron_ddp
        engine.megatron.ddp = attach_megatron_ddp(engine, mcfg.ddp_config(), parallel_state)
    if mcfg.cuda_graph.enabled:  # capture after warmup_steps, then replay; without CUDA: one log line
        from .cuda_graphs.engine_hook import attach_cuda_graphs
        engine.megatron.cuda_graphs = attach_cuda_graphs(engine, mcfg.cuda_graph)
    return engine, opt, loader, sched


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``deepspeed.add_config_arguments`` (``--deepspeed``, ``--deepspeed_config``) for scripts that take args."""
    import deepspeed
    return deepspeed.add_config_arguments(parser)
