"""Model-parallel random-number streams (Megatron's RNG tracker), on CPU and CUDA.

Two streams matter under tensor parallelism (paper, appendix B.2):

* the default generator, seeded identically on every TP rank of a pipeline
  stage, so dropout *outside* TP regions (on replicated activations) draws
  the same mask everywhere and the replicas stay identical;
* a named "model-parallel-rng" stream, seeded differently per TP rank, used
  *inside* TP regions (e.g. dropout on this rank's attention heads) through
  ``with tracker.fork(): ...``, so different heads get independent masks.

``RNGStatesTracker`` keeps named generator states and swaps one in for the
duration of ``fork()``.  It drives the CPU generator (``torch.get_rng_state``)
or the current CUDA device's generator, chosen at construction (CUDA when
available).  Its method names (``add``, ``fork``, ``get_states``,
``set_states``, ``reset``) are those of Megatron's ``CudaRNGStatesTracker``,
which DeepSpeed's activation checkpointing calls to replay the same dropout
masks in the recomputed forward.

No global state is required: create a tracker and pass it around.  For code
that expects Megatron's ``get_cuda_rng_tracker()``, ``get_rng_tracker()``
(alias ``get_cuda_rng_tracker``) returns one process-wide default instance.

``checkpoint`` (activation recomputation) replays those streams in its rerun;
``is_recomputing()`` tells code inside a rerun in backward that it is one (ours or
any other checkpoint's), ``is_reentrant_rerun()`` whether that rerun's graph is
the one backpropagated: the one home of these facts, read where a forward has
effects beyond its outputs.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.utils.checkpoint

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
# Megatron's offsets: any positive constants work, these keep seeds compatible with Megatron runs.
_TP_SEED_OFFSET = 2718
_EP_SEED_OFFSET = 1024
_PP_SEED_STRIDE = 100


class RNGStatesTracker:
    """Named RNG states for one device kind; ``fork(name)`` runs a block on that state."""

    def __init__(self, device: Optional[str] = None):
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"RNGStatesTracker device={device!r} must be 'cpu' or 'cuda'")
        self.device = device
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()
        self._replayed_in = -1  # the backward (graph task) in which a checkpoint last put back saved states

    # The generator this tracker swaps.
    def _get_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self.device == "cuda" else torch.get_rng_state()

    def _set_state(self, state: torch.Tensor) -> None:
        if self.device == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    def _manual_seed(self, seed: int) -> None:
        if self.device == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.random.default_generator.manual_seed(seed)

    def reset(self) -> None:
        """Forget every tracked state and seed."""
        self.states_ = {}
        self.seeds_ = set()
        self._replayed_in = -1

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of the name -> state map (for checkpoints and activation recomputation)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace every tracked state with ``states`` (as returned by ``get_states``).  A checkpoint that does so
        in backward (ours; DeepSpeed's, which ``integration.engine`` hands this tracker) replays the streams."""
        self.states_ = {name: state.clone() for name, state in states.items()}
        self._replayed_in = torch._C._current_graph_task_id()

    def add(self, name: str, seed: int) -> None:
        """Track a new stream ``name`` seeded with ``seed``; the current generator state is untouched."""
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked; give stream {name!r} a different seed")
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} is already tracked; call reset() first to re-seed it")
        orig = self._get_state()
        try:
            self._manual_seed(seed)
            self.states_[name] = self._get_state()
        finally:
            self._set_state(orig)
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block on stream ``name``; afterwards the stream has advanced and the
        default generator is exactly where it was before the block."""
        if name not in self.states_:
            raise KeyError(f"RNG stream {name!r} is not tracked; call model_parallel_seed(...) or "
                           f"tracker.add({name!r}, seed) first")
        orig = self._get_state()
        start = self.states_[name]
        self._set_state(start)
        try:
            yield
        finally:
            self.states_[name] = self._get_state()
            self._set_state(orig)
            # A rerun in backward by a checkpoint that did not put this tracker's states back (torch's; DeepSpeed's
            # with its own tracker) draws other dropout masks than the forward did: a wrong gradient, refused.  In
            # ``finally``: torch's non-reentrant rerun leaves the block by an exception once it has what it needs.
            if (_foreign_rerun() and self._replayed_in != torch._C._current_graph_task_id()
                    and not torch.equal(self.states_[name], start)):
                raise RuntimeError(
                    f"a checkpoint that does not replay ds_megatron's RNG tracker (torch.utils.checkpoint, or "
                    f"deepspeed.checkpointing before ds_megatron.initialize) reran a layer that draws from its stream "
                    f"{name!r} (attention dropout, or dropout under sequence parallelism): the rerun's dropout masks "
                    "would not be the forward's and the gradients would be wrong; recompute with "
                    "megatron.model.recompute_granularity or deepspeed.checkpointing.checkpoint after "
                    "ds_megatron.initialize, or set that dropout to 0")


_DEFAULT_TRACKER: Optional[RNGStatesTracker] = None


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide default tracker (created on first use), for code that cannot be handed one."""
    global _DEFAULT_TRACKER
    if _DEFAULT_TRACKER is None:
        _DEFAULT_TRACKER = RNGStatesTracker()
    return _DEFAULT_TRACKER


