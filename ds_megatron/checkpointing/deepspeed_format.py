"""Checkpoints in DeepSpeed's format of an engine built by ``ds_megatron.initialize`` (``ckpt_format: "deepspeed"``).

They call the engine's own ``save_checkpoint`` / ``load_checkpoint`` (public
DeepSpeed API, left untouched on the engine) and add what it cannot know:

* MoE layers of ours: DeepSpeed writes the dense module from data-parallel
  rank 0 only, which under MoE folding does not hold every expert, and its own
  expert files come from ``deepspeed.moe`` layers only.  So each
  expert-data-parallel rank 0 writes its local experts first, under DeepSpeed's
  expert file names (``integration.seams.expert_checkpoint_name``, one file per
  expert and expert-tensor rank), and every rank reads its local experts back
  after DeepSpeed loads.  Experts go first: the caller's ``latest`` then never
  names a tag without them.
* With our optimizer and MoE layers, the optimizer state too: a rank's state is
  its dense part (set by its tensor / pipeline rank) and its experts' part (set by
  its pipeline / expert / expert-tensor rank), so the lowest rank of each
  (tp, pp, ep, etp) writes ``moe_optim_tp_XX_pp_XX_ep_XXX_etp_XX.pt`` and every
  rank with those coordinates loads it (any data-parallel size).  DeepSpeed's
  own per-expert-rank files, named by (ep rank, model-parallel rank) and written
  by expert-data-parallel rank 0 only, would lose or overwrite the states of
  layouts whose expert-data-parallel group spans tensor ranks (ETP < TP) or whose
  expert-tensor ranks are not tensor ranks; so on our path the engine is not told
  about our MoE layers (``integration.moe``) and writes a plain checkpoint, whose
  optimizer state (data-parallel rank 0's) is not loaded.  On DeepSpeed's path
  the layouts its MoE checkpoint cannot save are refused at ``initialize``
  (``integration.moe.check_deepspeed_moe_checkpoint_layout``).
* Each tensor / pipeline rank's record of how its weights map to the whole model
  (``export_fp32.export_record``, under ``client_state["ds_megatron_export"]``):
  ``ds-megatron export-fp32`` reads it.  Under PP it names the entries of DeepSpeed's
  per-layer files (``integration.seams.pipeline_layer_state_dicts``).
* DeepSpeed's ZeRO path copies ``zero_to_fp32.py`` next to the checkpoint; with TP / PP / EP it cannot
  consolidate our shards, so it is replaced by one that names ``ds-megatron export-fp32``
  (``export_fp32.guard_zero_recovery_scripts``).
* The delayed fp8 recipe's amax histories and scales (``fp8_scaling``), one file per pipeline rank.
* A distributed optimizer gathers its shards on every rank before anything asks
  (the gather is a collective).
* DeepSpeed's ``BF16_Optimizer`` without ZeRO (a ``PipelineEngine`` in bf16): DeepSpeed saves its
  state per data-parallel rank in ``bf16_zero_*`` files, but its load reads them only with ZeRO on and
  fails on the model file's state (``integration.seams.bf16_optimizer_without_zero``); they are loaded
  here.
* A load without the optimizer state (``load_optimizer_states=False``) takes a 16-bit optimizer's fp32
  weights again from the loaded ones (DeepSpeed does so only for ``load_module_only``).
* After a load our gradient buffers start a new window at the next forward
  (``integration.gradients``), whether the load went through here or through
  ``engine.load_checkpoint``.

An engine without our MoE layers and without the distributed optimizer is
saved exactly as ``engine.save_checkpoint`` saves it.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..fp8.param import is_fp8_param
from ..integration.moe import moe_layers
from ..integration.seams import (bf16_optimizer_without_zero, expert_checkpoint_name, load_bf16_optimizer_partitions,
                                pipeline_layer_state_dicts)
from ..moe.moe_layer import BaseMoELayer
from ..optimizer import MegatronOptimizer
from ..utils.collectives import barrier
from . import fp8_scaling
from .torch_dist import CheckpointFormatError
from .export_fp32 import RECORD_KEY, export_record, guard_zero_recovery_scripts


def checkpointed_moe_layers(module: torch.nn.Module) -> List[Tuple[int, str, BaseMoELayer]]:
    """``(layer id, name, layer)`` of every MoE layer of ours, as checkpoints name them.

    Ids count the whole model's MoE layers from 0 and names are the whole
    model's (``layers.5.mlp``), also on a pipeline stage (a ``GPTPipelineModule``
    says which layers it holds), so that every stage writes distinct expert
    files and a checkpoint does not depend on the pipeline split.
    """
    layers = moe_layers(module)
    to_model_name = getattr(module, "gpt_name", None)
    if to_model_name is None:
        return [(i, name, layer) for i, (name, layer) in enumerate(layers)]
    config = module.config
    return [(sum(config.is_moe_layer(j) for j in range(layer.layer_number)), to_model_name(name), layer)
            for name, layer in layers]


def optimizer_shard_name(save_dir: str, tag: str, layout, rank: int) -> str:
    """Our file for the optimizer state of every rank with ``rank``'s (tp, pp, ep, etp) coordinates."""
    c = layout.coordinates(rank)
    return os.path.join(save_dir, tag, f"moe_optim_tp_{c['tp']:02d}_pp_{c['pp']:02d}_ep_{c['ep']:03d}_"
                                       f"etp_{c['etp']:02d}.pt")


