"""The object DeepSpeed is handed as ``mpu=``, backed by a ``ParallelState`` (a DeepSpeed seam).

DeepSpeed 0.19 asks an mpu for model-, tensor-, pipeline- and data-parallel
groups (engine, ZeRO, clipping, checkpoint names) and probes for
sequence-parallel ones.  Vocabulary clash: DeepSpeed's "sequence parallel"
is Ulysses attention sharding, switched on by an mpu reporting a size above 1.
Megatron's sequence parallelism lives inside TP and its context parallelism
is not Ulysses, so ``get_sequence_parallel_*`` always reports a world of one,
while Megatron's dp-cp group is what DeepSpeed sees as its
sequence-data-parallel group (the group gradients are averaged over).
Deliberately no ``initialize_sequence_parallel`` attribute: DeepSpeed takes
its presence to mean a Ulysses mpu and then ignores the DP group.
"""
from __future__ import annotations

import torch.distributed as dist

from ..parallel_state import ParallelState


class MegatronMPU:
    def __init__(self, state: ParallelState, rng_tracker=None):
        self.state = state
        self._rng_tracker = rng_tracker

    # model parallel = tensor x pipeline (what a checkpoint shard is named by)
    def get_model_parallel_group(self):
        return self.state.mp.group

    def get_model_parallel_rank(self) -> int:
        return self.state.mp.rank

    def get_model_parallel_world_size(self) -> int:
        return self.state.mp.size

    # tensor parallel
    def get_tensor_model_parallel_group(self):
        return self.state.tp.group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.state.tp.rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.state.tp.size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.state.tp.src_rank

    # DeepSpeed's older name for the tensor-parallel slice (used by clipping).
    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size

    # pipeline parallel
    def get_pipeline_model_parallel_group(self):
        return self.state.pp.group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.state.pp.rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.state.pp.size

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size

    # data parallel (replicas of the dense model, without context parallelism)
    def get_data_parallel_group(self):
        return self.state.dp.group

    def get_data_parallel_rank(self) -> int:
        return self.state.dp.rank

    def get_data_parallel_world_size(self) -> int:
        return self.state.dp.size

    def get_data_parallel_group_ranks(self):
        return list(self.state.dp.ranks)

    # DeepSpeed's Ulysses sequence parallelism: never on (see module docstring).
    def get_sequence_parallel_group(self):
        # A world of one needs no group; DeepSpeed only asks when the size is above 1.
        return None

    def get_sequence_parallel_rank(self) -> int:
        return 0

    def get_sequence_parallel_world_size(self) -> int:
        return 1

    # DeepSpeed averages dense gradients over this group: Megatron's dp-cp.
    def get_sequence_data_parallel_group(self):
        return self.state.dp_cp.group

    def get_sequence_data_parallel_rank(self) -> int:
        return self.state.dp_cp.rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.state.dp_cp.size

    # context parallel (Megatron's), for our own modules
    def get_context_parallel_group(self):
        return self.state.cp.group

    def get_context_parallel_rank(self) -> int:
        return self.state.cp.rank

    def get_context_parallel_world_size(self) -> int:
        return self.state.cp.size

    # expert side (MoE folding): expert-model-parallel = ep, expert-tensor = etp, expert-data = edp
    def get_expert_model_parallel_group(self):
        return self.state.ep.group

    def get_expert_model_parallel_rank(self) -> int:
        return self.state.ep.rank

    def get_expert_model_parallel_world_size(self) -> int:
        return self.state.ep.size

    def get_expert_tensor_parallel_group(self):
        return self.state.etp.group

    def get_expert_tensor_parallel_rank(self) -> int:
        return self.state.etp.rank

    def get_expert_tensor_parallel_world_size(self) -> int:
        return self.state.etp.size

    def get_expert_data_parallel_group(self):
        return self.state.edp.group

    def get_expert_data_parallel_rank(self) -> int:
        return self.state.edp.rank

    def get_expert_data_parallel_world_size(self) -> int:
        return self.state.edp.size

    # activation checkpointing and dropout inside TP regions
    def get_cuda_rng_tracker(self):
        if self._rng_tracker is None:
            raise RuntimeError("no model-parallel RNG tracker was given to this mpu; "
                               "seed one with ds_megatron.tensor_parallel.model_parallel_seed")
        return self._rng_tracker

    def __repr__(self) -> str:
        return f"MegatronMPU(rank={dist.get_rank()}, {self.state.describe()})"
