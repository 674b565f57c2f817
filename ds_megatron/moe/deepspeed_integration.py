"""Our MoE layers inside a DeepSpeed engine: its expert gradient reduction, expert checkpoints by expert rank.

DeepSpeed's own expert groups (``deepspeed.utils.groups._create_expert_and_data_parallel``)
require EP to divide DP, which is exactly the rule MoE folding breaks (TP=2,
DP=2 attention with EP=4 experts on 4 ranks), so the expert groups are ours
and DeepSpeed is handed them.  Seams used (DeepSpeed 0.19.8):

* ``register_expert_groups`` (before ``deepspeed.initialize``): our ep / edp
  groups go into ``deepspeed.utils.groups._EXPERT_PARALLEL_GROUP`` /
  ``_EXPERT_DATA_PARALLEL_GROUP`` (and their ``*_RANKS``) under
  ``ep_size_<EP>``, the ``group_name`` our expert params carry.
* ``attach_moe`` (after): sets ``engine.has_moe_layers`` and the engine's
  copies of those dicts.  DeepSpeed's ``_get_gradients_for_reduction`` then
  puts params marked ``allreduce=False`` into the expert bucket and
  ``_reduce_expert_gradients`` all-reduces them over our edp group, dividing
  by the (dense) data-parallel size: the mean over the global batch, because
  an expert's local gradient already sums the tokens its EP group routed to
  it.  Dense params are still reduced over dp (dp-cp).
* Checkpoints: ``engine.has_moe_layers`` makes DeepSpeed write the optimizer
  state per expert rank (``expp_rank_<ep>_mp_rank_<tp>_optim_states.pt``) and
  the dense module only from data-parallel rank 0, which under folding does
  not hold every expert.  So ``engine.save_checkpoint`` / ``load_checkpoint``
  are wrapped on this engine: before DeepSpeed saves, each expert-data-parallel
  rank 0 writes its local experts to DeepSpeed's expert file names
  (``layer_<i>_expert_<global id>_mp_rank_<etp rank>_model_states.pt``); after
  DeepSpeed loads, each rank reads its local experts back from them.
"""
from __future__ import annotations

import contextlib
import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import ConfigError
from .experts import expert_group_name
from .moe_layer import MoELayer


def moe_layers(module: torch.nn.Module) -> List[Tuple[str, MoELayer]]:
    """(name, layer) of every ``MoELayer`` in ``module``, in module order (the checkpoint layer ids)."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, MoELayer)]


def register_expert_groups(parallel_state) -> str:
    """Put our ep / edp groups where DeepSpeed looks them up; returns the group name used."""
    from deepspeed.utils import groups
    name = expert_group_name(parallel_state.ep.size)
    # One layout per engine: entries of an earlier layout (destroyed groups) would otherwise win
    # DeepSpeed's "largest ep_size" lookup at checkpoint time.
    for table in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                  groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        table.clear()
    groups._EXPERT_PARALLEL_GROUP[name] = parallel_state.ep.group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = list(parallel_state.ep.ranks)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = parallel_state.edp.group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = list(parallel_state.edp.ranks)
    return name


def _expert_ckpt_name(save_dir: str, tag: str, layer_id: int, expert_id: int, etp_rank: int) -> str:
    from deepspeed.runtime.engine import DeepSpeedEngine
    return DeepSpeedEngine._get_expert_ckpt_name(save_dir, layer_id, expert_id, tag, checkpoint_mp_rank=etp_rank)


class ExpertCheckpointHooks:
    """Wraps one engine's ``save_checkpoint`` / ``load_checkpoint`` (see the module docstring)."""

    def __init__(self, engine, parallel_state):
        self.engine = engine
        self.state = parallel_state
        self._deepspeed_save = engine.save_checkpoint
        self._deepspeed_load = engine.load_checkpoint
        engine.save_checkpoint = self.save_checkpoint
        engine.load_checkpoint = self.load_checkpoint

    def _check_file_names_unique(self) -> None:
        # DeepSpeed names the per-expert-rank optimizer file by (ep rank, tp rank): ETP ranks
        # that are not TP ranks would write the same file.
        etp, tp = self.state.etp, self.state.tp
        if etp.size > 1 and etp.ranks != tp.ranks:
            raise ConfigError(f"megatron.expert_tensor_parallel_size={etp.size} with a different group than "
                              f"tensor_model_parallel_size={tp.size}: DeepSpeed's expert optimizer files are named "
                              "by (ep rank, tp rank) and would collide; use expert_tensor_parallel_size 1 or equal "
                              "to tensor_model_parallel_size to save checkpoints")

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, **kwargs):
        self._check_file_names_unique()
        tag = str(tag if tag is not None else f"global_step{self.engine.global_steps}")
        # Experts first: `latest` (written by DeepSpeed at the end) then never names a tag without them.
        if self.state.edp.rank == 0:
            os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
            for layer_id, (name, layer) in enumerate(moe_layers(self.engine.module)):
                experts = layer.experts
                for local, global_id in enumerate(experts.local_expert_indices):
                    weights = {f"{name}.experts.local_experts.{global_id}.{k}": v.detach().clone().contiguous()
                               for k, v in experts.expert_weights(local).items()}
                    torch.save(weights, _expert_ckpt_name(save_dir, tag, layer_id, global_id, self.state.etp.rank))
        dist.barrier()
        # DeepSpeed asks only the expert-DP writers for the optimizer state: a sharded
        # optimizer has to gather it on every rank first.
        gathered = getattr(self.engine.optimizer, "gathered_state_dict", None)
        with gathered() if gathered is not None else contextlib.nullcontext():
            return self._deepspeed_save(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                        **kwargs)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        path, client_state = self._deepspeed_load(load_dir, tag=tag, **kwargs)
        if path is None:
            return path, client_state
        if tag is None:
            with open(os.path.join(load_dir, "latest")) as f:
                tag = f.read().strip()
        self.load_experts(load_dir, str(tag))
        return path, client_state

    @torch.no_grad()
    def load_experts(self, load_dir: str, tag: str) -> None:
        for layer_id, (name, layer) in enumerate(moe_layers(self.engine.module)):
            experts = layer.experts
            for local, global_id in enumerate(experts.local_expert_indices):
                path = _expert_ckpt_name(load_dir, tag, layer_id, global_id, self.state.etp.rank)
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


def attach_moe(engine, parallel_state) -> Optional[ExpertCheckpointHooks]:
    """Turn on DeepSpeed's expert-gradient path for our groups and wrap its checkpointing; None without MoE."""
    if not moe_layers(engine.module):
        return None
    from deepspeed.utils import groups
    engine.has_moe_layers = True
    engine.num_experts = [layer.config.num_experts for _, layer in moe_layers(engine.module)]
    engine.expert_parallel_group = groups._get_expert_parallel_group_dict()
    engine.expert_data_parallel_group = groups._get_expert_data_parallel_group_dict()
    return ExpertCheckpointHooks(engine, parallel_state)
