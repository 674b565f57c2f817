"""``save_checkpoint`` / ``load_checkpoint``: DeepSpeed's checkpoints of an engine built by ``ds_megatron.initialize``.

They call the engine's own ``save_checkpoint`` / ``load_checkpoint`` (public
DeepSpeed API, left untouched on the engine) and add what it cannot know:

* MoE layers of ours: DeepSpeed writes the dense module from data-parallel
  rank 0 only, which under MoE folding does not hold every expert, and its own
  expert files come from ``deepspeed.moe`` layers only.  So each
  expert-data-parallel rank 0 writes its local experts first, under DeepSpeed's
  expert file names (``integration.moe.expert_checkpoint_name``), and every rank
  reads its local experts back after DeepSpeed loads.  Experts go first: the
  caller's ``latest`` then never names a tag without them.
* A distributed optimizer gathers its shards on every rank before DeepSpeed
  asks (with MoE layers DeepSpeed asks only the expert-data-parallel writers,
  and the gather is a collective).

An engine without our MoE layers and without the distributed optimizer is
saved exactly as ``engine.save_checkpoint`` saves it.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .moe import checkpointed_moe_layers, expert_checkpoint_name


def _check_expert_file_names_unique(parallel_state) -> None:
    # DeepSpeed names the per-expert-rank optimizer file by (ep rank, tp rank): ETP ranks
    # that are not TP ranks would write the same file.
    etp, tp = parallel_state.etp, parallel_state.tp
    if etp.size > 1 and etp.ranks != tp.ranks:
        raise ConfigError(f"megatron.expert_tensor_parallel_size={etp.size} with a different group than "
                          f"tensor_model_parallel_size={tp.size}: DeepSpeed's expert optimizer files are named "
                          "by (ep rank, tp rank) and would collide; use expert_tensor_parallel_size 1 or equal "
                          "to tensor_model_parallel_size to save checkpoints")


def save_checkpoint(engine, save_dir: str, tag: Optional[str] = None, client_state: Optional[Dict[str, Any]] = None,
                    save_latest: bool = True, **kwargs):
    """``engine.save_checkpoint`` plus our experts and the gathered distributed-optimizer state (collective)."""
    state = engine.megatron.state
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    layers = checkpointed_moe_layers(engine.module)
    if engine.megatron.has_moe:  # every rank of the job, also a pipeline stage without MoE layers (barrier)
        _check_expert_file_names_unique(state)
        if state.edp.rank == 0:
            os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
            for layer_id, name, layer in layers:
                experts = layer.experts
                for local, global_id in enumerate(experts.local_expert_indices):
                    weights = {f"{name}.experts.local_experts.{global_id}.{k}": v.detach().clone().contiguous()
                               for k, v in experts.expert_weights(local).items()}
                    torch.save(weights, expert_checkpoint_name(save_dir, tag, layer_id, global_id, state.etp.rank))
        dist.barrier()
    gathered = getattr(engine.optimizer, "gathered_state_dict", None)
    with gathered() if gathered is not None else contextlib.nullcontext():
        return engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                                      **kwargs)


def load_checkpoint(engine, load_dir: str, tag: Optional[str] = None, **kwargs) -> Tuple[Optional[str], Any]:
    """``engine.load_checkpoint`` plus our experts; ``(None, None)`` when DeepSpeed found nothing to load."""
    path, client_state = engine.load_checkpoint(load_dir, tag=tag, **kwargs)
    if path is None:
        return path, client_state
    if tag is None:
        with open(os.path.join(load_dir, "latest")) as f:
            tag = f.read().strip()
    _load_experts(engine, load_dir, str(tag))
    return path, client_state


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
