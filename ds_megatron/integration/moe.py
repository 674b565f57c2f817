"""MoE layers inside a DeepSpeed engine: our layers on DeepSpeed's expert groups, and DeepSpeed's own layers.

**Our layers** (``ds_megatron.moe``).  DeepSpeed's own expert groups
(``_create_expert_and_data_parallel``) require EP to divide DP, which is exactly the rule MoE
folding breaks (TP=2, DP=2 attention with EP=4 experts on 4 ranks), so the expert groups are
ours and DeepSpeed is handed them (``hand_expert_groups_to_deepspeed``, before
``deepspeed.initialize``: ``seams.register_expert_groups`` under ``ep_size_<EP>``, the
``group_name`` our expert params carry).  On DeepSpeed's optimizer path the engine is then told
about them (``mark_engine_has_our_moe``): its ``_reduce_expert_gradients`` all-reduces params
marked ``allreduce=False`` over our edp group, dividing by the dense data-parallel size (the mean
over the global batch, because an expert's local gradient already sums the tokens its EP group
routed to it), and its checkpoints write the optimizer state per expert rank; the layouts that
checkpoint cannot save are refused (``check_deepspeed_moe_checkpoint_layout``).  On our path the
flag stays off: our buffers reduce, and ``checkpointing.deepspeed_format`` writes the expert
weights (under DeepSpeed's expert file names) and the optimizer states itself, for every layout.

**DeepSpeed's layers** (``deepspeed.moe.layer.MoE``).  DeepSpeed marks their expert params
``allreduce=False`` with a ``group_name`` (``ep_size_<E>``) and reduces them over that name's
expert-data-parallel group (summed over the group, divided by the dense data-parallel size).
The groups are made by each layer's ``set_deepspeed_parallelism()``, which the engine calls
during ``deepspeed.initialize``, too late for our path: its gradient buffers (the only reducer
there) are built before.  So on our path ``prepare_deepspeed_moe``:

* makes the groups first, as ``set_deepspeed_parallelism()`` would
  (``seams.create_deepspeed_expert_groups``: the engine's own call then finds the groups and
  binds them to the gate, which may happen once);
* returns a view of the job's ``ParallelState`` whose expert groups are DeepSpeed's: ``edp`` the
  layer's expert-data-parallel group (the buffers reduce the experts over it, scaled by 1/DP:
  DeepSpeed's convention), ``ep`` / ``etp-ep`` / ``expert-model-parallel`` its expert-parallel
  group (the optimizer sums the experts' share of the global grad norm, and agrees on inf/nan,
  over it).

**ZeRO 1/2 on DeepSpeed's path** partition each optimizer param group over one group of ranks: experts
(distinct on every expert-parallel rank) over their expert-data-parallel group, so they must sit in param
groups of their own, marked ``{"moe": True, "name": <group_name>}`` (DeepSpeed's convention, which its
``split_params_into_different_moe_groups_for_optimizer`` follows), and the engine must know the model has
MoE layers while it builds ZeRO (``seams.engines_built_with_moe``).  ``zero_expert_param_groups`` splits the
groups it is given: the model's params, the ``model_parameters`` groups, or a client torch optimizer's own
groups (before its first step).  A client optimizer's new groups come after its old ones; a torch LR
scheduler built on it drives the groups it saw at construction, by index, so ``ExpertGroupsFollowScheduler``
steps it over those and then copies every setting but the params from each split-off group's source group.
DeepSpeed supports MoE at ZeRO stages 1 and 2 only: stage 3 with experts is refused
(``config.megatron.check_deepspeed_optimizer``).

What cannot be made right is refused in one line: DeepSpeed's and our MoE layers in one model,
DeepSpeed layers of different ``ep_size``, and DeepSpeed layers with tensor parallelism (its
experts are then neither split nor marked, and its legacy groups ignore the TP layout).  Stale
expert-group tables of an earlier engine are cleared on both paths.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE

from ..config.megatron import MegatronConfig
from ..errors import ConfigError
from ..moe.moe_layer import BaseMoELayer
from ..parallel_state import ParallelGroup, ParallelState
from ..tensor_parallel.params import expert_group_name, is_expert_param
from .seams import (clear_expert_groups, create_deepspeed_expert_groups, deepspeed_expert_groups,
                    mark_engine_has_moe, register_expert_groups)


def moe_layers(module: torch.nn.Module) -> List[Tuple[str, BaseMoELayer]]:
    """(name, layer) of every MoE layer of ours in ``module``, in module order (the checkpoint layer ids)."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, BaseMoELayer)]


