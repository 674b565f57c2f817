"""Megatron's rank-group generator: which global ranks form each parallel group.

Pure Python (no torch.distributed), so the CLI and tests can print and check the
layout of any job before it is launched.  The ranks of a job are laid out as a
mixed-radix number whose digits are the parallel dimensions in ``order`` (the
first dimension varies fastest).  A group of a token such as ``"tp"`` or
``"dp-cp"`` is the set of ranks that differ only in the masked digits.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def _prefix_product(sizes: Sequence[int]) -> List[int]:
    """[1, s0, s0*s1, ...]: the stride of each digit, plus the total at the end."""
    out = [1]
    for s in sizes:
        out.append(out[-1] * s)
    return out


def _decompose(index: int, shape: Sequence[int]) -> List[int]:
    """Digits of ``index`` in the mixed radix ``shape`` (first digit fastest)."""
    digits = []
    for s in shape:
        digits.append(index % s)
        index //= s
    return digits


def generate_masked_orthogonal_rank_groups(world_size: int, parallel_size: Sequence[int],
                                           mask: Sequence[bool]) -> List[List[int]]:
    """Groups of ranks that differ only along the dimensions where ``mask`` is True.

    ``parallel_size`` lists the sizes of the dimensions in layout order; the
    masked dimensions vary inside a group, the unmasked ones pick the group.
    Group ``i`` is the ``i``-th combination of the unmasked digits (first one
    fastest); inside it, ranks follow the masked digits (first one fastest).
    This is Megatron-LM's function of the same name, same results.
    """
    if len(parallel_size) != len(mask):
        raise ValueError(f"parallel_size has {len(parallel_size)} entries but mask has {len(mask)}; "
                         "give one mask flag per dimension")
    if any(int(s) < 1 for s in parallel_size):
        raise ValueError(f"parallel_size {list(parallel_size)} has a size below 1; every size must be >= 1")
    total = _prefix_product(parallel_size)[-1]
    if total != world_size:
        raise ValueError(f"world_size {world_size} != product of parallel_size {list(parallel_size)} = {total}")

    stride = _prefix_product(parallel_size)[:-1]
    masked_shape = [s for s, m in zip(parallel_size, mask) if m]
    masked_stride = [d for d, m in zip(stride, mask) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]
    unmasked_stride = [d for d, m in zip(stride, mask) if not m]

    group_size = _prefix_product(masked_shape)[-1]
    num_groups = world_size // group_size
    groups = []
    for group_index in range(num_groups):
        base = sum(i * d for i, d in zip(_decompose(group_index, unmasked_shape), unmasked_stride))
        groups.append([base + sum(i * d for i, d in zip(_decompose(r, masked_shape), masked_stride))
                       for r in range(group_size)])
    return groups


# The seed calls it by this name; both are public.
generate_masked_orthogonal_groups = generate_masked_orthogonal_rank_groups


class RankGenerator:
    """The rank groups of one generator (dense: tp-cp-dp-pp, expert: etp-ep-edp-pp).

    ``order`` is a permutation of ``tp``, ``cp``, ``ep``, ``dp``, ``pp`` joined
    by ``-``; dimensions of size 1 may be left out (they are appended), a
    dimension of size > 1 may not.  EP and CP may not both exceed 1 in one
    generator: MoE folding puts CP in the dense generator and EP in the expert one.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0):
        sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name} size must be a positive integer, got {size!r}")
        if ep > 1 and cp > 1:
            raise ValueError(f"ep={ep} and cp={cp} are both > 1 in one rank generator; "
                             "put cp in the dense generator and ep in the expert one (MoE folding)")
        if not isinstance(rank_offset, int) or rank_offset < 0:
            raise ValueError(f"rank_offset must be a non-negative integer, got {rank_offset!r}")
        tokens = order.lower().split("-") if order else []
        for t in tokens:
            if t not in sizes:
                raise ValueError(f"order {order!r} has unknown dimension {t!r}; use names from {'-'.join(DIMENSIONS)}")
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"order {order!r} names a dimension twice")
        for name, size in sizes.items():
            if name not in tokens:
                if size != 1:
                    raise ValueError(f"{name} size is {size} but order {order!r} does not name {name!r}; "
                                     f"add it to the order")
                tokens.append(name)
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * cp * ep * dp * pp
        self.name_to_size: Dict[str, int] = sizes
        self.order = "-".join(tokens)
        self.ordered_size = [sizes[t] for t in tokens]

    def get_mask(self, order: str, token: str) -> List[bool]:
        """One flag per dimension of ``order``: True where ``token`` names it."""
        ordered = order.split("-")
        mask = [False] * len(ordered)
        for t in token.split("-"):
            if t not in ordered:
                raise ValueError(f"token {token!r} names {t!r}, which is not in order {order!r}")
            mask[ordered.index(t)] = True
        return mask

    def get_ranks(self, token: str) -> List[List[int]]:
        """All groups of ``token`` (e.g. ``"tp"``, ``"dp-cp"``, ``"tp-ep-pp"``), offset by ``rank_offset``."""
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        return [[r + self.rank_offset for r in g] for g in groups]