def _writes_optimizer_shard(state) -> bool:
    # The ranks with this rank's dense state are its dp-cp group, those with its expert state its edp group.
    return dist.get_rank() == min(set(state.dp_cp.ranks) & set(state.edp.ranks))


def _saves_moe_optimizer_itself(engine) -> bool:
    return engine.megatron.has_moe and isinstance(engine.optimizer, MegatronOptimizer)


def _export_record(engine) -> Dict[str, Any]:
    return export_record(engine.module, engine.megatron.state, pipeline_layer_state_dicts(engine.module))


def save_checkpoint(engine, save_dir: str, tag: Optional[str] = None, client_state: Optional[Dict[str, Any]] = None,
                    save_latest: bool = True, **kwargs):
    """``engine.save_checkpoint`` plus our experts, their optimizer states and the gathered distributed-optimizer
    state (collective)."""
    if any(is_fp8_param(p) for p in engine.module.parameters()):
        raise ValueError("fp8_param_gather: DeepSpeed's checkpoint would write the weights' fp8 bytes as the model's "
                         "weights; save with ds_megatron.save_dist_checkpoint (it writes their bf16 values)")
    state = engine.megatron.state
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    layers = checkpointed_moe_layers(engine.module)
    has_moe = engine.megatron.has_moe  # every rank of the job, also a pipeline stage without MoE layers
    if has_moe:
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        if state.edp.rank == 0:
            for layer_id, name, layer in layers:
                experts = layer.experts
                for local, global_id in enumerate(experts.local_expert_indices):
                    weights = {f"{name}.experts.local_experts.{global_id}.{k}": v.detach().clone().contiguous()
                               for k, v in experts.expert_weights(local).items()}
                    torch.save(weights, expert_checkpoint_name(save_dir, tag, layer_id, global_id, state.etp.rank))
    fp8_scaling.save_files(engine.module, os.path.join(save_dir, tag), state)  # before DeepSpeed writes `latest`
    gathered = getattr(engine.optimizer, "gathered_state_dict", None)
    with gathered() if gathered is not None else contextlib.nullcontext():
        if _saves_moe_optimizer_itself(engine):
            optimizer_state = engine.optimizer.state_dict()  # the gathered one for the distributed optimizer
            if _writes_optimizer_shard(state):
                torch.save(optimizer_state, optimizer_shard_name(save_dir, tag, state.layout, dist.get_rank()))
        if has_moe:
            barrier(state.world)  # every expert and optimizer file is on disk before DeepSpeed may write `latest`
        record = _export_record(engine)
        client_state = {**(client_state or {}), **({RECORD_KEY: record} if record is not None else {})}
        saved = engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                       **kwargs)
    if engine.zero_optimization() and not (state.tp.size == state.pp.size == state.ep.size == 1):
        barrier(state.world)  # every rank's DeepSpeed save (and its copy of the recovery scripts) is done
        if dist.get_rank() == 0:
            guard_zero_recovery_scripts(save_dir, state.tp.size, state.pp.size, state.ep.size)
    return saved