def hand_expert_groups_to_deepspeed(parallel_state: ParallelState) -> None:
    """Our ep / edp groups where DeepSpeed looks expert groups up (before ``deepspeed.initialize``)."""
    register_expert_groups(expert_group_name(parallel_state.ep.size), parallel_state.ep, parallel_state.edp)


def our_num_experts(model: torch.nn.Module) -> List[int]:
    """The expert count of each of our MoE layers in ``model``, as DeepSpeed's engine lists its own."""
    return [layer.config.num_experts for _, layer in moe_layers(model)]


def mark_engine_has_our_moe(engine) -> None:
    """DeepSpeed's MoE switches on the built engine, for our layers (its optimizer path only)."""
    mark_engine_has_moe(engine, our_num_experts(engine.module))


def check_deepspeed_moe_checkpoint_layout(state: ParallelState) -> None:
    """Refuse a layout of our MoE layers that DeepSpeed's own MoE checkpoint (its optimizer path) cannot save.

    DeepSpeed's ``_save_moe_checkpoint`` writes nothing on a rank that is not expert-data-parallel
    rank 0; the others write the dense model (when also data-parallel rank 0,
    ``mp_rank_XX_model_states.pt``) and an optimizer file named by (ep rank, model-parallel rank)
    alone (``_get_optimizer_ckpt_name``).  A layout is saved right only if every data-parallel rank
    0 writes, and the writers of each optimizer file hold the state of every rank that loads it: the
    same expert-tensor rank.  (Our optimizer path writes the optimizer states itself and saves every
    layout.)
    """
    layout = state.layout
    coords = [layout.coordinates(r) for r in range(layout.world_size)]
    writers = [c for c in coords if c["edp"] == 0]
    dense_written = all(c["edp"] == 0 for c in coords if c["dp"] == 0)

    def optimizer_file_right(c) -> bool:
        same_name = [w for w in writers if (w["ep"], w["tp"], w["pp"]) == (c["ep"], c["tp"], c["pp"])]
        return bool(same_name) and all(w["etp"] == c["etp"] for w in same_name)

    if not (dense_written and all(optimizer_file_right(c) for c in coords)):
        raise ConfigError(f"megatron.optimizer_impl \"deepspeed\" with MoE layers cannot save checkpoints of this "
                          f"layout (tensor_model_parallel_size={layout.tp}, expert_model_parallel_size={layout.ep}, "
                          f"expert_tensor_parallel_size={layout.etp}): DeepSpeed's MoE checkpoint writes from "
                          "expert-data-parallel rank 0 only, which does not hold every rank's state here; use "
                          "optimizer_impl \"megatron\" (it saves every layout) or other expert sizes")


# The key a split-off expert group carries: the index of the param group it was split from.
SOURCE_GROUP = "ds_megatron_source_group"
_NOT_COPIED = ("params", "moe", "name", "param_names", SOURCE_GROUP)


