"""Checks at ``ds_megatron.initialize`` that need the built model: a layout the model cannot use is refused.

The config alone cannot know the model a user brings.  Two layouts train without an error and
give a wrong result when the model does not take part in them:

* ``tensor_model_parallel_size > 1`` with no tensor-parallel parameter (a plain Hugging Face
  model): the TP ranks of a group read the same batch, no layer splits anything and nothing
  reduces across them, so the group trains identical replicas of one data-parallel share and
  the rest of the batch is never seen by them.  Our layers mark their split weights
  ``tensor_model_parallel=True`` (``tensor_parallel.params``).
* ``expert_model_parallel_size > 1`` with no expert parameter (ours are marked ``is_expert``,
  DeepSpeed's ``allreduce=False``): the expert groups shard nothing.

Both raise a ``ConfigError`` naming the setting and the fix, before the engine exists.  So do,
on DeepSpeed's optimizer path, a layout of our MoE layers that DeepSpeed's MoE checkpoint cannot
save, and an ``lr_scheduler=`` given together with a ``"scheduler"`` section.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import ConfigError
from ..parallel_state import ParallelState
from ..tensor_parallel.params import is_expert_param


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


def check_deepspeed_moe_checkpoint_layout(state: ParallelState) -> None:
    """Refuse a layout of our MoE layers that DeepSpeed's own MoE checkpoint (its optimizer path) cannot save.

    ``_save_moe_checkpoint`` (``runtime/engine.py:5040``, returning at ``:5274``) writes nothing
    on a rank that is not expert-data-parallel rank 0; the others write the dense model (when
    also data-parallel rank 0, ``mp_rank_XX_model_states.pt``) and an optimizer file named by
    (ep rank, model-parallel rank) alone (``_get_optimizer_ckpt_name``, ``:4362``).  A layout is
    saved right only if every data-parallel rank 0 writes, and the writers of each optimizer
    file hold the state of every rank that loads it: the same expert-tensor rank.  (Our
    optimizer path writes the optimizer states itself and saves every layout.)
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


def check_one_scheduler(ds_config, lr_scheduler) -> None:
    """``lr_scheduler=`` and a ``"scheduler"`` section: DeepSpeed would silently use the section
    (``runtime/engine.py`` ``_configure_lr_scheduler``); refuse instead."""
    if lr_scheduler is not None and "scheduler" in ds_config:
        raise ConfigError("lr_scheduler= was given together with a \"scheduler\" config section, and DeepSpeed would "
                          "silently use the section; keep one of them")


__all__ = ["check_deepspeed_moe_checkpoint_layout", "check_model_uses_layout", "check_one_scheduler"]
