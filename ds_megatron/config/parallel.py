"""``ParallelConfig``: the parallel sizes of the ``"megatron"`` section, under Megatron-LM's argument names.

The JSON keys (``tensor_model_parallel_size``, ...) are what users write;
``layout(world_size)`` turns them into the ``ParallelLayout`` (short names,
derived ``dp`` / ``edp``) that everything else uses.  This is the one place
the two spellings meet.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ..errors import ConfigError, check_positive_int
from ..parallel.layout import ParallelLayout
from ..parallel.rank_generator import DEFAULT_ORDER
from .parsing import SECTION


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    # Megatron's hierarchical context parallelism ([inner, outer], product context_parallel_size): with the model's
    # cp_comm_type "a2a+p2p", all-to-all inside groups of `inner` consecutive CP ranks, the ring across them.
    hierarchical_context_parallel_sizes: Optional[List[int]] = None
    expert_model_parallel_size: int = 1
    # None means "same as tensor_model_parallel_size", as in Megatron-LM.
    expert_tensor_parallel_size: Optional[int] = None
    order: str = DEFAULT_ORDER
    # Megatron's sequence parallelism inside TP (LayerNorm/dropout regions sharded along the sequence).
    sequence_parallel: bool = False
    make_vocab_size_divisible_by: int = 128
    # Pipeline: how the transformer layers split into (virtual) stages and which schedule runs them
    # (config.pipeline holds the rules).
    pipeline_partition_method: str = "uniform"  # uniform | parameters
    pipeline_num_layers_per_stage: Optional[List[int]] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    microbatch_group_size_per_vp_stage: Optional[int] = None
    pipeline_schedule: Optional[str] = None  # 1f1b | interleaved_1f1b | zero_bubble; default by vpp

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size", "make_vocab_size_divisible_by"):
            check_positive_int(f"{SECTION}.{name}", getattr(self, name))
        if self.expert_tensor_parallel_size is not None:
            check_positive_int(f"{SECTION}.expert_tensor_parallel_size", self.expert_tensor_parallel_size)
        if self.pipeline_partition_method not in ("uniform", "parameters"):
            raise ConfigError(f"{SECTION}.pipeline_partition_method={self.pipeline_partition_method!r} is unknown; "
                              "use \"uniform\" or \"parameters\"")
        for name in ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                     "microbatch_group_size_per_vp_stage", "decoder_first_pipeline_num_layers",
                     "decoder_last_pipeline_num_layers"):
            if getattr(self, name) is not None:
                check_positive_int(f"{SECTION}.{name}", getattr(self, name))
        sizes = self.hierarchical_context_parallel_sizes
        if sizes is not None:
            if (not isinstance(sizes, list) or len(sizes) != 2
                    or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes)
                    or sizes[0] * sizes[1] != self.context_parallel_size):
                raise ConfigError(f"{SECTION}.hierarchical_context_parallel_sizes={sizes!r} must be [a2a, p2p], two "
                                  f"positive integers whose product is context_parallel_size="
                                  f"{self.context_parallel_size}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError(f"{SECTION}.sequence_parallel is true but tensor_model_parallel_size is 1; "
                              "sequence parallelism shards along TP ranks: set tensor_model_parallel_size > 1 "
                              "or sequence_parallel to false")

    def layout(self, world_size: int) -> ParallelLayout:
        """The validated ``ParallelLayout`` for ``world_size`` ranks (ConfigError if it does not fit)."""
        try:
            return ParallelLayout(world_size=world_size, tp=self.tensor_model_parallel_size,
                                  pp=self.pipeline_model_parallel_size, cp=self.context_parallel_size,
                                  ep=self.expert_model_parallel_size, etp=self.expert_tensor_parallel_size,
                                  order=self.order)
        except ValueError as e:
            raise ConfigError(f"{SECTION}: {e}") from None
