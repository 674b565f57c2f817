"""Planning a layout before launching it (pure Python, no torch but ``calibrate``): ``ds-megatron plan``.

| module | what it computes |
| --- | --- |
| ``param_counts`` | the parameters each rank holds (sharded, replicated, experts); the pipeline split by parameters |
| ``memory`` | bytes per rank: params, grads, fp32 main params and grads, optimizer states, activations |
| ``comm_volume`` | bus bytes each rank sends per step, per group (DP, distributed optimizer, TP, SP, CP, PP, EP) |
| ``flops`` | the FLOPs of a step (causal attention counted in full, as the published tables count it) |
| ``hardware`` | the machine as data: A100, H100, H200, B200 from datasheets, or a JSON profile; ``DeviceKernels`` |
| ``step_time`` | the predicted step on a profile: GEMMs, attention, memory-bound work, collectives, the bubble |
| ``job_plan`` | a parsed job's plans (memory, bytes on the wire) and the ``Run`` the clock reads |
| ``search`` | ``plan --search``: the layouts of N GPUs that fit memory, ranked by predicted step |
| ``published`` | published runs (Narayanan et al. 2021, Korthikanti et al. 2022) predicted next to published |
| ``calibrate`` | ``plan --calibrate``: this box measured into a profile (the one module that loads torch) |
| ``report`` | the ``plan`` command: a job config in, the tables out |
"""
from .comm_volume import StageComm, format_comm_volume, plan_comm_volume
from .memory import RankMemory, activation_bytes, format_plan, plan_memory
from .param_counts import (ParamCounts, gpt_param_counts, layer_counts, layer_param_count, pipeline_rank_chunks,
                           pipeline_stage_layers)

__all__ = ["StageComm", "format_comm_volume", "plan_comm_volume", "RankMemory", "activation_bytes", "format_plan",
           "plan_memory", "ParamCounts", "gpt_param_counts", "layer_counts", "layer_param_count",
           "pipeline_rank_chunks", "pipeline_stage_layers"]
