"""Our MoE layers inside a DeepSpeed engine: its expert groups tables and its expert checkpoint names.

DeepSpeed's own expert groups (``deepspeed.utils.groups._create_expert_and_data_parallel``)
require EP to divide DP, which is exactly the rule MoE folding breaks (TP=2,
DP=2 attention with EP=4 experts on 4 ranks), so the expert groups are ours
and DeepSpeed is handed them.  Seams (DeepSpeed 0.19.8):

* ``register_expert_groups`` (before ``deepspeed.initialize``): our ep / edp
  groups go into ``deepspeed.utils.groups._EXPERT_PARALLEL_GROUP`` /
  ``_EXPERT_DATA_PARALLEL_GROUP`` (and their ``*_RANKS``) under
  ``ep_size_<EP>``, the ``group_name`` our expert params carry.
* ``mark_engine_has_moe`` (after; DeepSpeed's optimizer path only):
  ``engine.has_moe_layers``, ``num_experts`` and the engine's copies of those
  tables.  Its ``_reduce_expert_gradients`` then all-reduces params marked
  ``allreduce=False`` over our edp group, dividing by the dense data-parallel
  size (the mean over the global batch, because an expert's local gradient
  already sums the tokens its EP group routed to it), and its checkpoints write
  the optimizer state per expert rank
  (``expp_rank_<ep>_mp_rank_<mp>_optim_states.pt``).  On our path the flag stays
  off: our buffers reduce, and ``integration.checkpoint`` writes the optimizer
  states itself, for every layout.
* ``expert_checkpoint_name``: DeepSpeed's file name for one expert's weights
  (``DeepSpeedEngine._get_expert_ckpt_name``); ``integration.checkpoint``
  writes and reads our experts under it, with the layer ids of
  ``checkpointed_moe_layers``.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import groups

from ..moe.moe_layer import BaseMoELayer
from ..parallel_state import ParallelState
from ..tensor_parallel.params import expert_group_name


def moe_layers(module: torch.nn.Module) -> List[Tuple[str, BaseMoELayer]]:
    """(name, layer) of every MoE layer of ours in ``module``, in module order (the checkpoint layer ids)."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, BaseMoELayer)]


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


def register_expert_groups(parallel_state: ParallelState) -> str:
    """Put our ep / edp groups where DeepSpeed looks them up; returns the group name used."""
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


def mark_engine_has_moe(engine) -> None:
    """DeepSpeed's MoE switches on the built engine (see the module docstring)."""
    engine.has_moe_layers = True
    engine.num_experts = [layer.config.num_experts for _, layer in moe_layers(engine.module)]
    engine.expert_parallel_group = groups._get_expert_parallel_group_dict()
    engine.expert_data_parallel_group = groups._get_expert_data_parallel_group_dict()


def expert_checkpoint_name(save_dir: str, tag: str, layer_id: int, expert_id: int, etp_rank: int) -> str:
    """DeepSpeed's file for one expert's weights in checkpoint ``tag``."""
    return DeepSpeedEngine._get_expert_ckpt_name(save_dir, layer_id, expert_id, tag, checkpoint_mp_rank=etp_rank)
