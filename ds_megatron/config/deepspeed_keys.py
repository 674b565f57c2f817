"""Every top-level key of DeepSpeed's config, and what the Megatron optimizer path does with it (pure, no torch).

On ``optimizer_impl: "megatron"`` our gradient buffers reduce, our optimizer wrapper does
mixed precision and clipping, and DeepSpeed runs the rest of its engine.  A DeepSpeed key is
then in one of four states, and none is silently dropped:

* ``HONOURED``: DeepSpeed's engine applies it as usual, or our path does (each entry says who);
* ``REFUSED``: a setting our path would not apply although the user asked for it (DeepSpeed's own
  reduction knobs, features that replace the optimizer or change the model's inputs): a
  ``ConfigError`` naming the key and the fix, at config time, unless it has its "off" value;
* ``UNUSED``: harmless but without effect here (ZeRO-only tuning, Ulysses-only settings): one
  notice line at ``initialize``;
* any other key: DeepSpeed itself does not know it and ignores it (a typo?): a notice line too.

``check_deepspeed_keys`` applies the table; ``MegatronConfig`` keeps the notices, which
``ds_megatron.initialize`` logs once on rank 0.  Keys that ``resolve_precision`` already checks
(``fp16``, ``bf16``, ``zero_optimization.stage``, ``amp``, ``torch_autocast``,
``data_types.grad_accum_dtype``) are listed as honoured here.  Written against DeepSpeed 0.19.8
(``runtime/config.py`` ``_initialize_params``, ``runtime/constants.py``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

from ..errors import ConfigError
from .parsing import SECTION

_FIX_IMPL = f'or set "{SECTION}": {{"optimizer_impl": "deepspeed"}} to use DeepSpeed\'s own engine path'

HONOURED: Dict[str, str] = {
    "train_batch_size": "DeepSpeed: batch sizes (ds-megatron train derives it instead)",
    "train_micro_batch_size_per_gpu": "DeepSpeed: batch sizes",
    "gradient_accumulation_steps": "DeepSpeed: engine.backward divides the loss by it; our buffers reduce on the "
                                   "last micro-batch",
    "steps_per_print": "DeepSpeed: its progress log",
    "wall_clock_breakdown": "DeepSpeed: timers",
    "memory_breakdown": "DeepSpeed: memory log",
    "dump_state": "DeepSpeed: config dump",
    "timers": "DeepSpeed: timers",
    "log_level": "DeepSpeed: its logger",
    "disable_python_gc": "DeepSpeed: gc control",
    "comms_logger": "DeepSpeed: communication log",
    "flops_profiler": "DeepSpeed: FLOPs profiler",
    "tensorboard": "DeepSpeed's monitor; the engine writes lr (and fp16's loss scale), ds-megatron train the rest",
    "wandb": "DeepSpeed's monitor (as tensorboard)",
    "comet": "DeepSpeed's monitor (as tensorboard)",
    "csv_monitor": "DeepSpeed's monitor (as tensorboard)",
    "fp16": "ours: Megatron's fp16 with fp32 main params and the loss scaler; engine.fp16_enabled() / loss_scale() "
            "report it",
    "bf16": "ours: Megatron's bf16 with fp32 main params; engine.bfloat16_enabled() reports it",
    "bfloat16": "ours (DeepSpeed's older name of bf16)",
    "gradient_clipping": "ours: clipping by the true global norm; engine.gradient_clipping() reports it",
    "optimizer": "ours: the torch optimizer is built from it and wrapped (megatron.train's optimizer fields must be "
                 "unset in ds-megatron train)",
    "scheduler": "DeepSpeed: built over our optimizer (megatron.train's schedule fields must be unset in "
                 "ds-megatron train)",
    "zero_optimization": "stage 0 only (megatron.use_distributed_optimizer shards like ZeRO-1)",
    "amp": "refused when enabled (resolve_precision)",
    "torch_autocast": "refused when enabled (resolve_precision)",
    "data_types": "grad_accum_dtype: fp32 only; buffer_dtype: DeepSpeed casts buffers",
    "checkpoint": "DeepSpeed: tag_validation, use_node_local_storage, parallel_write",
    "dataloader_drop_last": "DeepSpeed: the loader made from training_data=",
    "use_data_before_expert_parallelism": "DeepSpeed: the expert-group order of deepspeed.moe layers",
    "elasticity": "DeepSpeed: elastic batch sizes",
    "activation_checkpointing": "DeepSpeed's deepspeed.checkpointing, for a model that calls it after "
                                "deepspeed.checkpointing.configure; ds-megatron train maps it to "
                                "megatron.model.recompute_granularity",
    "compile": "DeepSpeed: engine.compile()",
    "sparse_attention": "DeepSpeed: read by the sparse-attention modules a model builds",
    "compression_training": "DeepSpeed: read by deepspeed.compression.init_compression, which the user calls",
    "nebula": "DeepSpeed: checkpoint engine",
    "weight_quantization": "DeepSpeed: inference-time weight quantization",
    "pipeline": "DeepSpeed's PipelineEngine, with megatron.pipeline_model_parallel_size > 1 (pipe_partitioned and "
                "grad_partitioned default to false there; partitioning with sequence_parallel is refused)",
}

# key -> (is the value "off"?, what to do instead); refused unless off.
REFUSED: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "prescale_gradients": (lambda v: v is False, f"our buffers scale by 1/DP before reducing (or, with "
                           f"{SECTION}.average_in_collective, average in the collective): remove it"),
    "gradient_predivide_factor": (lambda v: v == 1.0, "our buffers scale by 1/DP before reducing: remove it"),
    "gradient_allreduce_op": (lambda v: v in (None, "mean"), "our buffers average over data parallel: remove it"),
    "communication_data_type": (lambda v: v is None, f"use {SECTION}.grad_reduce_in_fp32 (true: reduce in fp32, "
                                f"false: in the params' dtype)"),
    "sparse_gradients": (lambda v: v is False, "our buffers reduce dense gradients: remove it"),
    "managed_gradient_accumulation": (lambda v: v is True, "our buffers reduce at DeepSpeed's accumulation "
                                      "boundary: remove it"),
    "graph_harvesting": (lambda v: v is False, f"use {SECTION}.cuda_graph"),
    "curriculum_learning": (lambda v: not _enabled(v), "it feeds the model a curriculum_seqlen argument"),
    "progressive_layer_drop": (lambda v: not _enabled(v), "it feeds the model progressive_layer_drop arguments"),
    "eigenvalue": (lambda v: not _enabled(v), "it reads DeepSpeed's own gradients"),
    "quantize_training": (lambda v: not _enabled(v), "it quantizes in DeepSpeed's fp16 optimizer"),
    "hybrid_engine": (lambda v: not _enabled(v), "it replaces the engine"),
    "data_efficiency": (lambda v: not _enabled(v), "random-LTD and its data sampling are not wired to our path"),
    "autotuning": (lambda v: not _enabled(v), "it rewrites ZeRO stage and batch sizes"),
    "tensor_parallel": (lambda v: isinstance(v, dict) and v.get("autotp_size", 0) in (0, 1),
                        f"use {SECTION}.tensor_model_parallel_size with ds_megatron.tensor_parallel layers"),
    "expert_parallel": (lambda v: not _enabled(v), f"use {SECTION}.expert_model_parallel_size with MoE layers"),
}

UNUSED: Dict[str, str] = {
    "zero_allow_untested_optimizer": "ZeRO only (stage 0 here)",
    "zero_force_ds_cpu_optimizer": "ZeRO-Offload only",
    "aio": "ZeRO-Infinity swapping only",
    "disable_allgather": "ZeRO only",
    "seq_parallel_communication_data_type": "DeepSpeed-Ulysses only (megatron.sequence_parallel is inside TP)",
}

# zero_optimization keys that mean something at stage 0 (the rest tune ZeRO's partitioning).
_ZERO_STAGE0_KEYS = {"stage"}
_ZERO_FIXES = {"reduce_bucket_size": f"use {SECTION}.bucket_size", "overlap_comm": f"use {SECTION}.overlap_grad_reduce",
               "allgather_bucket_size": f"use {SECTION}.bucket_size"}


def _enabled(value: Any) -> bool:
    return bool(value.get("enabled", False)) if isinstance(value, dict) else bool(value)


def check_deepspeed_keys(ds_config: Dict[str, Any]) -> List[str]:
    """For the Megatron optimizer path: ConfigError on a refused key, the notice lines of the rest."""
    notices = []
    for key, value in ds_config.items():
        if key in REFUSED:
            is_off, fix = REFUSED[key]
            if not is_off(value):
                raise ConfigError(f"{key}={value!r} is a DeepSpeed setting that {SECTION}.optimizer_impl "
                                  f"\"megatron\" does not apply ({fix}); remove it, {_FIX_IMPL}")
        elif key in UNUSED:
            notices.append(f"{key} has no effect on {SECTION}.optimizer_impl \"megatron\": {UNUSED[key]}")
        elif key not in HONOURED:
            notices.append(f"{key} is not a DeepSpeed 0.19 config key; DeepSpeed ignores it (a typo?)")
    zero = ds_config.get("zero_optimization", {})
    for key in (zero if isinstance(zero, dict) else {}):
        if key in _ZERO_FIXES:
            raise ConfigError(f"zero_optimization.{key} tunes DeepSpeed's own reduction, which {SECTION}.optimizer_impl "
                              f"\"megatron\" replaces; {_ZERO_FIXES[key]}, {_FIX_IMPL}")
        if key not in _ZERO_STAGE0_KEYS:
            notices.append(f"zero_optimization.{key} has no effect at stage 0 (ZeRO is off on {SECTION}.optimizer_impl "
                           "\"megatron\")")
    checkpoint = ds_config.get("checkpoint", {})
    if isinstance(checkpoint, dict) and checkpoint.get("load_universal", False):
        raise ConfigError(f"checkpoint.load_universal is true, but universal checkpoints hold ZeRO optimizer states, "
                          f"which {SECTION}.optimizer_impl \"megatron\" does not write or read; remove it, {_FIX_IMPL}")
    data_types = ds_config.get("data_types", {})
    if isinstance(data_types, dict) and data_types.get("param_dtype") is not None:
        raise ConfigError(f"data_types.param_dtype={data_types['param_dtype']!r}: on {SECTION}.optimizer_impl "
                          "\"megatron\" the params' dtype comes from fp16.enabled / bf16.enabled; remove it")
    return notices


__all__ = ["HONOURED", "REFUSED", "UNUSED", "check_deepspeed_keys"]
