"""Which ranks form each parallel group of a job: pure Python, no torch.

``rank_generator`` is Megatron's generator of rank groups; ``layout`` is the
validated set of degrees of one job and every group it has (dense and expert,
"MoE folding").  The process groups built from them live in
``ds_megatron.parallel_state``.
"""
from .layout import ALL_GROUPS, DENSE_GROUPS, EXPERT_GROUPS, ParallelLayout
from .rank_generator import (DEFAULT_ORDER, DIMENSIONS, RankGenerator, generate_masked_orthogonal_groups,
                             generate_masked_orthogonal_rank_groups)

__all__ = ["ALL_GROUPS", "DENSE_GROUPS", "EXPERT_GROUPS", "ParallelLayout", "DEFAULT_ORDER", "DIMENSIONS",
           "RankGenerator", "generate_masked_orthogonal_groups", "generate_masked_orthogonal_rank_groups"]
