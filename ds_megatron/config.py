"""The ``"megatron"`` section of a DeepSpeed JSON config, parsed and validated.

Everything here is pure Python (no torch, no DeepSpeed) so that a bad config
fails in well under a second, before any process group is created.  Each
section is a dataclass; ``parse_section`` checks unknown keys and types and
names the offending field (``megatron.tensor_model_parallel_size``) in one
sentence with the fix.
"""
from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from .parallel.rank_generator import DEFAULT_ORDER

SECTION = "megatron"


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and the fix."""


# CUDA graphs (ds_megatron/cuda_graphs)
CUDA_GRAPH_IMPLS = ("transformer_engine", "local", "none")
CUDA_GRAPH_SCOPES = ("attn", "moe_router", "moe_preprocess")


@dataclass
class CudaGraphConfig:
    """``megatron.cuda_graph``: Megatron-LM's ``cuda_graph_impl`` / ``cuda_graph_scope`` / warm-up.

    ``impl``: "transformer_engine" (TE's ``make_graphed_callables``, per-layer
    partial capture; falls back to ``torch.cuda.make_graphed_callables`` when TE
    is missing), "local" (whole layers through torch's API), "none".
    ``scope``: the parts of each layer to capture; empty means the whole layer.
    "attn" is the input LayerNorm + attention + residual; "moe_router" adds the
    pre-MLP LayerNorm and the router of MoE layers; "moe_preprocess" also the
    dispatcher's preprocess (permutation, split sizes).  Dispatch, experts and
    combine always run eagerly under a partial scope.
    ``warmup_steps``: eager steps before capture (at least 1: the forward
    pre-hooks that replay would skip are collected after the first one).
    ``required``: fail at start instead of training eagerly when graphs cannot be used.
    """

    impl: str = "none"
    scope: List[str] = field(default_factory=list)
    warmup_steps: int = 3
    required: bool = False

    def __post_init__(self):
        where = f"{SECTION}.cuda_graph"
        if self.impl not in CUDA_GRAPH_IMPLS:
            raise ConfigError(f"{where}.impl={self.impl!r} is unknown; use one of {', '.join(map(repr, CUDA_GRAPH_IMPLS))}")
        for i, s in enumerate(self.scope):
            if s not in CUDA_GRAPH_SCOPES:
                raise ConfigError(f"{where}.scope[{i}]={s!r} is unknown; use any of "
                                  f"{', '.join(map(repr, CUDA_GRAPH_SCOPES))} (an empty list captures whole layers)")
        if len(set(self.scope)) != len(self.scope):
            raise ConfigError(f"{where}.scope={self.scope!r} lists an entry twice; list each part once")
        if "moe_preprocess" in self.scope and "moe_router" not in self.scope:
            raise ConfigError(f"{where}.scope has \"moe_preprocess\" without \"moe_router\"; preprocess consumes the "
                              "router's outputs inside the same graph: add \"moe_router\" to the scope")
        if self.scope and self.impl == "local":
            raise ConfigError(f"{where}.scope={self.scope!r} with impl \"local\", which captures whole layers only; "
                              "use impl \"transformer_engine\" for partial capture or drop the scope")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise ConfigError(f"{where}.warmup_steps must be an integer >= 1 (the hooks that replay skips are collected "
                              f"after the first step), got {self.warmup_steps!r}")

    @property
    def enabled(self) -> bool:
        return self.impl != "none"

    @property
    def whole_layer(self) -> bool:
        return not self.scope

    def check_moe_settings(self, *, num_experts: Optional[int], moe_capacity_factor: Optional[float],
                           moe_pad_expert_input_to_capacity: bool, where: str) -> None:
        """Refuse MoE settings whose shapes change from step to step inside the captured part.

        Dynamic-shape settings (a graph replays fixed shapes): with
        ``moe_preprocess`` captured, token dropping without padding
        (``moe_capacity_factor`` set, ``moe_pad_expert_input_to_capacity``
        false) makes the number of permuted tokens depend on the routing.
        Without dropping it is ``tokens x topk`` (static), and with drop-and-pad
        ``capacity x experts`` (static).  Capturing whole MoE layers (empty scope)
        also puts dispatch and experts in the graph, whose per-expert shapes are
        static only with drop-and-pad.  ``where``: the config path of the MoE settings.
        """
        if not self.enabled:
            return
        moe_scopes = [s for s in self.scope if s.startswith("moe_")]
        if not num_experts:
            if moe_scopes:
                raise ConfigError(f"{SECTION}.cuda_graph.scope has {moe_scopes[0]!r} but {where}.num_experts is "
                                  "not set (no MoE layers); drop the moe_* scopes or configure MoE layers")
            return
        drop_and_pad = moe_capacity_factor is not None and moe_pad_expert_input_to_capacity
        drops_unpadded = moe_capacity_factor is not None and not moe_pad_expert_input_to_capacity
        if "moe_preprocess" in self.scope and drops_unpadded:
            raise ConfigError(f"{SECTION}.cuda_graph.scope has \"moe_preprocess\" but {where}.moe_capacity_factor="
                              f"{moe_capacity_factor} drops tokens without padding, so the permuted token count "
                              f"changes every step; set {where}.moe_pad_expert_input_to_capacity true, drop the capacity "
                              "factor, or capture only up to \"moe_router\"")
        if self.whole_layer and not drop_and_pad:
            raise ConfigError(f"{SECTION}.cuda_graph captures whole layers (empty scope, impl {self.impl!r}) but the "
                              f"MoE layers' expert shapes are dynamic ({where}.moe_capacity_factor="
                              f"{moe_capacity_factor}, moe_pad_expert_input_to_capacity="
                              f"{moe_pad_expert_input_to_capacity}); use impl \"transformer_engine\" with scope "
                              "[\"attn\", \"moe_router\", \"moe_preprocess\"], or pad to capacity")


@dataclass
class MegatronConfig:
    """Parallel layout and Megatron switches.  Sizes use Megatron-LM's argument names."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    # None means "same as tensor_model_parallel_size", as in Megatron-LM.
    expert_tensor_parallel_size: Optional[int] = None
    order: str = DEFAULT_ORDER
    sequence_parallel: bool = False
    make_vocab_size_divisible_by: int = 128
    # Megatron DDP: bucketed gradient buffers (ds_megatron.distributed)
    # None: on when any key below is set; true/false: explicitly.
    use_megatron_ddp: Optional[bool] = None
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: Optional[int] = None
    grad_reduce_in_fp32: bool = False
    average_in_collective: bool = False
    pad_buckets_for_high_nccl_busbw: bool = False
    # Megatron optimizer path (ds_megatron/optimizer/precision_config.py)
    # "megatron": our optimizer path runs mixed precision, loss scaling and clipping;
    # "deepspeed": DeepSpeed's own FP16/BF16/ZeRO optimizers do.
    optimizer_impl: str = "megatron"
    log_num_zeros_in_grad: bool = False
    # CUDA graphs (ds_megatron/cuda_graphs): the nested "cuda_graph" section.
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    # Free-form sections read by the training entry point (``ds-megatron train``);
    # validated there against their own dataclasses.
    model: Dict[str, Any] = field(default_factory=dict)
    train: Dict[str, Any] = field(default_factory=dict)
    data: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size", "make_vocab_size_divisible_by"):
            _check_positive(f"{SECTION}.{name}", getattr(self, name))
        if self.expert_tensor_parallel_size is not None:
            _check_positive(f"{SECTION}.expert_tensor_parallel_size", self.expert_tensor_parallel_size)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError(f"{SECTION}.sequence_parallel is true but tensor_model_parallel_size is 1; "
                              "sequence parallelism shards along TP ranks: set tensor_model_parallel_size > 1 "
                              "or sequence_parallel to false")
        if self.optimizer_impl not in ("megatron", "deepspeed"):
            raise ConfigError(f"{SECTION}.optimizer_impl={self.optimizer_impl!r} is unknown; "
                              "use \"megatron\" (our optimizer path) or \"deepspeed\" (DeepSpeed's own)")
        self._check_ddp()
        # CUDA graphs: MoE settings of the job's model section (GPTConfig's names) against the capture scope;
        # a model built by the user (no model section) is checked when its layers are collected.
        if self.model:
            self.cuda_graph.check_moe_settings(
                num_experts=self.model.get("num_experts"),
                moe_capacity_factor=self.model.get("moe_capacity_factor"),
                moe_pad_expert_input_to_capacity=bool(self.model.get("moe_pad_expert_input_to_capacity", False)),
                where=f"{SECTION}.model")

    # Megatron DDP
    _DDP_KEYS = ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "bucket_size",
                 "grad_reduce_in_fp32", "average_in_collective", "pad_buckets_for_high_nccl_busbw")

    def _ddp_keys_set(self):
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [k for k in self._DDP_KEYS if getattr(self, k) != defaults[k]]

    @property
    def ddp_enabled(self) -> bool:
        """Whether our buffers own gradient accumulation and reduction (instead of DeepSpeed's all-reduce)."""
        return self.use_megatron_ddp if self.use_megatron_ddp is not None else bool(self._ddp_keys_set())

    def _check_ddp(self) -> None:
        if self.use_megatron_ddp is False and self._ddp_keys_set():
            raise ConfigError(f"{SECTION}.use_megatron_ddp is false but {SECTION}.{self._ddp_keys_set()[0]} is set; "
                              "those keys configure the Megatron DDP buffers: drop them or set use_megatron_ddp true")
        if self.bucket_size is not None:
            _check_positive(f"{SECTION}.bucket_size", self.bucket_size)
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError(f"{SECTION}.overlap_param_gather is true but use_distributed_optimizer is false; params "
                              "are only all-gathered by the distributed optimizer: enable it or drop overlap_param_gather")

    def ddp_config(self):
        """The ``DistributedDataParallelConfig`` these keys describe."""
        from .distributed.ddp_config import DistributedDataParallelConfig
        return DistributedDataParallelConfig(**{k: getattr(self, k) for k in self._DDP_KEYS})

    def layout(self, world_size: int):
        """The validated ``ParallelLayout`` for ``world_size`` ranks (ConfigError if it does not fit)."""
        from .parallel.layout import ParallelLayout
        try:
            return ParallelLayout(world_size=world_size, tp=self.tensor_model_parallel_size,
                                  pp=self.pipeline_model_parallel_size, cp=self.context_parallel_size,
                                  ep=self.expert_model_parallel_size, etp=self.expert_tensor_parallel_size,
                                  order=self.order)
        except ValueError as e:
            raise ConfigError(f"{SECTION}: {e}") from None

    @property
    def is_trivial(self) -> bool:
        """True when every parallel size is 1: ``initialize`` then behaves like ``deepspeed.initialize``."""
        return (self.tensor_model_parallel_size == self.pipeline_model_parallel_size == self.context_parallel_size
                == self.expert_model_parallel_size == 1 and self.expert_tensor_parallel_size in (None, 1))


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(where: str, value, tp):
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(where, value, args[0])
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a JSON object, got {type(value).__name__}")
        return parse_section(tp, value, where)
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a JSON object, got {type(value).__name__}")
        return dict(value)
    if origin in (list, List, tuple, Tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a JSON list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return [_coerce(f"{where}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{where} must be of type {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return value


def parse_section(cls, data: Dict[str, Any], where: str):
    """Build dataclass ``cls`` from ``data``: unknown keys and wrong types are ConfigErrors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            raise ConfigError(f"unknown key {where}.{key}; known keys are: {', '.join(known)}")
    kwargs = {k: _coerce(f"{where}.{k}", v, hints[k]) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def load_ds_config(config: Union[str, os.PathLike, Dict[str, Any]]) -> Dict[str, Any]:
    """The DeepSpeed config as a dict, from a path or a dict (copied, never mutated)."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist; pass the path of a DeepSpeed JSON config")
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid JSON: {e}") from None


def split_config(config: Union[str, os.PathLike, Dict[str, Any]]) -> Tuple[Dict[str, Any], MegatronConfig]:
    """(the DeepSpeed config without our section, our parsed section)."""
    ds_config = load_ds_config(config)
    if SECTION in ds_config:
        mcfg = parse_section(MegatronConfig, ds_config.pop(SECTION), SECTION)
    else:
        # No section: an existing DeepSpeed config, run exactly as deepspeed.initialize would
        # (DeepSpeed's own precision, clipping and optimizer); the section opts in to ours.
        mcfg = MegatronConfig(optimizer_impl="deepspeed")
    # Precision/ZeRO combinations are checked here too, so a bad one fails before anything starts.
    from .optimizer.precision_config import precision_of
    precision_of(ds_config, mcfg)
    return ds_config, mcfg


def world_size_from_env() -> Optional[int]:
    """The job's world size as the launcher announced it, before torch.distributed starts."""
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None
