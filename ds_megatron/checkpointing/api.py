"""The one entry to training checkpoints: ``save``, ``load``, ``latest``, ``prune`` for a run directory, and the
public ``save_checkpoint`` / ``load_checkpoint`` / ``save_dist_checkpoint`` / ``load_dist_checkpoint``.

Two formats hold the whole training state of an engine built by ``ds_megatron.initialize``:

* ``"deepspeed"`` (``deepspeed_format``): the engine's own ``save_checkpoint`` files plus what DeepSpeed
  cannot know (our experts, their optimizer states, the distributed optimizer's gathered state, the
  record ``ds-megatron export-fp32`` reads); resumable at the same TP / PP / EP sizes, any DP.
* ``"torch_dist"`` (``torch_dist``): ``torch.distributed.checkpoint`` of every tensor at its offsets in
  the one-rank model (``global_shards``); resumable at any TP / PP / EP / ETP / DP.

A training job's run directory (``run_dir``) holds one directory per tag (``iter_0000100/``).
``save`` writes the tag in either format, each rank's RNG states (``rng``) and rank 0's record of
the job (``run_dir.JOB_META``, checked by ``--resume`` before anything starts), and only after
every rank has finished writing points ``latest`` at the new tag, by writing a temporary file and
renaming it over the old one.  A crash at any moment therefore leaves ``latest`` naming a complete
checkpoint: the previous one until the rename, the new one after.  ``load`` reads whichever format
``latest`` names.

The data-parallel size may change between save and resume: DeepSpeed checks the DP size only for
ZeRO states, and our optimizers save a DP-independent state (the ``DistributedOptimizer`` gathers
its shards into full per-param tensors and cuts them again on load).  Keep the global batch the
same (micro-batch x accumulation x DP).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from ..config.training import CKPT_FORMATS
from ..utils.collectives import barrier
from . import deepspeed_format, torch_dist
from .rng import load_rng_states, save_rng_states
from .run_dir import LATEST, latest_tag, prune_checkpoints, tag_for, write_atomic, write_job_meta


def save(engine, save_dir: str, step: int, client_state: Dict[str, Any], *, ckpt_format: str = "deepspeed",
         rng_tracker=None, job_meta: Optional[Dict[str, Any]] = None, keep_last_n: int = 0) -> str:
    """Write checkpoint ``tag_for(step)`` of a run directory (collective): the engine's state in ``ckpt_format``,
    this rank's RNG states, rank 0's job record; then ``latest`` moves to it and older tags are pruned to the
    ``keep_last_n`` newest (0: all kept).  Returns the tag."""
    if ckpt_format not in CKPT_FORMATS:
        raise ValueError(f"ckpt_format={ckpt_format!r}; use one of {CKPT_FORMATS}")
    state = engine.megatron.state
    tag = tag_for(step)
    tag_dir = os.path.join(save_dir, tag)
    if ckpt_format == "torch_dist":
        torch_dist.save(engine, tag_dir, client_state)
    else:
        deepspeed_format.save_checkpoint(engine, save_dir, tag=tag, client_state=client_state, save_latest=False)
    save_rng_states(tag_dir, dist.get_rank(), state, rng_tracker)
    if dist.get_rank() == 0 and job_meta is not None:
        write_job_meta(save_dir, tag, job_meta)
    barrier(state.world)  # every rank's files are complete before `latest` may name the tag
    if dist.get_rank() == 0:
        write_atomic(os.path.join(save_dir, LATEST), tag)
        prune(save_dir, keep_last_n)
    barrier(state.world)
    return tag


def load(engine, save_dir: str, rng_tracker=None) -> Optional[Dict[str, Any]]:
    """Load the checkpoint ``latest`` names, in whichever format it was saved; returns its client state, or
    None when the run directory has none."""
    tag = latest(save_dir)
    if tag is None:
        return None
    tag_dir = os.path.join(save_dir, tag)
    if torch_dist.is_dist_checkpoint(tag_dir):
        client_state = torch_dist.load(engine, tag_dir)
    else:
        load_path, client_state = deepspeed_format.load_checkpoint(engine, save_dir, tag=tag)
        if load_path is None:
            raise RuntimeError(f"checkpoint {tag_dir} named by {LATEST} could not be loaded")
    load_rng_states(tag_dir, dist.get_rank(), engine.megatron.state, rng_tracker)
    return client_state


def latest(save_dir: str) -> Optional[str]:
    """The tag ``latest`` names in ``save_dir`` (None: no checkpoint yet)."""
    return latest_tag(save_dir)


def prune(save_dir: str, keep: int) -> List[str]:
    """Remove all but the ``keep`` newest checkpoints (never the one ``latest`` names); the removed tags."""
    return prune_checkpoints(save_dir, keep)


def save_checkpoint(engine, save_dir: str, tag: Optional[str] = None, client_state: Optional[Dict[str, Any]] = None,
                    save_latest: bool = True, **kwargs):
    """``engine.save_checkpoint`` (DeepSpeed's signature and files) plus our experts, their optimizer states and the
    gathered distributed-optimizer state (collective)."""
    return deepspeed_format.save_checkpoint(engine, save_dir, tag, client_state, save_latest, **kwargs)


def load_checkpoint(engine, load_dir: str, tag: Optional[str] = None, **kwargs) -> Tuple[Optional[str], Any]:
    """``engine.load_checkpoint`` plus our experts and their optimizer states."""
    return deepspeed_format.load_checkpoint(engine, load_dir, tag, **kwargs)


def save_dist_checkpoint(engine, directory: str, client_state: Optional[Dict[str, Any]] = None) -> None:
    """The layout-independent checkpoint of ``engine`` in ``directory`` (one checkpoint's; collective)."""
    torch_dist.check_supported(engine)
    torch_dist.save(engine, directory, client_state or {})


def load_dist_checkpoint(engine, directory: str) -> Dict[str, Any]:
    """Read a ``save_dist_checkpoint`` directory written at any layout into ``engine``; returns the client state."""
    torch_dist.check_supported(engine)
    return torch_dist.load(engine, directory)


__all__ = ["latest", "load", "load_checkpoint", "load_dist_checkpoint", "prune", "save",
           "save_checkpoint", "save_dist_checkpoint"]