# Megatron's name for the same accessor.
get_cuda_rng_tracker = get_rng_tracker


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0,
                        tracker: Optional[RNGStatesTracker] = None) -> RNGStatesTracker:
    """Seed the default generators and the tracker's streams the way Megatron does.

    * default CPU (and CUDA) generators: ``seed + 100 * pp_rank``, the same on
      every TP rank of a stage, different across stages;
    * "model-parallel-rng": ``that + 2718 + tp_rank``, different per TP rank;
    * "expert-parallel-rng": ``that + 1024 + 100 * ep_rank + etp_rank``, for
      expert layers.

    The tracker is reset first.  Returns it (the default tracker when none is
    given).
    """
    tracker = tracker if tracker is not None else get_rng_tracker()
    stage_seed = seed + _PP_SEED_STRIDE * pp_rank
    torch.manual_seed(stage_seed)  # seeds the CPU and every CUDA generator
    tracker.reset()
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, stage_seed + _TP_SEED_OFFSET + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, stage_seed + _EP_SEED_OFFSET + _PP_SEED_STRIDE * ep_rank + etp_rank)
    return tracker


class _Rerun(threading.local):
    """How many ``checkpoint`` reruns enclose the running code on this thread (the autograd thread that runs
    backward: a CUDA device's own, the caller's on a CPU)."""
    depth = 0


_RERUN = _Rerun()


def is_recomputing() -> bool:
    """Whether an activation checkpoint is rerunning its function in backward: ours (``checkpoint``), torch's or
    DeepSpeed's, reentrant or not (a forward that autograd runs inside a backward is a checkpoint's rerun).  Code
    with effects beyond its outputs (the MoE router's logged losses and expert-bias token counts) makes them once:
    see ``is_reentrant_rerun`` for the rerun that is the only forward with a graph."""
    return _RERUN.depth > 0 or torch._C._current_graph_task_id() != -1


def _foreign_rerun() -> bool:
    """A rerun in backward by someone else's checkpoint (torch's, DeepSpeed's), which replays the default
    generators' states but not this tracker's streams."""
    return _RERUN.depth == 0 and torch._C._current_graph_task_id() != -1


def is_reentrant_rerun() -> bool:
    """Whether this is a reentrant checkpoint's rerun (DeepSpeed's ``checkpointing.checkpoint``, torch's
    ``use_reentrant=True``): its forward ran under no_grad, and the graph this rerun builds is the one
    backpropagated.  A non-reentrant checkpoint (ours, torch's ``use_reentrant=False``, DeepSpeed's
    ``non_reentrant_checkpoint``) reruns under saved-tensor hooks only to refill the forward's graph, whose
    other nodes stay; its rerun's graph is dropped."""
    if not (_foreign_rerun() and torch.is_grad_enabled()):
        return False
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@contextlib.contextmanager
def _rerunning() -> Iterator[None]:
    _RERUN.depth += 1
    try:
        yield
    finally:
        _RERUN.depth -= 1


def checkpoint(function: Callable, tracker: Optional[RNGStatesTracker], *args):
    """Megatron's activation recomputation: ``function(*args)`` keeping only its inputs, rerun in backward.

    The rerun replays the same dropout masks: torch restores the default CPU
    and CUDA generators (``preserve_rng_state``), and the tracker's streams
    (dropout inside tensor-parallel regions) are set back to where they were
    when the forward started, then returned to where backward found them.  The
    tracker is passed in, not looked up: the model that owns it says which.
    Non-reentrant (torch's recommended form), so it composes with
    ``torch.autograd.grad`` and with gradient hooks.  ``is_recomputing()`` is
    true during the rerun.
    """
    forward_states: Dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def record_forward_states():
        if tracker is not None:
            forward_states.update(tracker.get_states())
        yield

    @contextlib.contextmanager
    def replay_forward_states():
        current = tracker.get_states() if tracker is not None else None
        if tracker is not None:
            tracker.set_states(forward_states)
        try:
            with _rerunning():
                yield
        finally:
            if tracker is not None:
                tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=lambda: (record_forward_states(), replay_forward_states()))
