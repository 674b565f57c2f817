"""The stage-to-stage channels of a pipeline: one two-rank group per direction of each neighbouring pair.

Each channel carries traffic one way only, and its receiver posts its receives in the order the sender
sends (``schedule_table.channel_messages``: every rank can compute every other rank's order).  So the
k-th receive always matches the k-th send (no tags, no shape exchange: shapes are known in advance),
and a send never waits behind a receive of the other direction on a shared queue (NCCL serialises the
operations of one communicator, which is how a send/receive pair in both directions between the same
two ranks can deadlock).  With ``p`` stages that is ``2p`` groups per pipeline (2 for ``p = 2``), made
by every rank in the same order, as ``torch.distributed.new_group`` requires.

Every send is counted by ``utils.collectives.record`` (as a ``send`` over the ``pp`` group), so
``count_bytes()`` sees the pipeline's traffic like every other collective.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from ..parallel_state import ParallelGroup, ParallelState, collective_timeout
from ..utils.collectives import record


class PipelineChannels:
    """Directed channels between this rank and its pipeline neighbours (collective to build: every rank)."""

    def __init__(self, state: ParallelState):
        self.pp: ParallelGroup = state.pp
        me = dist.get_rank()
        self._groups: Dict[Tuple[int, int], object] = {}
        self._all: List[object] = []
        for ranks in state.all_ranks["pp"]:
            edges: List[Tuple[int, int]] = []
            for i in range(len(ranks)):
                a, b = ranks[i], ranks[(i + 1) % len(ranks)]
                for edge in ((a, b), (b, a)):
                    if a != b and edge not in edges:
                        edges.append(edge)
            for edge in edges:
                group = dist.new_group(sorted(edge), timeout=collective_timeout())  # bounded: a peer may be lost
                self._all.append(group)
                if me in edge:
                    self._groups[edge] = group

    def _group(self, src: int, dst: int):
        return self._groups[(self.pp.ranks[src], self.pp.ranks[dst])]

    def send(self, tensor: torch.Tensor, dst: int):
        """Start sending ``tensor`` to pipeline rank ``dst``; returns the work handle (keep ``tensor`` until it ends)."""
        record("send", self.pp, tensor)
        return dist.isend(tensor, self.pp.ranks[dst], group=self._group(self.pp.rank, dst))

    def recv(self, buffer: torch.Tensor, src: int):
        """Start receiving into ``buffer`` from pipeline rank ``src``; returns the work handle."""
        return dist.irecv(buffer, self.pp.ranks[src], group=self._group(src, self.pp.rank))

    def destroy(self) -> None:
        """Tear the channel groups down (collective: every rank, as when they were made)."""
        for group in self._all:
            dist.destroy_process_group(group)
        self._all, self._groups = [], {}


__all__ = ["PipelineChannels"]
