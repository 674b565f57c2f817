"""Handing our model-parallel RNG tracker to DeepSpeed's activation checkpointing (a DeepSpeed seam).

Our models recompute with ``tensor_parallel.checkpoint`` and pass their
tracker explicitly.  A user's own model that recomputes through DeepSpeed's
``deepspeed.checkpointing.checkpoint`` replays dropout with that module's own
tracker (``_CUDA_RNG_STATE_TRACKER``; it never asks the mpu), so ours must be
the one it saves and restores: ``initialize`` installs the model's tracker
there, in this one place.
"""
from __future__ import annotations

from deepspeed.runtime.activation_checkpointing import checkpointing

from ..tensor_parallel import RNGStatesTracker


def install_rng_tracker(tracker: RNGStatesTracker) -> None:
    checkpointing._CUDA_RNG_STATE_TRACKER = tracker
