"""The random-number state a checkpoint carries per rank: torch's, Python's, numpy's, CUDA's and the model's
model-parallel tracker (the dropout streams), restored only at the layout that saved them.

A rank of another layout (other TP / PP / DP / CP / EP / ETP sizes) would take some other rank's
streams; it keeps its seeded ones, so with dropout such a resume follows the uninterrupted run
only statistically.  Ranks that did not exist at save time find no file and keep theirs too.
"""
from __future__ import annotations

import os
import random
from typing import Any, Dict

import numpy as np
import torch

from ..parallel_state import ParallelState

AXES = ("tp", "pp", "dp", "cp", "ep", "etp")


def saved_layout(parallel_state: ParallelState) -> Dict[str, int]:
    """The sizes a checkpoint records (a resume at other sizes reshards; RNG streams are kept only at the same)."""
    return {axis: getattr(parallel_state, axis).size for axis in AXES}


def rng_file(tag_dir: str, rank: int) -> str:
    return os.path.join(tag_dir, f"rng_state_rank{rank:05d}.pt")


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


def save_rng_states(tag_dir: str, rank: int, parallel_state: ParallelState, rng_tracker=None) -> None:
    torch.save({**rng_states(rng_tracker), "layout": saved_layout(parallel_state)}, rng_file(tag_dir, rank))


def load_rng_states(tag_dir: str, rank: int, parallel_state: ParallelState, rng_tracker=None) -> bool:
    """Restore this rank's streams when the checkpoint has them and was saved at this layout; whether it did."""
    path = rng_file(tag_dir, rank)
    if not os.path.isfile(path):  # absent for ranks beyond the saving job's world size
        return False
    states = torch.load(path, weights_only=False)
    if states.get("layout", saved_layout(parallel_state)) != saved_layout(parallel_state):
        return False
    set_rng_states(states, rng_tracker)
    return True
