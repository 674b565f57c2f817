"""Rank groups (pure) and the process groups built from them.

``rank_generator`` and ``layout`` are pure Python; ``state`` and ``mpu`` need
torch.distributed and are imported on first use so that config validation and
the CLI stay fast.
"""
from .layout import ALL_GROUPS, DENSE_GROUPS, EXPERT_GROUPS, ParallelLayout
from .rank_generator import (DEFAULT_ORDER, RankGenerator, generate_masked_orthogonal_groups,
                             generate_masked_orthogonal_rank_groups)

_LAZY = {"ParallelState": "state", "ParallelGroup": "state", "MegatronMPU": "mpu"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ALL_GROUPS", "DENSE_GROUPS", "EXPERT_GROUPS", "ParallelLayout", "DEFAULT_ORDER", "RankGenerator",
           "generate_masked_orthogonal_groups", "generate_masked_orthogonal_rank_groups", *_LAZY]
