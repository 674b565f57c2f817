"""The fp8 recipe (Megatron's ``fp8`` / ``fp8_recipe`` settings) and the scaling state of one linear layer.

Scales follow Transformer Engine's convention: a tensor is quantized as ``fp8(x * scale)`` and read back as
``q * scale_inv``, with ``scale = fp8_max / amax / 2^margin``.  Recipes:

* ``"tensorwise"`` (current scaling): one scale per tensor from its own amax, reduced (MAX) over the layer's amax
  group (the ranks that split its tensors: TP, times CP in a model), so a split tensor gets the whole one's scale.
* ``"delayed"``: one scale per tensor role (input, weight, output gradient) from the amax history of earlier
  optimizer steps; this step's amaxes are collected (MAX over micro-batches) and enter the history in
  ``update_delayed_scaling``, once per optimizer step, agreed over every rank holding the same weight: a dense
  linear's over TP and dp-cp, an expert's over ETP and expert-DP (``delayed_scaling_groups``; never EP, whose
  ranks hold other experts).  The scale of step t therefore comes from the amaxes of steps < t; the first step
  uses scale 1.
* ``"blockwise"`` (DeepSeek-V3): a power-of-two scale per 1x128 tile of activations and gradients (along the
  GEMM's reduction dimension) and per 128x128 block of weights; no collective needed.

Every recipe composes with CUDA graphs (``cuda_graphs``): tensorwise and blockwise compute their scales on the
device from the tensors at hand (tensorwise's amax all-reduce is a collective inside the graph), and the delayed
state's tensors keep their storages, written in place only (``record_amax`` in the captured passes, ``advance``
between optimizer steps, outside the graphs), so a replay reads the current scales; nothing reads a value on the
host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from ..parallel_state import ParallelGroup, ParallelState
from ..utils import collectives

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
BLOCK = 128  # the blockwise recipe's tile edge
FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed", "blockwise")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
ROLES = ("input", "weight", "grad_output")
KINDS = ("dense", "expert")  # a state's kind names the groups its delayed amaxes are agreed over


@dataclass(frozen=True)
class FP8Recipe:
    """``fp8``: "e4m3" (every tensor E4M3) or "hybrid" (E4M3 forward, E5M2 output gradients)."""

    fp8: str = "e4m3"
    recipe: str = "tensorwise"
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    margin: int = 0

    def __post_init__(self):
        if self.fp8 not in FORMATS:
            raise ValueError(f"fp8={self.fp8!r} is unknown; use one of {', '.join(FORMATS)}")
        if self.recipe not in RECIPES:
            raise ValueError(f"fp8_recipe={self.recipe!r} is unknown; use one of {', '.join(RECIPES)}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"fp8_amax_compute_algo={self.amax_compute_algo!r} is unknown; use one of "
                             f"{', '.join(AMAX_COMPUTE_ALGOS)}")

    @classmethod
    def from_config(cls, config) -> Optional["FP8Recipe"]:
        """The recipe of a ``GPTConfig`` (None when ``fp8`` is null)."""
        if config.fp8 is None:
            return None
        return cls(config.fp8, config.fp8_recipe, config.fp8_amax_history_len, config.fp8_amax_compute_algo,
                   config.fp8_margin)

    def dtype(self, role: str) -> torch.dtype:
        return torch.float8_e5m2 if self.fp8 == "hybrid" and role == "grad_output" else torch.float8_e4m3fn

    def fp8_max(self, role: str) -> float:
        return E5M2_MAX if self.dtype(role) == torch.float8_e5m2 else E4M3_MAX


class FP8LinearState:
    """The fp8 scaling state of one linear layer: its recipe, ``amax_group`` (the ranks its tensors are split over,
    whose amaxes it agrees on: TP x CP for the transformer's linears, ETP for an expert's), ``kind`` ("dense" or
    "expert": which ranks hold the same weight, see ``delayed_scaling_groups``), and for the delayed recipe each
    role's amax history, scale and this step's running amax."""

    def __init__(self, recipe: FP8Recipe, amax_group: ParallelGroup, in_features: int, out_features: int,
                 device: Optional[torch.device] = None, kind: str = "dense"):
        if kind not in KINDS:
            raise ValueError(f"FP8LinearState kind={kind!r} is unknown; use one of {', '.join(KINDS)}")
        # Blockwise: the output width may leave a partial 128-row weight block and output-gradient tile (MLA's
        # kv_lora_rank + qk_pos_emb_head_dim, as DeepSeek-V3 trained); the input width is the forward GEMM's.
        if recipe.recipe == "blockwise" and in_features % BLOCK:
            raise ValueError(f"fp8_recipe \"blockwise\" tiles by {BLOCK}, but this linear layer's input features per "
                             f"TP rank is {in_features}; choose model sizes whose per-rank widths are multiples of "
                             f"{BLOCK}")
        self.recipe, self.amax_group, self.kind = recipe, amax_group, kind
        if recipe.recipe == "delayed":
            n = recipe.amax_history_len
            self.amax_history = {r: torch.zeros(n, dtype=torch.float32, device=device) for r in ROLES}
            self.scale = {r: torch.ones((), dtype=torch.float32, device=device) for r in ROLES}
            self.step_amax = {r: torch.zeros((), dtype=torch.float32, device=device) for r in ROLES}

    def follow(self, device: torch.device) -> None:
        """Delayed recipe: keep the history and scales on the layer's device (a model moved after it was built,
        which happens before any capture: a CUDA graph then finds them on its device and never moved again)."""
        if self.scale["input"].device != device:
            for d in (self.amax_history, self.scale, self.step_amax):
                d.update({r: t.to(device) for r, t in d.items()})

    def record_amax(self, role: str, amax: torch.Tensor) -> None:
        """Delayed recipe: fold a micro-batch's amax into this step's (MAX)."""
        torch.maximum(self.step_amax[role], amax.detach().float(), out=self.step_amax[role])

    def advance(self, reduced_amax: dict) -> None:
        """Delayed recipe: this step's amaxes (already agreed over the state's groups) enter the history; the scales
        of the next step follow from it.  An amax of 0 or a non-finite one keeps the previous scale (Transformer
        Engine)."""
        r = self.recipe
        for role in ROLES:
            history = self.amax_history[role]
            history.copy_(torch.roll(history, 1))
            history[0] = reduced_amax[role]
            amax = history[0] if r.amax_compute_algo == "most_recent" else history.max()
            new = torch.full_like(amax, r.fp8_max(role)) / amax / (2.0 ** r.margin)  # not float / tensor: 2 roundings
            keep = ~torch.isfinite(amax) | (amax <= 0)
            self.scale[role].copy_(torch.where(keep, self.scale[role], new))
            self.step_amax[role].zero_()

    def state_tensors(self) -> List[torch.Tensor]:
        """Delayed recipe: every tensor of the state (histories, scales, step amaxes; none for the other recipes).
        Each keeps its storage for the whole run, updated in place only: a captured CUDA graph replays the kernels
        that read and write them at the addresses they had at capture."""
        if self.recipe.recipe != "delayed":
            return []
        return [d[r] for d in (self.amax_history, self.scale, self.step_amax) for r in ROLES]


def delayed_scaling_groups(parallel_state: ParallelState) -> Dict[str, List[ParallelGroup]]:
    """Per kind of state, the groups a step's delayed-recipe amaxes are agreed over (MAX), in order: every rank
    that holds the same weight, whether it saw other tokens or other columns.  A dense linear: TP, then dp-cp (DP
    and CP's other sequence chunks).  An expert: ETP, then expert-DP (the ranks holding the same experts, CP's
    included); never EP, whose ranks hold other experts."""
    return {"dense": [parallel_state.tp, parallel_state.dp_cp], "expert": [parallel_state.etp, parallel_state.edp]}


def update_delayed_scaling(states: Sequence[FP8LinearState],
                           groups: Mapping[str, Sequence[ParallelGroup]]) -> None:
    """Once per optimizer step: agree on every delayed state's step amaxes over its kind's ``groups``
    (``delayed_scaling_groups``; MAX, one all-reduce per group for all states of a kind, dense then expert) and
    advance their histories and scales.  Every rank of a group holds the same states of that kind and passes
    them in the same order (its stage's, in module order)."""
    for kind in KINDS:
        mine = [s for s in states if s.recipe.recipe == "delayed" and s.kind == kind]
        if not mine:
            continue
        amax = torch.stack([s.step_amax[r] for s in mine for r in ROLES])
        for group in groups[kind]:
            collectives.all_reduce(amax, group, op=collectives.MAX)
        for i, s in enumerate(mine):
            s.advance({r: amax[i * len(ROLES) + j] for j, r in enumerate(ROLES)})


__all__ = ["AMAX_COMPUTE_ALGOS", "BLOCK", "E4M3_MAX", "E5M2_MAX", "FORMATS", "FP8LinearState", "FP8Recipe", "KINDS",
           "RECIPES", "ROLES", "delayed_scaling_groups", "update_delayed_scaling"]
