"""The validated parallel layout of one job and the rank lists of all its groups.

``ParallelLayout`` is a frozen set of degrees checked once; ``group_ranks()``
turns it into every group of the job with two ``RankGenerator``s that share the
same ranks ("MoE folding"): the dense one (tp, cp, dp, pp) for attention and
everything that is not an expert, the expert one (etp, ep, edp, pp; cp = 1)
for the MoE layers.  Pure Python: the CLI prints it, ``ParallelState`` builds it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from ..errors import ConfigError, check_positive_int
from .rank_generator import DEFAULT_ORDER, RankGenerator

# Group kinds in the order every rank creates them.
DENSE_GROUPS = ("tp", "cp", "dp", "dp-cp", "pp", "model-parallel", "tp-pp", "tp-cp",
                "embedding", "position-embedding")
EXPERT_GROUPS = ("etp", "ep", "edp", "etp-ep", "expert-model-parallel")
ALL_GROUPS = DENSE_GROUPS + EXPERT_GROUPS

# Which generator token each plain group kind comes from.
_DENSE_TOKENS = {"tp": "tp", "cp": "cp", "dp": "dp", "dp-cp": "dp-cp", "pp": "pp",
                 "model-parallel": "tp-pp", "tp-pp": "tp-pp", "tp-cp": "tp-cp"}
_EXPERT_TOKENS = {"etp": "tp", "ep": "ep", "edp": "dp", "etp-ep": "tp-ep", "expert-model-parallel": "tp-ep-pp"}


def _stride(generator: RankGenerator, token: str) -> int:
    """The rank stride of ``token``'s digit in ``generator``'s order (the first dimension fastest)."""
    stride = 1
    for name, size in zip(generator.order.split("-"), generator.ordered_size):
        if name == token:
            return stride
        stride *= size
    raise ValueError(f"order {generator.order!r} has no {token!r}")


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel degrees of a job.  ``dp`` and ``edp`` are derived from ``world_size``.

    ``etp`` (expert tensor parallel) defaults to ``tp`` as in Megatron-LM.  A layout
    that does not fit raises ``ConfigError`` (a ``ValueError``) naming the sizes.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    order: str = DEFAULT_ORDER

    def __post_init__(self):
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            check_positive_int(name, getattr(self, name))
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        check_positive_int("etp", self.etp)
        dense = self.tp * self.cp * self.pp
        if self.world_size % dense:
            raise ConfigError(f"world size {self.world_size} is not divisible by tp*cp*pp = "
                             f"{self.tp}*{self.cp}*{self.pp} = {dense}; change the sizes or the number of ranks")
        expert = self.etp * self.ep * self.pp
        if self.world_size % expert:
            raise ConfigError(f"world size {self.world_size} is not divisible by etp*ep*pp = "
                             f"{self.etp}*{self.ep}*{self.pp} = {expert}; change the expert sizes or the number of ranks")
        # Constructing both generators validates the order.  Both place pp's digit at a stride (the product of
        # the sizes before it); a group is its ranks whose pp digit is 0 plus multiples of that stride, in rank
        # order of that base, so the two lists of pipeline groups agree exactly when the strides do (an O(1)
        # check in place of listing every rank twice: the layout search makes thousands of layouts).
        dense_gen, expert_gen = self.dense_generator(), self.expert_generator()
        if self.pp > 1 and _stride(dense_gen, "pp") != _stride(expert_gen, "pp"):
            raise ConfigError(f"order {self.order!r} gives different pipeline groups to the dense and the expert "
                             "layers; put pp last in the order (e.g. 'tp-cp-ep-dp-pp')")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    def dense_generator(self) -> RankGenerator:
        return RankGenerator(tp=self.tp, ep=1, dp=self.dp, pp=self.pp, cp=self.cp, order=self.order)

    def expert_generator(self) -> RankGenerator:
        return RankGenerator(tp=self.etp, ep=self.ep, dp=self.edp, pp=self.pp, cp=1, order=self.order)

    def group_ranks(self) -> Dict[str, List[List[int]]]:
        """Every group of the job, by kind, in creation order (``ALL_GROUPS``)."""
        dense, expert = self.dense_generator(), self.expert_generator()
        out: Dict[str, List[List[int]]] = {}
        for kind in DENSE_GROUPS:
            if kind in _DENSE_TOKENS:
                out[kind] = dense.get_ranks(_DENSE_TOKENS[kind])
        # Word embeddings are tied between the first and last pipeline stage;
        # learned positions live on the first stage only.
        out["embedding"] = [[g[0], g[-1]] if len(g) > 1 else list(g) for g in out["pp"]]
        out["position-embedding"] = [[g[0]] for g in out["pp"]]
        for kind in EXPERT_GROUPS:
            out[kind] = expert.get_ranks(_EXPERT_TOKENS[kind])
        return {kind: out[kind] for kind in ALL_GROUPS}

    def coordinates(self, rank: int) -> Dict[str, int]:
        """This rank's index along each dimension of both generators."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        groups = self.group_ranks()
        coords = {}
        for kind in ("tp", "cp", "dp", "pp", "etp", "ep", "edp"):
            coords[kind] = next(g.index(rank) for g in groups[kind] if rank in g)
        return coords
