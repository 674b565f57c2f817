"""The process groups of one job, built from a ``ParallelLayout`` (Megatron's ``parallel_state``, as an object).

One ``ParallelState`` holds every group (dense and expert) this rank belongs
to, each as a ``ParallelGroup``: its global ranks, this rank's index in it, and
the torch process group.  Model code receives the state (or single groups from
it) explicitly; there are no module globals.  Building is collective: every
rank calls ``torch.distributed.new_group`` for every group of every kind in the
same order, as torch requires.

"No parallelism" has one spelling: a group of size 1 (``ParallelGroup.single``;
``ParallelState.single()`` for a whole single-rank model).  Nothing
communicates over a group of one: the collectives in ``utils.collectives``
take a ``ParallelGroup`` and return at once for size 1, so no code hands
torch.distributed a ``None`` group (which torch reads as the whole world).
A built state still has a torch group for every kind, size 1 included,
because DeepSpeed asks the mpu for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from .parallel.layout import ALL_GROUPS, ParallelLayout


# The collective timeout the job's process group was made with (``integration.runtime.init_distributed`` sets it).
# torch's new_group takes its backend's default (30 minutes) whatever init_process_group was given, so every group
# the package creates passes this one: a peer lost without a FIN (a node cut off) fails the job within it.
_collective_timeout = None


def set_collective_timeout(timeout) -> None:
    global _collective_timeout
    _collective_timeout = timeout


def collective_timeout():
    """A ``datetime.timedelta`` for ``dist.new_group(..., timeout=)``, or None (torch's default)."""
    return _collective_timeout


@dataclass(frozen=True)
class ParallelGroup:
    """This rank's group of one kind: its global ranks, this rank's index in them, and the torch group."""

    kind: str
    ranks: Tuple[int, ...]
    rank: int  # this process's index in ``ranks``
    group: Optional[dist.ProcessGroup]  # None only for ``single`` (no torch.distributed needed)

    @classmethod
    def single(cls, kind: str) -> "ParallelGroup":
        """The group of one: this rank alone (no parallelism along ``kind``)."""
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return cls(kind, (me,), 0, None)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def src_rank(self) -> int:
        """Global rank of the first member (for broadcasts within the group)."""
        return self.ranks[0]


class ParallelState:
    """All groups of a job for this rank.  Build with ``ParallelState.build(layout)``."""

    def __init__(self, layout: ParallelLayout, groups: Dict[str, ParallelGroup], all_ranks: Dict[str, List[List[int]]],
                 owned: List[dist.ProcessGroup], world: ParallelGroup):
        self.layout = layout
        self.groups = groups
        self.all_ranks = all_ranks
        self._owned = owned
        self.world = world  # every rank of the job

    @classmethod
    def build(cls, layout: ParallelLayout) -> "ParallelState":
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call deepspeed.init_distributed() "
                               "or ds_megatron.initialize() first")
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(f"layout is for world size {layout.world_size} but this job has {world} ranks")
        me = dist.get_rank()
        all_ranks = layout.group_ranks()
        # Identical rank lists share one torch group (e.g. model-parallel and tp-pp);
        # the world is the default group.  Deterministic on every rank.
        by_ranks: Dict[Tuple[int, ...], dist.ProcessGroup] = {tuple(range(world)): dist.group.WORLD}
        owned: List[dist.ProcessGroup] = []
        groups: Dict[str, ParallelGroup] = {}
        for kind in ALL_GROUPS:
            for ranks in all_ranks[kind]:
                key = tuple(ranks)
                if key not in by_ranks:
                    pg = dist.new_group(list(key), timeout=collective_timeout())
                    by_ranks[key] = pg
                    owned.append(pg)
                if me in key:
                    groups[kind] = ParallelGroup(kind, key, key.index(me), by_ranks[key])
        world_group = ParallelGroup("world", tuple(range(world)), me, dist.group.WORLD)
        return cls(layout, groups, all_ranks, owned, world_group)

    @classmethod
    def single(cls) -> "ParallelState":
        """The state of a one-rank job: every group of size 1 (needs no torch.distributed)."""
        layout = ParallelLayout(world_size=1)
        return cls(layout, {kind: ParallelGroup.single(kind) for kind in ALL_GROUPS}, layout.group_ranks(), [],
                   ParallelGroup.single("world"))

    def build_hierarchical_context_parallel(self, inner: int) -> None:
        """Megatron's hierarchical CP groups (collective, every rank once): each CP group cut into groups of
        ``inner`` consecutive ranks ("hcp-a2a") and the groups of the ranks at the same place in them
        ("hcp-p2p"), so CP rank ``j * inner + i`` is rank i of its a2a group and rank j of its ring."""
        if inner < 1 or self.layout.cp % inner:
            raise ValueError(f"inner hierarchical CP size {inner} does not divide cp={self.layout.cp}")
        me = dist.get_rank()
        for kind, cut in (("hcp-a2a", lambda r: [r[o:o + inner] for o in range(0, len(r), inner)]),
                          ("hcp-p2p", lambda r: [r[i::inner] for i in range(inner)])):
            lists = [sub for ranks in self.all_ranks["cp"] for sub in cut(ranks)]
            self.all_ranks[kind] = lists
            for ranks in lists:
                key = tuple(ranks)
                pg = dist.new_group(list(key), timeout=collective_timeout()) if len(key) > 1 else None
                if pg is not None:
                    self._owned.append(pg)
                if me in key:
                    self.groups[kind] = ParallelGroup(kind, key, key.index(me), pg) if pg is not None else \
                        ParallelGroup.single(kind)

    @property
    def hierarchical_context_parallel(self):
        """(a2a group, ring group) of Megatron's hierarchical CP, or None when not built."""
        if "hcp-a2a" not in self.groups:
            return None
        return self.groups["hcp-a2a"], self.groups["hcp-p2p"]

    def destroy(self) -> None:
        """Tear the groups down (collective); the object is unusable afterwards."""
        for pg in self._owned:
            if pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(pg)
        self._owned = []
        self.groups = {}

    def __getitem__(self, kind: str) -> ParallelGroup:
        try:
            return self.groups[kind]
        except KeyError:
            raise KeyError(f"no group of kind {kind!r}; kinds are {', '.join(ALL_GROUPS)}") from None

    # Short names for the groups model code uses most.
    @property
    def tp(self) -> ParallelGroup:
        return self["tp"]

    @property
    def cp(self) -> ParallelGroup:
        return self["cp"]

    @property
    def dp(self) -> ParallelGroup:
        return self["dp"]

    @property
    def dp_cp(self) -> ParallelGroup:
        return self["dp-cp"]

    @property
    def pp(self) -> ParallelGroup:
        return self["pp"]

    @property
    def mp(self) -> ParallelGroup:
        return self["model-parallel"]

    @property
    def etp(self) -> ParallelGroup:
        return self["etp"]

    @property
    def ep(self) -> ParallelGroup:
        return self["ep"]

    @property
    def edp(self) -> ParallelGroup:
        return self["edp"]

    @property
    def etp_ep(self) -> ParallelGroup:
        return self["etp-ep"]

    @property
    def expert_mp(self) -> ParallelGroup:
        return self["expert-model-parallel"]

    def describe(self) -> str:
        return " ".join(f"{k}={self.groups[k].rank}/{self.groups[k].size}"
                        for k in ("tp", "cp", "dp", "pp", "etp", "ep", "edp"))
