"""``MegatronConfig``: the whole ``"megatron"`` section as one typed tree, parsed once (pure, no torch).

What users write (Megatron-LM's names, next to DeepSpeed's own keys) and where it lands:

| JSON | tree |
| --- | --- |
| ``tensor_model_parallel_size`` ... ``order``, ``sequence_parallel``, ``make_vocab_size_divisible_by``, ``pipeline_*`` | ``parallel`` (``ParallelConfig``; pipeline rules in ``config.pipeline``) |
| ``use_distributed_optimizer``, ``overlap_grad_reduce``, ``bucket_size``, ... | ``ddp`` (``DistributedDataParallelConfig``) |
| ``optimizer_impl``, ``log_num_zeros_in_grad`` + DeepSpeed's ``fp16`` / ``bf16`` / ``gradient_clipping`` | ``precision`` (``PrecisionConfig``) |
| ``cuda_graph: {...}`` | ``cuda_graph`` (``CudaGraphConfig``) |
| ``model`` / ``train`` / ``data: {...}`` | ``model`` (``GPTConfig`` or None), ``train``, ``data`` |

Who reduces gradients is decided here, once: on the Megatron optimizer path
(``optimizer_impl: "megatron"``, the default of any section) Megatron's
gradient buffers do, always; with ``"deepspeed"`` DeepSpeed owns everything
and the buffer keys are refused.  No ``"megatron"`` section at all means a
plain DeepSpeed job (``optimizer_impl "deepspeed"``, every rank data parallel).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from ..errors import ConfigError
from ..parallel.layout import ParallelLayout
from .cuda_graph import CudaGraphConfig
from .deepspeed_keys import check_deepspeed_keys
from .ddp import DistributedDataParallelConfig
from .model import GPTConfig
from .parallel import ParallelConfig
from .parsing import SECTION, coerce, deepspeed_section, field_names, load_ds_config, parse_section, unknown_key
from .pipeline import DeepSpeedBatchKeys, check_pipeline, pipeline_runtime, pipeline_schedule
from .precision import PrecisionConfig, resolve_precision
from .training import DataConfig, TrainConfig

# Keys of the section that pick the optimizer path (the rest of the flat keys are parallel or ddp).
_PATH_KEYS = {"optimizer_impl": str, "log_num_zeros_in_grad": bool, "use_megatron_ddp": Optional[bool]}
_NESTED = {"cuda_graph": CudaGraphConfig, "model": GPTConfig, "train": TrainConfig, "data": DataConfig}
# Model fields set for the whole layout at the top of the section; the model inherits them.
INHERITED_MODEL_KEYS = ("sequence_parallel", "make_vocab_size_divisible_by")


def _flat_key_owners() -> Dict[str, str]:
    """Each key at the top of the section and the part of the tree it is read into."""
    return {**{k: "parallel" for k in field_names(ParallelConfig)},
            **{k: "ddp" for k in field_names(DistributedDataParallelConfig)},
            **{k: "path" for k in _PATH_KEYS}}


def section_keys() -> List[str]:
    """Every key the top of the section accepts: the flat keys, then the nested sections."""
    return [*_flat_key_owners(), *_NESTED]


@dataclass
class MegatronConfig:
    """The parsed ``"megatron"`` section (see the module docstring)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ddp: DistributedDataParallelConfig = field(default_factory=DistributedDataParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    model: Optional[GPTConfig] = None  # None: the user builds the model
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # DeepSpeed's batch / ZeRO / pipeline keys, which the pipeline rules depend on.
    deepspeed_batch: DeepSpeedBatchKeys = field(default_factory=DeepSpeedBatchKeys)
    # DeepSpeed keys without effect on our path, or unknown to DeepSpeed: logged once at initialize.
    notices: List[str] = field(default_factory=list)
    # The megatron.train keys the section sets explicitly (ds-megatron train's one rule for the LR).
    train_keys_set: Tuple[str, ...] = ()
    # False: the config has no "megatron" section, a plain DeepSpeed job (ds_megatron.initialize then behaves
    # like deepspeed.initialize; a DeepSpeed PipelineModule brings its own layout).
    section_given: bool = True

    @property
    def optimizer_impl(self) -> str:
        return self.precision.optimizer_impl

    @property
    def gradient_reducer(self) -> str:
        """Who averages gradients over data parallel: "megatron_ddp" (our buffers) or "deepspeed"."""
        return "megatron_ddp" if self.precision.owns_optimizer else "deepspeed"

    def layout(self, world_size: int) -> ParallelLayout:
        """The ``ParallelLayout`` for ``world_size`` ranks, checked against the model section when there is one."""
        layout = self.parallel.layout(world_size)
        if self.model is not None:
            self.model.check_layout(layout)
        check_pipeline(self.parallel, self.model, self.deepspeed_batch, layout, self.optimizer_impl,
                       plain_deepspeed=not self.section_given)
        _check_hierarchical_cp(self.parallel, self.model, layout)
        _check_fp8_layout(self.model, layout, self.data)
        schedule = pipeline_schedule(self.parallel)
        if layout.pp > 1 and schedule == "zero_bubble" and self.cuda_graph.enabled:
            # A captured layer's backward computes its weight gradients inside the graph: W cannot be deferred.
            raise ConfigError(f"{SECTION}.cuda_graph with pipeline_schedule \"zero_bubble\": a captured layer's "
                              "backward computes its weight gradients inside the graph, so ZB-H1 cannot defer them; "
                              "turn cuda_graph off or use \"1f1b\" / \"interleaved_1f1b\"")
        if layout.pp > 1 and self.data.packed_sequences and pipeline_runtime(self.parallel,
                                                                              self.optimizer_impl) == "deepspeed":
            raise ConfigError(f"{SECTION}.data packs several documents per row, but with {SECTION}.optimizer_impl "
                              f"\"{self.optimizer_impl}\" and pipeline_schedule \"1f1b\" DeepSpeed's PipelineEngine runs "
                              "the stages, and it passes tokens and labels only; use optimizer_impl \"megatron\" (our "
                              "pipeline runtime carries the documents)")
        return layout

    @classmethod
    def from_section(cls, section: Optional[Dict[str, Any]], ds_config: Dict[str, Any]) -> "MegatronConfig":
        """Parse the section (None: no section, a plain DeepSpeed job) against the rest of the DeepSpeed config."""
        if section is None:
            return cls(precision=resolve_precision(ds_config, "deepspeed"), train=TrainConfig(ckpt_format="deepspeed"),
                       deepspeed_batch=DeepSpeedBatchKeys.from_ds_config(ds_config), section_given=False)
        if not isinstance(section, dict):
            raise ConfigError(f"{SECTION} must be a JSON object, got {type(section).__name__}")
        flat = {"parallel": {}, "ddp": {}, "path": {}}
        owners = _flat_key_owners()
        for key, value in section.items():
            if key in _NESTED:
                continue
            if key not in owners:
                home = next((name for name, tp in _NESTED.items() if key in field_names(tp)), None)
                if home is not None:  # e.g. num_layers written next to the layout instead of under "model"
                    raise ConfigError(f"unknown key {SECTION}.{key}; it is a key of {SECTION}.{home}: move it there")
                raise unknown_key(SECTION, key, section_keys())
            flat[owners[key]][key] = value
        parallel = parse_section(ParallelConfig, flat["parallel"], SECTION)
        ddp = parse_section(DistributedDataParallelConfig, flat["ddp"], SECTION)
        path = {k: coerce(f"{SECTION}.{k}", v, _PATH_KEYS[k]) for k, v in flat["path"].items()}
        precision = resolve_precision(ds_config, path.get("optimizer_impl", "megatron"),
                                      path.get("log_num_zeros_in_grad", False))
        _check_gradient_reducer(ds_config, precision, sorted(flat["ddp"]), path.get("use_megatron_ddp"))
        notices = check_deepspeed_keys(ds_config) if precision.owns_optimizer else []
        nested = {name: parse_section(tp, section.get(name, {}), f"{SECTION}.{name}")
                  for name, tp in _NESTED.items() if name != "model"}
        model = None
        if "model" in section:
            model_section = section["model"]
            if not isinstance(model_section, dict):
                raise ConfigError(f"{SECTION}.model must be a JSON object, got {type(model_section).__name__}")
            model_section = dict(model_section)
            for key in INHERITED_MODEL_KEYS:
                if key in model_section:
                    raise ConfigError(f"{SECTION}.model.{key} is set at {SECTION}.{key}; move it there")
                model_section[key] = getattr(parallel, key)
            model = parse_section(GPTConfig, model_section, f"{SECTION}.model")
        nested["cuda_graph"].check_moe_settings(model)
        if nested["cuda_graph"].enabled and nested["data"].packed_sequences:
            raise ConfigError(f"{SECTION}.cuda_graph.impl={nested['cuda_graph'].impl!r} but {SECTION}.data packs "
                              "several documents per row, whose attention runs one kernel per document with boundaries "
                              "read on the host, which a captured graph cannot replay; set cuda_graph.impl \"none\"")
        _check_expert_bias(model, precision, nested["cuda_graph"])
        _check_fp8(model, precision, ddp)
        if not precision.owns_optimizer:
            notice = check_deepspeed_optimizer(
                precision, deepspeed_section(ds_config, "zero_optimization").get("stage", 0),
                parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                bool(model is not None and model.num_experts) or parallel.expert_model_parallel_size > 1)
            notices += [notice] if notice else []
        _check_ckpt_format(nested["train"], precision)
        _check_fp8_param_gather(ddp, nested["train"])
        train_keys = tuple(section.get("train", {})) if isinstance(section.get("train"), dict) else ()
        return cls(parallel=parallel, ddp=ddp, precision=precision, model=model, notices=notices,
                   train_keys_set=train_keys, deepspeed_batch=DeepSpeedBatchKeys.from_ds_config(ds_config), **nested)


def _check_gradient_reducer(ds_config: Dict[str, Any], precision: PrecisionConfig, ddp_keys, use_megatron_ddp) -> None:
    """One reducer per path: Megatron's buffers on ours, DeepSpeed's all-reduce (and nothing else) on DeepSpeed's."""
    if precision.owns_optimizer:
        if use_megatron_ddp is False:
            why = f" but {SECTION}.{ddp_keys[0]} is set" if ddp_keys else ""
            raise ConfigError(f"{SECTION}.use_megatron_ddp is false{why}; on the megatron optimizer path Megatron's "
                              "gradient buffers are what reduces gradients: drop the key, or set "
                              f"{SECTION}.optimizer_impl \"deepspeed\" to let DeepSpeed reduce them")
        return
    if "use_distributed_optimizer" in ddp_keys:
        raise ConfigError(f"{SECTION}.use_distributed_optimizer is true with {SECTION}.optimizer_impl="
                          f"{precision.optimizer_impl!r}; only ds_megatron's optimizer path reads the sharded grads: "
                          "set optimizer_impl to \"megatron\", or use DeepSpeed's ZeRO stage 1 instead")
    if not ddp_keys and not use_megatron_ddp:
        return
    key = "use_megatron_ddp" if use_megatron_ddp else ddp_keys[0]
    stage = deepspeed_section(ds_config, "zero_optimization").get("stage", 0)
    if stage:
        raise ConfigError(f"{SECTION}.use_megatron_ddp is on but zero_optimization.stage is {stage}; ZeRO reduces "
                          "and partitions gradients itself: set the stage to 0 (use "
                          f"{SECTION}.use_distributed_optimizer to shard optimizer state) or turn use_megatron_ddp off")
    if precision.params_dtype != "fp32":
        raise ConfigError(f"{SECTION}.use_megatron_ddp is on together with DeepSpeed's own {precision.params_dtype} "
                          "optimizer (optimizer_impl \"deepspeed\"), which keeps separate gradient copies; use "
                          f"{SECTION}.optimizer_impl \"megatron\" (it reads param.main_grad) or turn use_megatron_ddp off")
    raise ConfigError(f"{SECTION}.{key} configures Megatron's gradient buffers, which reduce gradients on the megatron "
                      f"optimizer path only; with {SECTION}.optimizer_impl \"deepspeed\" DeepSpeed reduces them: drop "
                      f"the key, or set optimizer_impl \"megatron\"")


def _check_hierarchical_cp(parallel, model: Optional[GPTConfig], layout) -> None:
    """``cp_comm_type "a2a+p2p"`` and ``hierarchical_context_parallel_sizes`` come together."""
    sizes = parallel.hierarchical_context_parallel_sizes
    comm = model.cp_comm_type if model is not None else None
    if sizes is not None and model is not None and comm != "a2a+p2p":
        raise ConfigError(f"{SECTION}.hierarchical_context_parallel_sizes={sizes} is set but model.cp_comm_type is "
                          f"{comm!r}; set cp_comm_type \"a2a+p2p\" or drop the sizes")
    if comm == "a2a+p2p" and layout.cp > 1:
        if sizes is None:
            raise ConfigError(f"model.cp_comm_type \"a2a+p2p\" needs {SECTION}.hierarchical_context_parallel_sizes "
                              f"[a2a, p2p] (product context_parallel_size={layout.cp}); set them")
        heads = model.num_attention_heads // layout.tp
        if heads % sizes[0]:
            raise ConfigError(f"{SECTION}.hierarchical_context_parallel_sizes={sizes}: the all-to-all splits each TP "
                              f"rank's {heads} attention heads over {sizes[0]} ranks, which must divide them")


def _check_expert_bias(model: Optional[GPTConfig], precision: PrecisionConfig, cuda_graph: CudaGraphConfig) -> None:
    """The expert bias moves in our ``finalize_model_grads``: refuse the paths that would not move it."""
    if model is None or not model.num_experts or not model.moe_router_enable_expert_bias:
        return
    what = f"{SECTION}.model.moe_router_enable_expert_bias"
    if not precision.owns_optimizer:
        raise ConfigError(f"{what} with {SECTION}.optimizer_impl={precision.optimizer_impl!r}: the bias is updated "
                          "once per step by ds_megatron's optimizer (finalize_model_grads), which that path does not "
                          "run; set optimizer_impl \"megatron\" or turn the expert bias off")
    if cuda_graph.enabled:
        raise ConfigError(f"{what} with {SECTION}.cuda_graph: the token counts the bias update reads are not "
                          "checked under graph replay; turn cuda_graph off or the expert bias off")


def _check_fp8(model: Optional[GPTConfig], precision: PrecisionConfig, ddp: DistributedDataParallelConfig) -> None:
    """FP8 GEMMs need bf16 training, and part of Megatron's fp8 compositions is not built yet: refused here.
    ``fp8_param_gather`` needs fp8 and casts weights by the tensorwise recipe.  CUDA graphs compose with every
    recipe (``fp8.recipe``) and with ``fp8_param_gather`` (``cuda_graphs.capture``)."""
    if ddp.fp8_param_gather and model is not None and model.fp8 is None:
        raise ConfigError(f"{SECTION}.fp8_param_gather is true but {SECTION}.model.fp8 is null; there are no fp8 "
                          "weights to gather: set model.fp8 or drop fp8_param_gather")
    if model is None or model.fp8 is None:
        return
    if ddp.fp8_param_gather and model.fp8_recipe != "tensorwise":
        raise ConfigError(f"{SECTION}.fp8_param_gather with model.fp8_recipe={model.fp8_recipe!r}: the weights are "
                          "cast with one scale per weight (\"tensorwise\") only; set fp8_recipe \"tensorwise\" or "
                          "drop fp8_param_gather")
    what = f"{SECTION}.model.fp8={model.fp8!r}"
    if precision.params_dtype != "bf16":
        raise ConfigError(f"{what} needs bf16 training (fp8 GEMMs on bf16 params with fp32 main params); set "
                          "bf16.enabled true")


def _check_fp8_layout(model: Optional[GPTConfig], layout, data) -> None:
    """FP8 scales as the one-rank run does only where each scale's tokens are the one-rank run's: an expert's tokens
    of a micro-batch must all reach its ranks (the TP x CP ranks within one EP x ETP group); blockwise weight
    gradients tile the tokens by 128, so under CP each zigzag chunk must hold whole tiles."""
    if model is None or model.fp8 is None:
        return
    if not model.multi_latent_attention and model.query_groups < layout.tp:
        # Fewer KV groups than TP ranks: each rank holds a copy of one group's KV projection, run apart from its
        # query heads' (ReplicatedKV), where the one-rank model quantizes one fused QKV weight with one scale.
        raise ConfigError(f"{SECTION}.model.fp8={model.fp8!r} with num_query_groups={model.query_groups} below "
                          f"tensor_model_parallel_size={layout.tp}: the replicated KV projection has no fp8 GEMM; "
                          "use a tensor_model_parallel_size that divides num_query_groups, or fp8 null")
    groups = layout.group_ranks()
    expert_groups = [set(g) for g in groups["etp-ep"]]
    if model.num_experts and not all(any(set(g) <= e for e in expert_groups) for g in groups["tp-cp"]):
        raise ConfigError(f"{SECTION}.model.fp8={model.fp8!r} with num_experts: the tensor x context-parallel ranks "
                          f"(tp={layout.tp}, cp={layout.cp}) are not within one expert-parallel group (ep={layout.ep}, "
                          f"etp={layout.etp}), so an expert's tokens of one micro-batch would be scaled in parts; make "
                          "expert_model_parallel_size x expert_tensor_parallel_size a multiple of tp x cp")
    if model.fp8_recipe == "blockwise" and layout.cp > 1:
        if model.seq_length % (256 * layout.cp):
            raise ConfigError(f"model.seq_length={model.seq_length} with fp8_recipe \"blockwise\" and "
                              f"context_parallel_size={layout.cp}: each of a rank's two sequence chunks must hold "
                              f"whole 128-token tiles; choose a multiple of {256 * layout.cp} or fp8_recipe "
                              "\"tensorwise\"")
        if model.num_experts:
            raise ConfigError(f"{SECTION}.model.num_experts with fp8_recipe \"blockwise\" and context_parallel_size="
                              f"{layout.cp}: an expert receives the ranks' zigzag chunks in rank order, not the "
                              "sequence's, so its 128-token tiles would not be the one-rank run's; use fp8_recipe "
                              "\"tensorwise\"")
        if data.packed_sequences:
            raise ConfigError(f"{SECTION}.data packs documents, which context parallelism splits document by document, "
                              "so fp8_recipe \"blockwise\"'s 128-token tiles would not be the one-rank run's; use "
                              "fp8_recipe \"tensorwise\" or unpacked rows")


def check_deepspeed_optimizer(precision: PrecisionConfig, zero_stage, tp: int, pp: int,
                              has_experts: bool) -> Optional[str]:
    """What DeepSpeed's own optimizers (``optimizer_impl "deepspeed"``) get wrong with Megatron's layouts: refused,
    or, where only a reported figure is wrong, the notice to log (else None).

    * fp16 / bf16 without ZeRO: DeepSpeed wraps the optimizer in its 16-bit optimizer without ZeRO
      (``FP16_UnfusedOptimizer`` for any optimizer but its ``FusedAdam``: bf16 always on a CPU, and the job's
      torch AdamW on a GPU; with a ``PipelineModule`` bf16 gets its ``BF16_Optimizer`` instead).  It takes the
      gradient norm, which clipping divides by and the job reports, through ``get_weight_norm`` handed the
      gradients rather than the parameters: their tensor-parallel marks are missing, so every TP rank but the
      first counts nothing (measured at TP 2: 3.14 where the norm is 3.26), and expert gradients are left out.
      With ``gradient_clipping`` 0 the training is right (the step it takes at construction is undone by
      ``ds_megatron.initialize``) and only the reported norm is off.
    * ZeRO 3 with MoE experts: DeepSpeed supports MoE at ZeRO stages 1 and 2 only (stage 3 would partition each
      expert over the dense data-parallel group, whose ranks hold other experts).
    """
    if zero_stage == 3 and has_experts:
        raise ConfigError(f"zero_optimization.stage=3 with MoE experts on {SECTION}.optimizer_impl \"deepspeed\": "
                          "DeepSpeed's ZeRO supports MoE at stages 1 and 2 only; set the stage to 1 or 2, or "
                          f"optimizer_impl \"megatron\" with {SECTION}.use_distributed_optimizer")
    sixteen_bit = precision.params_dtype == "fp16" or (precision.params_dtype == "bf16" and pp == 1)
    if zero_stage not in (0, False, None) or not sixteen_bit or not (tp > 1 or has_experts):
        return None
    split = f"{SECTION}.tensor_model_parallel_size={tp}" if tp > 1 else "MoE experts"
    what = (f"{precision.params_dtype}.enabled with zero_optimization.stage 0 and {split} on {SECTION}.optimizer_impl "
            "\"deepspeed\": DeepSpeed's 16-bit optimizer without ZeRO takes the gradient norm")
    if precision.clip_grad > 0:
        raise ConfigError(f"{what} that gradient_clipping={precision.clip_grad:g} divides by from tensor-parallel "
                          "rank 0 alone and leaves the experts out; set zero_optimization.stage to 1, "
                          "gradient_clipping to 0, or optimizer_impl \"megatron\"")
    return f"{what} it reports from tensor-parallel rank 0 alone, without the experts (clipping is off: training is " \
           "not affected)"


def _check_ckpt_format(train: TrainConfig, precision: PrecisionConfig) -> None:
    """The layout-independent checkpoint reads our optimizers' state: the default where they are."""
    if train.ckpt_format is None:
        train.ckpt_format = "torch_dist" if precision.owns_optimizer else "deepspeed"
        return
    if train.ckpt_format == "torch_dist" and not precision.owns_optimizer:
        raise ConfigError(f"{SECTION}.train.ckpt_format \"torch_dist\" with {SECTION}.optimizer_impl="
                          f"{precision.optimizer_impl!r}: the layout-independent checkpoint saves ds_megatron's "
                          "optimizers; set optimizer_impl \"megatron\" or ckpt_format \"deepspeed\"")


def _check_fp8_param_gather(ddp: DistributedDataParallelConfig, train: TrainConfig) -> None:
    """The fp8 weights are bytes and a scale: what writes the model's weights as they are is refused with them (the
    ``torch_dist`` checkpoint writes their 16-bit values, rounded from the fp32 main params)."""
    if not ddp.fp8_param_gather:
        return
    what = f"{SECTION}.fp8_param_gather"
    if train.ckpt_format == "deepspeed":
        raise ConfigError(f"{what} with {SECTION}.train.ckpt_format \"deepspeed\": that format writes the weights' "
                          "fp8 bytes as the model's; use ckpt_format \"torch_dist\" or drop fp8_param_gather")
    for key in ("load_hf", "export_hf_family"):
        if getattr(train, key) is not None:
            raise ConfigError(f"{what} with {SECTION}.train.{key}: the Hugging Face export written at each save "
                              "reads the weights' fp8 bytes; drop one of them")


def split_config(config: Union[str, os.PathLike, Dict[str, Any]]) -> Tuple[Dict[str, Any], MegatronConfig]:
    """(the DeepSpeed config without our section, our parsed section): every rule checked, nothing created."""
    ds_config = load_ds_config(config)
    return ds_config, MegatronConfig.from_section(ds_config.pop(SECTION, None), ds_config)


__all__ = ["MegatronConfig", "check_deepspeed_optimizer", "split_config"]

