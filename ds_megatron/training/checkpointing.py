"""Checkpoints of a training job, crash-safe.

One directory per tag (``iter_0000100/``), written by DeepSpeed through
``ds_megatron.save_checkpoint`` (which adds MoE experts; ``ckpt_format``
"deepspeed") or by ``torch.distributed.checkpoint`` (``dist_checkpoint``,
"torch_dist", resumable at any layout); ``--resume`` reads either.  We add each rank's
RNG states (default generator and the model-parallel tracker) to it, and only
after every rank has finished writing do we point ``latest`` at the new tag,
by writing a temporary file and renaming it over the old one.  A crash at any
moment therefore leaves ``latest`` naming a complete checkpoint: the previous
one until the rename, the new one after.

The data-parallel size may change between save and resume: DeepSpeed checks
the DP size only for ZeRO states, and our optimizers save a DP-independent
state (the ``DistributedOptimizer`` gathers its shards into full per-param
tensors and cuts them again on load).  Keep the global batch the same
(micro-batch x accumulation x DP).  Ranks that did not exist at save time
find no RNG file and keep their seeded streams, and so does every rank when the
TP / PP / DP / EP / ETP sizes changed (its streams were another rank's), so with
dropout such a resume follows the uninterrupted run only statistically.
"""
from __future__ import annotations

import os
import random
from typing import Any, Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from ..integration import checkpoint as engine_checkpoint
from . import dist_checkpoint
from .run_dir import LATEST, latest_tag, prune_checkpoints, tag_for, write_atomic, write_job_meta


def _rng_path(save_dir: str, tag: str, rank: int) -> str:
    return os.path.join(save_dir, tag, f"rng_state_rank{rank:05d}.pt")


def rng_states(rng_tracker=None) -> Dict[str, Any]:
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    if rng_tracker is not None:
        states["tracker"] = rng_tracker.get_states()
    return states


def set_rng_states(states: Dict[str, Any], rng_tracker=None) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if rng_tracker is not None and "tracker" in states:
        rng_tracker.set_states(states["tracker"])


def save_checkpoint(engine, save_dir: str, step: int, client_state: Dict[str, Any], rng_tracker=None,
                    job_meta: Optional[Dict[str, Any]] = None, keep_last_n: int = 0,
                    ckpt_format: str = "deepspeed") -> str:
    """Save through DeepSpeed (``ckpt_format`` "deepspeed") or ``torch.distributed.checkpoint`` ("torch_dist"),
    then this rank's RNG states and (rank 0) the job's record (``run_dir.JOB_META``), then (rank 0) flip
    ``latest`` and prune to the ``keep_last_n`` newest."""
    tag = tag_for(step)
    if ckpt_format == "torch_dist":
        dist_checkpoint.save(engine, os.path.join(save_dir, tag), client_state)
    else:
        engine_checkpoint.save_checkpoint(engine, save_dir, tag=tag, client_state=client_state, save_latest=False)
    torch.save({**rng_states(rng_tracker), "layout": dist_checkpoint.saved_layout(engine.megatron.state)},
               _rng_path(save_dir, tag, dist.get_rank()))
    if dist.get_rank() == 0 and job_meta is not None:
        write_job_meta(save_dir, tag, job_meta)
    dist.barrier()
    if dist.get_rank() == 0:
        write_atomic(os.path.join(save_dir, LATEST), tag)
        prune_checkpoints(save_dir, keep_last_n)
    dist.barrier()
    return tag


def load_checkpoint(engine, save_dir: str, rng_tracker=None) -> Optional[Dict[str, Any]]:
    """Load the ``latest`` checkpoint; returns its client state, or None when there is none."""
    tag = latest_tag(save_dir)
    if tag is None:
        return None
    if dist_checkpoint.is_dist_checkpoint(os.path.join(save_dir, tag)):  # whatever this job's ckpt_format
        client_state = dist_checkpoint.load(engine, os.path.join(save_dir, tag))
    else:
        load_path, client_state = engine_checkpoint.load_checkpoint(engine, save_dir, tag=tag)
        if load_path is None:
            raise RuntimeError(f"checkpoint {os.path.join(save_dir, tag)} named by {LATEST} could not be loaded")
    rng_file = _rng_path(save_dir, tag, dist.get_rank())
    if os.path.isfile(rng_file):  # absent for ranks beyond the saving job's world size
        states = torch.load(rng_file, weights_only=False)
        # A rank of another layout would take some other rank's dropout streams: it keeps its seeded ones.
        if states.get("layout", dist_checkpoint.saved_layout(engine.megatron.state)) == \
                dist_checkpoint.saved_layout(engine.megatron.state):
            set_rng_states(states, rng_tracker)
    return client_state
