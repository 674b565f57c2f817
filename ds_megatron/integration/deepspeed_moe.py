"""DeepSpeed's own MoE layer (``deepspeed.moe.layer.MoE``) in a model built by ``ds_megatron.initialize``.

DeepSpeed marks its expert params ``allreduce=False`` with a ``group_name``
(``ep_size_<E>``) and reduces them over that name's expert-data-parallel
group (``runtime/engine.py`` ``_reduce_expert_gradients``: summed over the
group, divided by the dense data-parallel size).  The groups are made by each
layer's ``set_deepspeed_parallelism()``, which the engine calls during
``deepspeed.initialize``, too late for our path: its gradient buffers (the only
reducer there) are built before.  So on our path ``prepare_deepspeed_moe``:

* makes the groups first, as ``set_deepspeed_parallelism()`` would (the same
  ``groups._create_expert_*`` call, without binding them to the gate, which
  may happen once: the engine's own call then finds the groups and binds them);
* returns a view of the job's ``ParallelState`` whose expert groups are
  DeepSpeed's: ``edp`` = ``groups._get_expert_data_parallel_group(name)`` (the
  buffers reduce the experts over it, scaled by 1/DP: DeepSpeed's convention),
  ``ep`` / ``etp-ep`` / ``expert-model-parallel`` = its expert-parallel group
  (the optimizer sums the experts' share of the global grad norm, and agrees on
  inf/nan, over it).

What cannot be made right is refused in one line: DeepSpeed's and our MoE
layers in one model, DeepSpeed layers of different ``ep_size``, and DeepSpeed
layers with tensor parallelism (its experts are then neither split nor marked,
and its legacy groups ignore the TP layout).

``clear_stale_expert_groups`` runs on both paths: a process that built an
engine before keeps DeepSpeed's expert-group tables, and DeepSpeed reuses any
entry of the same name, even of a destroyed group.

Seams (DeepSpeed 0.19.8): the group builders ``MoE._create_process_groups`` calls
(``moe/layer.py:89-101``: ``groups._create_expert_and_data_parallel``, ``_create_expert_data_and_model_parallel``),
``groups._get_expert_parallel_group`` / ``_ranks`` and
``_get_expert_data_parallel_group`` / ``_ranks`` (``utils/groups.py:685-715``),
``groups.mpu`` (read for the pipeline size when groups are made, ``utils/groups.py:410``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.utils import groups

from ..config.megatron import MegatronConfig
from ..errors import ConfigError
from ..parallel_state import ParallelGroup, ParallelState
from .moe import moe_layers


def deepspeed_moe_layers(module: torch.nn.Module) -> List[Tuple[str, DeepSpeedMoE]]:
    """(name, layer) of every ``deepspeed.moe.layer.MoE`` in ``module``."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, DeepSpeedMoE)]


def clear_stale_expert_groups() -> None:
    """Empty DeepSpeed's expert-group tables (entries of an earlier engine would be reused by name)."""
    for table in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                  groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        table.clear()


def _group(kind: str, ranks, torch_group) -> ParallelGroup:
    ranks = tuple(int(r) for r in ranks)
    return ParallelGroup(kind, ranks, ranks.index(dist.get_rank()), torch_group)


def _create_groups(layer: DeepSpeedMoE, use_data_before_expert_parallel_: bool) -> None:
    # What ``MoE._create_process_groups`` does (moe/layer.py:89-101) short of binding the group to the
    # gate, which may happen once only: the engine's own call binds it and finds the groups made.
    if layer.expert_group_name in groups._get_expert_parallel_group_dict():
        return
    if groups.mpu is None or not layer.enable_expert_tensor_parallelism:
        groups._create_expert_and_data_parallel(layer.ep_size,
                                                use_data_before_expert_parallel_=use_data_before_expert_parallel_)
    else:
        groups._create_expert_data_and_model_parallel(layer.ep_size, mpu=groups.mpu,
                                                      use_data_before_expert_parallel_=use_data_before_expert_parallel_)


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
        clear_stale_expert_groups()
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
    clear_stale_expert_groups()
    groups.mpu = mpu  # what the engine sets later; the group builder reads the pipeline size from it
    data_before_expert = bool(ds_config.get("use_data_before_expert_parallelism", False))
    for _, layer in layers:
        _create_groups(layer, data_before_expert)
    name = layers[0][1].expert_group_name
    ep = _group("ep", groups._get_expert_parallel_group_ranks(name), groups._get_expert_parallel_group(name))
    edp = _group("edp", groups._get_expert_data_parallel_group_ranks(name),
                 groups._get_expert_data_parallel_group(name))
    expert_groups = {"ep": ep, "edp": edp, "etp-ep": ep, "expert-model-parallel": ep,
                     "etp": ParallelGroup.single("etp")}
    # A view: the job's state still owns (and destroys) its groups; DeepSpeed owns these.
    return ParallelState(state.layout, {**state.groups, **expert_groups}, state.all_ranks, [], state.world)


__all__ = ["clear_stale_expert_groups", "deepspeed_moe_layers", "prepare_deepspeed_moe"]
