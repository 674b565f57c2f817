"""Planning a layout before launching it (pure Python, no torch): ``ds-megatron plan``.

| module | what it computes |
| --- | --- |
| ``param_counts`` | the parameters each rank holds (sharded, replicated, experts); the pipeline split by parameters |
| ``memory`` | bytes per rank: params, grads, fp32 main params and grads, optimizer states, activations |
| ``comm_volume`` | bus bytes each rank sends per step, per group (DP, distributed optimizer, TP, SP, CP, PP) |
| ``report`` | the ``plan`` command: a job config in, the tables out |
"""
from .comm_volume import StageComm, format_comm_volume, plan_comm_volume
from .memory import RankMemory, activation_bytes, format_plan, plan_memory
from .param_counts import (ParamCounts, gpt_param_counts, layer_counts, layer_param_count, pipeline_rank_chunks,
                           pipeline_stage_layers)

__all__ = ["StageComm", "format_comm_volume", "plan_comm_volume", "RankMemory", "activation_bytes", "format_plan",
           "plan_memory", "ParamCounts", "gpt_param_counts", "layer_counts", "layer_param_count",
           "pipeline_rank_chunks", "pipeline_stage_layers"]