def load_checkpoint(engine, load_dir: str, tag: Optional[str] = None, **kwargs) -> Tuple[Optional[str], Any]:
    """``engine.load_checkpoint`` plus our experts and their optimizer states; ``(None, None)`` when DeepSpeed
    found nothing to load."""
    _check_same_pipeline_runtime(engine, load_dir, tag)
    ours = _saves_moe_optimizer_itself(engine)
    bf16_partitions = bf16_optimizer_without_zero(engine)
    load_optimizer = kwargs.pop("load_optimizer_states", True) and not kwargs.get("load_module_only", False)
    # With ours, DeepSpeed's file holds data-parallel rank 0's optimizer state, which is not every rank's; its
    # BF16_Optimizer without ZeRO is loaded from the files DeepSpeed saved it to, which its own load skips.
    path, client_state = engine.load_checkpoint(
        load_dir, tag=tag, load_optimizer_states=load_optimizer and not ours and not bf16_partitions, **kwargs)
    if path is None:
        return path, client_state
    if tag is None:
        with open(os.path.join(load_dir, "latest")) as f:
            tag = f.read().strip()
    _load_experts(engine, load_dir, str(tag))
    fp8_scaling.load_files(engine.module, os.path.join(load_dir, str(tag)))
    if load_optimizer and ours:
        shard = optimizer_shard_name(load_dir, str(tag), engine.megatron.state.layout, dist.get_rank())
        if not os.path.isfile(shard):
            raise FileNotFoundError(f"optimizer state {shard} is missing: the checkpoint was saved with another "
                                    "tensor / pipeline / expert layout, or not by ds_megatron")
        engine.optimizer.load_state_dict(torch.load(shard, map_location="cpu", weights_only=False))
    elif load_optimizer and bf16_partitions:
        load_bf16_optimizer_partitions(engine, load_dir, str(tag))
    elif not load_optimizer and not engine.zero_optimization() and hasattr(engine.optimizer, "refresh_fp32_params"):
        # A 16-bit optimizer's fp32 weights (ours, DeepSpeed's without ZeRO) are taken again from the weights just
        # loaded, our experts included: DeepSpeed does so for load_module_only alone and before our experts load,
        # and the next step would write the old ones back.
        engine.optimizer.refresh_fp32_params()
    return path, client_state


def _check_same_pipeline_runtime(engine, load_dir: str, tag: Optional[str]) -> None:
    """DeepSpeed's ``PipelineEngine`` keeps the model in per-layer files (``layer_NN-model_states.pt``), our
    pipeline runtime (DeepSpeed's plain engine) in each model-parallel rank's ``mp_rank_NN`` file; an engine of one
    kind would find no weights in the other's checkpoint (and the plain engine would silently keep its initial
    ones), so a mismatch is refused before anything loads."""
    if tag is None:
        latest_file = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest_file):
            return
        with open(latest_file) as f:
            tag = f.read().strip()
    tag_dir = os.path.join(load_dir, str(tag))
    if not os.path.isdir(tag_dir):
        return
    has_layer_files = any(re.fullmatch(r"layer_\d+-.*model_states\.pt", name) for name in os.listdir(tag_dir))
    on_pipeline_engine = getattr(getattr(engine, "megatron", None), "pipeline_module", None) is not None
    if has_layer_files and not on_pipeline_engine:
        raise CheckpointFormatError(
            f"{tag_dir} was saved by DeepSpeed's PipelineEngine (per-layer files of a GPTPipelineModule), but this "
            "job runs ds_megatron's pipeline runtime, which reads the model from mp_rank files; resume it with the "
            "ds_megatron version that wrote it and save with megatron.train.ckpt_format \"torch_dist\" (which "
            "every runtime and layout resumes), or train on DeepSpeed's engine (optimizer_impl \"deepspeed\")")
    if on_pipeline_engine and not has_layer_files and any(
            name.startswith("mp_rank_") for name in os.listdir(tag_dir)):
        raise CheckpointFormatError(
            f"{tag_dir} was saved by ds_megatron's pipeline runtime (mp_rank files), but this job runs DeepSpeed's "
            "PipelineEngine, which reads per-layer files; resume it with ds_megatron's runtime "
            "(a GPTModelChunks, optimizer_impl \"megatron\") or save with ckpt_format \"torch_dist\"")


@torch.no_grad()
def _load_experts(engine, load_dir: str, tag: str) -> None:
    etp_rank = engine.megatron.state.etp.rank
    for layer_id, name, layer in checkpointed_moe_layers(engine.module):
        experts = layer.experts
        for local, global_id in enumerate(experts.local_expert_indices):
            path = expert_checkpoint_name(load_dir, tag, layer_id, global_id, etp_rank)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"expert checkpoint {path} is missing: the checkpoint was saved with a "
                                        "different num_experts / expert parallel layout, or not by ds_megatron")
            saved = torch.load(path, map_location="cpu", weights_only=True)
            for k, param in experts.expert_weights(local).items():
                key = f"{name}.experts.local_experts.{global_id}.{k}"
                if key not in saved or saved[key].shape != param.shape:
                    raise ValueError(f"{path} has no {key} of shape {tuple(param.shape)}; the checkpoint was "
                                     "saved with a different model or expert-tensor-parallel size")
                param.copy_(saved[key])
