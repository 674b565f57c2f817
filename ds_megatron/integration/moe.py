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
from ..tensor_parallel.params import expert_group_name
from .seams import (clear_expert_groups, create_deepspeed_expert_groups, deepspeed_expert_groups,
                    mark_engine_has_moe, register_expert_groups)


def moe_layers(module: torch.nn.Module) -> List[Tuple[str, BaseMoELayer]]:
    """(name, layer) of every MoE layer of ours in ``module``, in module order (the checkpoint layer ids)."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, BaseMoELayer)]


def hand_expert_groups_to_deepspeed(parallel_state: ParallelState) -> None:
    """Our ep / edp groups where DeepSpeed looks expert groups up (before ``deepspeed.initialize``)."""
    register_expert_groups(expert_group_name(parallel_state.ep.size), parallel_state.ep, parallel_state.edp)


def mark_engine_has_our_moe(engine) -> None:
    """DeepSpeed's MoE switches on the built engine, for our layers (its optimizer path only)."""
    mark_engine_has_moe(engine, [layer.config.num_experts for _, layer in moe_layers(engine.module)])


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


__all__ = ["check_deepspeed_moe_checkpoint_layout", "deepspeed_moe_layers",
           "hand_expert_groups_to_deepspeed", "mark_engine_has_our_moe", "moe_layers", "prepare_deepspeed_moe"]
