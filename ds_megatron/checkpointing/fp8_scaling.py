"""The delayed fp8 recipe's training state in checkpoints: every fp8 linear's and expert weight's amax history and
scales.

``fp8.update_delayed_scaling`` agrees on them over every rank that holds the weight (a dense linear's over TP and
dp-cp, an expert's over ETP and expert-DP), so one copy per weight stands for all of them, at any layout.  They
are saved under the one-rank model's name of the linear (``layers.3.mlp.dense_h_to_4h``; an expert's by its global
index, as its weights are named in checkpoints: ``layers.1.mlp.experts.5.linear_fc1``): ``fp8.<name>.amax_history``
[roles, fp8_amax_history_len] and ``fp8.<name>.scale`` [roles], roles in ``fp8.recipe.ROLES`` order.  The
torch_dist format holds them as replicated tensors (an expert's on the ranks holding it), so a resume at another
EP size finds each expert's; the DeepSpeed format in one file per pipeline rank for the dense linears
(``fp8_scaling_pp_NN.pt``, written by its first tensor and dp-cp rank) and one per pipeline and expert-parallel
rank for the experts (``fp8_scaling_pp_NN_ep_MM.pt``, by its first expert-tensor and expert-DP rank).  The step's
running amaxes are not saved: a checkpoint is written after a step, when they are zero.  They are not model
weights: the module's state dict, the Hugging Face export and ``export-fp32`` never hold them.

Resuming:

* a job with the delayed recipe reads them back (``--resume`` then takes the scales the uninterrupted run took);
* a job without it (fp8 null, another recipe) ignores them, in one logged line: the weights do not depend on
  them;
* a delayed job from a checkpoint without them (saved with another recipe or fp8 null) starts its histories as
  a fresh run does (scale 1 for the first step), in one logged line;
* another ``fp8_amax_history_len`` than the checkpoint's is refused in one line.
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..fp8.recipe import ROLES, FP8LinearState
from ..moe.experts import GroupedMLP, SequentialMLP
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

PREFIX = "fp8."
logger = logging.getLogger("ds_megatron")


def delayed_states(module: torch.nn.Module) -> Dict[str, FP8LinearState]:
    """The one-rank model's name of each of ``module``'s linears and local expert weights with the delayed recipe
    (experts by global index), and its state."""
    to_gpt = getattr(module, "gpt_name", lambda name: name)
    out = {}
    for name, m in module.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.fp8 is not None:
            out[to_gpt(name)] = m.fp8
        elif isinstance(m, (GroupedMLP, SequentialMLP)):
            for local, global_id in enumerate(m.local_expert_indices):
                out.update({f"{to_gpt(name)}.{global_id}.{proj}": state
                            for proj, state in m.expert_fp8_states(local).items()})
    return {name: state for name, state in out.items() if state.recipe.recipe == "delayed"}


def scaling_tensors(module: torch.nn.Module, kind: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """What a checkpoint saves of ``module``'s delayed states (copies, on the CPU); ``kind``: only the states of
    that kind ("dense" or "expert")."""
    out = {}
    for name, state in delayed_states(module).items():
        if kind is not None and state.kind != kind:
            continue
        out[f"{PREFIX}{name}.amax_history"] = torch.stack([state.amax_history[r] for r in ROLES]).detach().cpu()
        out[f"{PREFIX}{name}.scale"] = torch.stack([state.scale[r] for r in ROLES]).detach().cpu()
    return out


@torch.no_grad()
def load_scaling_tensors(module: torch.nn.Module, saved: Dict[str, torch.Tensor], where: str) -> None:
    """Set ``module``'s delayed states from ``saved`` (``scaling_tensors`` of the saving job, any layout: every
    stage's layers), deciding as the module docstring says."""
    states = delayed_states(module)
    found = [n for n in states if f"{PREFIX}{n}.amax_history" in saved]
    first = dist.get_rank() == 0 if dist.is_initialized() else True
    config = getattr(module, "config", None)  # a pipeline stage may hold none of a delayed job's fp8 layers
    if not states:
        delayed_job = config is not None and config.fp8 is not None and config.fp8_recipe == "delayed"
        if saved and first and not delayed_job:
            logger.warning(f"{where} holds the delayed fp8 recipe's amax histories; this job does not use the "
                           "delayed recipe, so they are ignored")
        return
    if len(found) < len(states) and first:
        logger.warning(f"{where} holds no amax history for {len(states) - len(found)} of this rank's "
                       f"{len(states)} delayed-fp8 linears (saved with another fp8 recipe or fp8 null); they start "
                       "as a fresh run's, with scale 1")
    for name in found:
        state, history = states[name], saved[f"{PREFIX}{name}.amax_history"]
        if history.size(-1) != state.recipe.amax_history_len:
            raise ValueError(f"{where} was saved with model.fp8_amax_history_len={history.size(-1)}, this job "
                             f"has {state.recipe.amax_history_len}; resume with {history.size(-1)}")
        scale = saved[f"{PREFIX}{name}.scale"]
        for i, role in enumerate(ROLES):  # into the state's own tensors: a captured CUDA graph reads those
            state.amax_history[role].copy_(history[i])
            state.scale[role].copy_(scale[i])
            state.step_amax[role].zero_()


def save_files(module: torch.nn.Module, tag_dir: str, parallel_state) -> None:
    """DeepSpeed format: this pipeline rank's delayed states, each kind written by the first of the ranks that
    agree on it: the dense linears' by the first tensor and dp-cp rank, each expert-parallel rank's experts' by
    its first expert-tensor and expert-DP rank."""
    ps = parallel_state
    files = (("dense", ps.tp.rank == 0 and ps.dp_cp.rank == 0, f"fp8_scaling_pp_{ps.pp.rank:02d}.pt"),
             ("expert", ps.etp.rank == 0 and ps.edp.rank == 0,
              f"fp8_scaling_pp_{ps.pp.rank:02d}_ep_{ps.ep.rank:02d}.pt"))
    for kind, writes, file in files:
        tensors = scaling_tensors(module, kind)
        if tensors and writes:
            os.makedirs(tag_dir, exist_ok=True)
            torch.save(tensors, os.path.join(tag_dir, file))


def load_files(module: torch.nn.Module, tag_dir: str) -> None:
    """DeepSpeed format: every file of the checkpoint read (every pipeline and expert-parallel rank's), this
    rank's layers and experts set."""
    saved: Dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(tag_dir, "fp8_scaling_pp_*.pt"))):
        saved.update(torch.load(path, map_location="cpu", weights_only=True))
    load_scaling_tensors(module, saved, tag_dir)


__all__ = ["delayed_states", "load_files", "load_scaling_tensors", "save_files", "scaling_tensors"]
