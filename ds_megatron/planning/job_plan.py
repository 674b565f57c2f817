"""A parsed job's plans, from its config alone (pure, no torch): the memory per role, the bytes on the wire per
stage, and the ``Run`` the clock (``planning.step_time``) reads; what ``ds-megatron plan`` prints and its search
ranks.
"""
from __future__ import annotations

from typing import Optional

from ..config.job import JobConfig, parse_job_config
from ..config.pipeline import pipeline_runtime, pipeline_schedule, virtual_pipeline_size
from ..errors import ConfigError
from .comm_volume import plan_comm_volume
from .hardware import CPU_KERNELS, DeviceKernels
from .memory import ZeroPlan, plan_memory
from .step_time import Run


def optimizer_of(job):
    """(optimizer type, momentum) of a job: DeepSpeed's section, or the AdamW ``ds-megatron train`` builds."""
    section = job.ds_config.get("optimizer", {"type": "AdamW"})
    opt_type = str(section.get("type", "AdamW"))
    if opt_type.lower() == "adam" and not section.get("params", {}).get("adam_w_mode", True):
        opt_type = "Adam"
    return opt_type, section.get("params", {}).get("momentum", 0.0)


def run_from_job(job, world_size: int, micro_batch: Optional[int] = None) -> Run:
    """What ``planning.step_time`` reads of a parsed job at ``world_size`` ranks."""
    layout = job.megatron.layout(world_size)
    precision, parallel, ddp = job.megatron.precision, job.megatron.parallel, job.megatron.ddp
    if not precision.owns_optimizer:
        raise ConfigError(f"megatron.optimizer_impl={precision.optimizer_impl!r}: the step time is planned for our "
                          "optimizer path; set optimizer_impl \"megatron\" to plan it")
    return Run(job.model, layout, precision.params_dtype,
               micro_batch or job.ds_config.get("train_micro_batch_size_per_gpu", 1),
               job.megatron.deepspeed_batch.micro_batches(layout.dp) or 1,
               pipeline_schedule(parallel) if layout.pp > 1 else "1f1b",
               virtual_pipeline_size(parallel, job.model.num_layers, layout.pp), parallel.pipeline_partition_method,
               parallel.pipeline_num_layers_per_stage, parallel.decoder_first_pipeline_num_layers,
               parallel.decoder_last_pipeline_num_layers, parallel.microbatch_group_size_per_vp_stage,
               ddp.use_distributed_optimizer, ddp.overlap_grad_reduce, ddp.overlap_param_gather,
               ddp.grad_dtype_is_fp32(precision.params_dtype != "fp32"), optimizer_of(job)[0], ddp.bucket_size,
               (parallel.hierarchical_context_parallel_sizes or [None])[0])


def memory_plans(job: JobConfig, world_size: int, micro_batch: Optional[int] = None, rank_lists: bool = True,
                 kernels: DeviceKernels = CPU_KERNELS):
    """``planning.memory.plan_memory`` of a parsed job (``rank_lists=False``: one plan per stage without its
    ranks, for the search, which reads only the peak); ``kernels``: the device the activations are planned for."""
    layout = job.megatron.layout(world_size)
    precision, parallel = job.megatron.precision, job.megatron.parallel
    opt_type, momentum = optimizer_of(job)
    zero = None if precision.owns_optimizer else ZeroPlan.from_section(job.ds_config.get("zero_optimization", {}))
    return plan_memory(job.model, layout, precision.params_dtype, opt_type, momentum,
                       micro_batch or job.ds_config.get("train_micro_batch_size_per_gpu", 1),
                       job.megatron.ddp.use_distributed_optimizer,
                       job.megatron.deepspeed_batch.micro_batches(layout.dp) or 1, parallel.pipeline_partition_method,
                       parallel.pipeline_num_layers_per_stage, parallel.decoder_first_pipeline_num_layers,
                       parallel.decoder_last_pipeline_num_layers,
                       schedule=pipeline_schedule(parallel) if layout.pp > 1 else "1f1b",
                       num_model_chunks=virtual_pipeline_size(parallel, job.model.num_layers, layout.pp),
                       group_size=parallel.microbatch_group_size_per_vp_stage,
                       deepspeed_engine=layout.pp > 1 and pipeline_runtime(parallel,
                                                                           precision.optimizer_impl) == "deepspeed",
                       grad_reduce_in_fp32=job.megatron.ddp.grad_dtype_is_fp32(precision.params_dtype != "fp32"),
                       hierarchical_inner=(parallel.hierarchical_context_parallel_sizes or [None])[0], zero=zero,
                       fp8_param_gather=job.megatron.ddp.fp8_param_gather, rank_lists=rank_lists,
                       kernels=kernels)