def split_expert_param_groups(groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``groups`` (changed in place: their expert params taken out), followed by the expert groups: one per
    source group and expert ``group_name``, with every setting of its source group, ``moe`` True, ``name`` the
    group name and ``SOURCE_GROUP`` the source's index.  A group of experts only becomes its first expert group
    itself (DeepSpeed drops empty groups, which would move the indices a scheduler drives)."""
    split = []
    for index, group in enumerate(groups):
        by_name: Dict[str, List[torch.nn.Parameter]] = {}
        for p in group["params"]:
            if is_expert_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        if not by_name:
            continue
        dense = [p for p in group["params"] if not is_expert_param(p)]
        settings = {k: v for k, v in group.items() if k not in _NOT_COPIED}
        names = list(by_name)
        if not dense:
            name = names.pop(0)
            group.update(params=by_name[name], moe=True, name=name)
        else:
            group["params"] = dense
        split += [{**settings, "params": by_name[name], "moe": True, "name": name, SOURCE_GROUP: index}
                  for name in names]
    return list(groups) + split


def follow_source_groups(optimizer) -> None:
    """Every split-off expert group takes its source group's current settings (lr, weight decay, ...)."""
    groups = optimizer.param_groups
    for group in groups:
        if SOURCE_GROUP in group:
            group.update({k: v for k, v in groups[group[SOURCE_GROUP]].items() if k not in _NOT_COPIED})


class ExpertGroupsFollowScheduler:
    """A client LR scheduler whose optimizer's expert groups were split off after it was built.  It steps over
    the groups it was built with (``optimizer.param_groups`` is narrowed to them for the call, as ZeRO narrows
    it for each group's step: torch's schedulers drive their groups by index, strictly), then the expert groups
    follow their source groups; after a state load too.  Everything else is the scheduler's own."""

    def __init__(self, scheduler, optimizer):
        self.scheduler, self.optimizer = scheduler, optimizer

    def step(self, *args, **kwargs):
        groups = self.optimizer.param_groups
        self.optimizer.param_groups = [g for g in groups if SOURCE_GROUP not in g]
        try:
            result = self.scheduler.step(*args, **kwargs)
        finally:
            self.optimizer.param_groups = groups
        follow_source_groups(self.optimizer)
        return result

    def load_state_dict(self, state_dict) -> None:
        self.scheduler.load_state_dict(state_dict)
        follow_source_groups(self.optimizer)

    def state_dict(self):
        return self.scheduler.state_dict()

    def __getattr__(self, name):  # only for names not found on the instance
        if name == "scheduler":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def zero_expert_param_groups(model: torch.nn.Module, optimizer, model_parameters, lr_scheduler):
    """``(optimizer, model_parameters, lr_scheduler)`` for ``deepspeed.initialize`` with ZeRO 1/2 and our MoE
    layers: the expert params in DeepSpeed's MoE param groups (see the module docstring).  A torch optimizer's
    own groups are split; otherwise (DeepSpeed builds the optimizer from its section, or ``optimizer=`` is a
    callable it calls) the ``model_parameters`` it is built over."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if any(g.get("moe") for g in optimizer.param_groups):
            return optimizer, model_parameters, lr_scheduler  # the caller made DeepSpeed's MoE groups already
        if optimizer.state:
            raise ConfigError("ZeRO with MoE layers needs the expert params in param groups of their own, and "
                              "optimizer= has taken steps already; pass an optimizer that has not stepped")
        optimizer.param_groups[:] = split_expert_param_groups(optimizer.param_groups)
        if lr_scheduler is not None and not callable(lr_scheduler):
            lr_scheduler = ExpertGroupsFollowScheduler(lr_scheduler, optimizer)
        return optimizer, model_parameters, lr_scheduler
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    if not any(g.get("moe") for g in groups):
        groups = split_expert_param_groups([dict(g, params=list(g["params"])) for g in groups])
    return optimizer, groups, lr_scheduler


def deepspeed_moe_layers(module: torch.nn.Module) -> List[Tuple[str, DeepSpeedMoE]]:
    """(name, layer) of every ``deepspeed.moe.layer.MoE`` in ``module``."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, DeepSpeedMoE)]


def _group(kind: str, ranks, torch_group) -> ParallelGroup:
    ranks = tuple(int(r) for r in ranks)
    return ParallelGroup(kind, ranks, ranks.index(dist.get_rank()), torch_group)


def prepare_deepspeed_moe(model: Optional[torch.nn.Module], state: ParallelState, config: MegatronConfig,
                          ds_config: Dict[str, Any], mpu: Any) -> ParallelState:
    """The ``ParallelState`` our optimizer path is built with (see the module docstring).

    ``state`` itself without DeepSpeed MoE layers; on DeepSpeed's path the stale tables are
    cleared and DeepSpeed makes its groups during ``deepspeed.initialize``, as usual.
    """
    layers = deepspeed_moe_layers(model) if model is not None else []
    if not layers:
        return state
    if not config.precision.owns_optimizer:
        clear_expert_groups()
        return state
    if moe_layers(model):
        raise ConfigError("the model mixes deepspeed.moe.layer.MoE and ds_megatron.moe layers, whose experts use "
                          "different groups; use one kind of MoE layer")
    ep_sizes = sorted({layer.ep_size for _, layer in layers})
    if len(ep_sizes) > 1:
        raise ConfigError(f"the model's deepspeed.moe.layer.MoE layers have different ep_size {ep_sizes}; on "
                          "megatron.optimizer_impl \"megatron\" use one ep_size for all of them, or set "
                          "optimizer_impl \"deepspeed\"")
    ep_size = ep_sizes[0]
    if state.layout.tp > 1:
        raise ConfigError(f"megatron.tensor_model_parallel_size={state.layout.tp} with deepspeed.moe.layer.MoE "
                          "layers is not supported on megatron.optimizer_impl \"megatron\" (DeepSpeed's expert "
                          "groups ignore the tensor-parallel layout); use ds_megatron.moe layers, set "
                          "tensor_model_parallel_size to 1, or set optimizer_impl \"deepspeed\"")
    if state.layout.ep > 1 and state.layout.ep != ep_size:
        raise ConfigError(f"megatron.expert_model_parallel_size={state.layout.ep} but the model's "
                          f"deepspeed.moe.layer.MoE layers have ep_size={ep_size}; set expert_model_parallel_size "
                          f"to {ep_size} (or leave it out: DeepSpeed's layers bring their own groups)")
    if state.layout.pp > 1 or state.layout.cp > 1:
        raise ConfigError("deepspeed.moe.layer.MoE layers on megatron.optimizer_impl \"megatron\" need "
                          "pipeline_model_parallel_size and context_parallel_size 1; set them to 1")
    clear_expert_groups()
    data_before_expert = bool(ds_config.get("use_data_before_expert_parallelism", False))
    for _, layer in layers:
        create_deepspeed_expert_groups(layer, mpu, data_before_expert)
    (ep_ranks, ep_group), (edp_ranks, edp_group) = deepspeed_expert_groups(layers[0][1].expert_group_name)
    ep, edp = _group("ep", ep_ranks, ep_group), _group("edp", edp_ranks, edp_group)
    expert_groups = {"ep": ep, "edp": edp, "etp-ep": ep, "expert-model-parallel": ep,
                     "etp": ParallelGroup.single("etp")}
    # A view: the job's state still owns (and destroys) its groups; DeepSpeed owns these.
    return ParallelState(state.layout, {**state.groups, **expert_groups}, state.all_ranks, [], state.world)


__all__ = ["ExpertGroupsFollowScheduler", "SOURCE_GROUP", "check_deepspeed_moe_checkpoint_layout",
           "deepspeed_moe_layers", "follow_source_groups", "hand_expert_groups_to_deepspeed",
           "mark_engine_has_our_moe", "moe_layers", "our_num_experts", "prepare_deepspeed_moe",
           "split_expert_param_groups", "zero_expert_param_groups"]