def plan_from_config(config, world_size: int, micro_batch: Optional[int] = None,
                     kernels: DeviceKernels = CPU_KERNELS):
    """(header, plans, comm) for a job config (path or dict): the memory per role and the bytes on the wire per
    stage (``comm_volume.plan_comm_volume``; a line saying why instead, where it does not apply); ``config`` may
    be a parsed ``JobConfig`` too.  ``kernels``: the device the activations are planned for (``--hardware``'s)."""
    job = config if isinstance(config, JobConfig) else parse_job_config(config)
    plans = memory_plans(job, world_size, micro_batch, kernels=kernels)
    layout = job.megatron.layout(world_size)
    precision = job.megatron.precision
    opt_type, _ = optimizer_of(job)
    mb = micro_batch or job.ds_config.get("train_micro_batch_size_per_gpu", 1)
    distributed = job.megatron.ddp.use_distributed_optimizer
    parallel = job.megatron.parallel
    micro_batches = job.megatron.deepspeed_batch.micro_batches(layout.dp) or 1
    uneven = dict(first=parallel.decoder_first_pipeline_num_layers, last=parallel.decoder_last_pipeline_num_layers)
    schedule = pipeline_schedule(parallel) if layout.pp > 1 else "1f1b"
    deepspeed_engine = layout.pp > 1 and pipeline_runtime(parallel, precision.optimizer_impl) == "deepspeed"
    vpp = virtual_pipeline_size(parallel, job.model.num_layers, layout.pp)
    zero = None if precision.owns_optimizer else ZeroPlan.from_section(job.ds_config.get("zero_optimization", {}))
    experts = f" ep={layout.ep} etp={layout.etp} edp={layout.edp}" if job.model.num_experts else ""
    chunks = f", {vpp} chunks per rank" if vpp > 1 else ""
    chunks += " on DeepSpeed's PipelineEngine" if deepspeed_engine else ""
    pipeline = (f" pp={layout.pp} ({micro_batches} micro-batches per step, schedule {schedule}{chunks})"
                if layout.pp > 1 else "")
    context = f" cp={layout.cp} (seq {job.model.seq_length // layout.cp} tokens per rank)" if layout.cp > 1 else ""
    header = (f"world size {world_size}: tp={layout.tp}{context}{pipeline} dp={layout.dp}{experts}; "
              f"params {precision.params_dtype}"
              f"{' (fp8 layers: ' + job.model.fp8_recipe + ' ' + job.model.fp8 + ')' if job.model.fp8 else ''}"
              f"{', their weights fp8 bytes (fp8_param_gather)' if job.megatron.ddp.fp8_param_gather else ''}, "
              f"optimizer {opt_type} via {precision.optimizer_impl}"
              f"{' (distributed: fp32 copies and states sharded over DP)' if distributed else ''}; micro-batch {mb}; "
              f"activations as {kernels.name} kernels keep them")
    if job.model.num_experts:
        header += "\nactivations: MoE layers are planned for balanced routing (topk tokens per token on every rank)"
    if layout.pp > 1 and (job.model.recompute_granularity == "selective" or job.model.mlp_sequence_tiles > 1):
        # tests/pipeline/test_schedule_memory.py's model with selective core_attn + mlp: 0.89-0.90 of the measured
        # peak on the last stage and with 2 chunks.  The cause: PipelineSchedule.run keeps every tensor it sends
        # (outputs, input gradients) until it waits on the sends at the end of the step, and the plan lets an output
        # go at its backward (planning them to the step's end puts the published runs over their memory: the
        # runtime should free a send once it completes); without recomputation the plan's count of the core's
        # re-layout (a view of its output on fused kernels at any micro-batch) is 1 [s, b, h] a layer too high,
        # which hides it.
        header += ("\nactivations: selective recomputation / MLP tiles with pipeline parallelism were measured up to "
                   "12% above this plan (last stage, chunks): leave that headroom")
    if zero is not None:
        header += f"\n{zero_note(zero, precision.params_dtype)}"
    if not precision.owns_optimizer:
        comm = "bytes on the wire: not planned on DeepSpeed's optimizer path (DeepSpeed reduces the gradients)"
    else:
        try:
            comm = plan_comm_volume(job.model, layout, precision.params_dtype, mb, micro_batches, distributed,
                                    parallel.pipeline_partition_method, parallel.pipeline_num_layers_per_stage,
                                    **uneven, num_model_chunks=vpp, deepspeed_engine=deepspeed_engine,
                                    hierarchical_inner=(parallel.hierarchical_context_parallel_sizes or [None])[0],
                                    fp8_param_gather=job.megatron.ddp.fp8_param_gather)
        except ConfigError as e:
            comm = f"bytes on the wire: not planned ({e})"
    if job.model.num_experts and not isinstance(comm, str):
        header += ("\nbytes on the wire: MoE layers are planned for balanced routing (each rank's experts receive "
                   "topk copies of as many tokens as the rank routes)")
    return header, plans, comm


def zero_note(zero: ZeroPlan, params_dtype: str) -> str:
    """What the plan's columns hold on DeepSpeed's optimizer path, in one line."""
    if zero.stage == 0:
        kept = "fp32 copies of 16-bit params and grads, " if params_dtype != "fp32" else ""
        return f"DeepSpeed's optimizer without ZeRO: {kept}optimizer states of every param"
    bucket = zero.bucket_elements()
    sharded = {1: "", 2: "grads, ", 3: "params, grads, "}[zero.stage]
    line = (f"ZeRO stage {zero.stage}: {sharded}fp32 copies and optimizer states sharded over DP (experts over "
            f"EDP); grads include the reduction bucket{'s' if bucket > zero.reduce_bucket_size else ''} "
            f"(zero_optimization.reduce_bucket_size={zero.reduce_bucket_size:,} elements)")
    if zero.stage == 3:
        line += ("; parameters under stage3_param_persistence_threshold stay whole on every rank (not counted)")
    return line
