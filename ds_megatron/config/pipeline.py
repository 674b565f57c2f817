"""Pipeline parallelism before launch: which transformer layers each stage holds, and what a pipeline refuses.

Pure Python.  The stage split is Megatron's: the embedding sits on the first
stage, the final LayerNorm and the (tied) output layer on the last, and the
transformer layers are divided among the stages:

* ``"uniform"`` (default): ``num_layers / pp`` each; ``num_layers`` must divide;
* ``"parameters"``: contiguous runs balanced by parameter count (MoE layers are
  heavier than dense ones), every stage at least one layer;
* ``pipeline_num_layers_per_stage: [n0, n1, ...]``: given explicitly (sum =
  ``num_layers``), like Megatron's first/last-stage layer counts.

``check_pipeline`` holds every rule that makes a pipeline job wrong or
unrunnable, checked against the world size before any process group exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from ..errors import ConfigError
from .parsing import SECTION, deepspeed_section

PARTITION_METHODS = ("uniform", "parameters")


@dataclass(frozen=True)
class DeepSpeedBatchKeys:
    """The DeepSpeed keys a pipeline depends on: the batch triple, the ZeRO stage, the ``pipeline`` section and
    ``gradient_clipping``."""

    train_batch_size: Optional[int] = None
    train_micro_batch_size_per_gpu: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None
    zero_stage: int = 0
    pipeline: Optional[Dict[str, Any]] = None
    gradient_clipping: float = 0.0

    @classmethod
    def from_ds_config(cls, ds_config: Dict[str, Any]) -> "DeepSpeedBatchKeys":
        return cls(ds_config.get("train_batch_size"), ds_config.get("train_micro_batch_size_per_gpu"),
                   ds_config.get("gradient_accumulation_steps"),
                   int(deepspeed_section(ds_config, "zero_optimization").get("stage", 0) or 0),
                   ds_config.get("pipeline"), float(ds_config.get("gradient_clipping", 0.0) or 0.0))

    def micro_batches(self, dp: int) -> Optional[int]:
        """Micro-batches per optimizer step (DeepSpeed's ``gradient_accumulation_steps``), derived as DeepSpeed does.

        None when the keys do not determine it (DeepSpeed itself will refuse them)."""
        tbs, mbs, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        if gas is not None:
            return gas
        if tbs is not None and mbs is not None:
            return tbs // (mbs * dp) if mbs * dp else None
        return 1 if (tbs is not None or mbs is not None) else None


def partition_balanced(weights: Sequence[float], num_parts: int) -> List[int]:
    """Boundaries ``[0, b1, ..., len(weights)]`` of ``num_parts`` contiguous non-empty runs minimising the heaviest run.

    Exact (dynamic programming over split points); ties go to the split whose
    earlier runs are shorter, so equal weights split like ``"uniform"``.
    """
    n = len(weights)
    if not 1 <= num_parts <= n:
        raise ValueError(f"cannot split {n} layers into {num_parts} non-empty stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest possible heaviest run when the first i items form k runs.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-9 * max(1.0, abs(cost)):
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [n], n
    for k in range(num_parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def stage_layer_counts(num_layers: int, pp: int, method: str = "uniform",
                       layers_per_stage: Optional[Sequence[int]] = None,
                       layer_weights: Optional[Sequence[float]] = None) -> List[int]:
    """Transformer layers per stage (see the module docstring).  ``layer_weights``: for ``"parameters"``."""
    if layers_per_stage is not None:
        return list(layers_per_stage)
    if method == "uniform":
        if num_layers % pp:
            raise ConfigError(f"model.num_layers={num_layers} is not divisible by "
                              f"{SECTION}.pipeline_model_parallel_size={pp}; change one, or give "
                              f"{SECTION}.pipeline_num_layers_per_stage (or pipeline_partition_method \"parameters\")")
        return [num_layers // pp] * pp
    if method == "parameters":
        weights = list(layer_weights) if layer_weights is not None else [1.0] * num_layers
        if len(weights) != num_layers:
            raise ValueError(f"{len(weights)} layer weights for {num_layers} layers")
        bounds = partition_balanced(weights, pp)
        return [bounds[i + 1] - bounds[i] for i in range(pp)]
    raise ConfigError(f"{SECTION}.pipeline_partition_method={method!r} is unknown; use one of "
                      f"{', '.join(PARTITION_METHODS)}")


def stage_layer_ranges(counts: Sequence[int]) -> List[range]:
    """The global transformer-layer indices of each stage, from the per-stage counts."""
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def pipeline_grid_axes(order: str, sizes: Dict[str, int]) -> List[List[str]]:
    """The order's tokens as DeepSpeed's pipeline grid axes, slowest first: ``[["pp"], ["dp", "cp"], ["tp"]]``.

    The grid has pipe, data and model axes; the cp ranks replicate the weights as the dp ranks do, so cp
    joins the data axis, which needs it next to dp once the size-1 tokens are left out.  ConfigError naming
    ``megatron.order`` for any other token above size 1, or a cp that is not next to dp."""
    tokens = [t for t in reversed(order.split("-")) if t in ("pp", "dp", "tp") or sizes.get(t, 1) > 1]
    axes: List[List[str]] = []
    for i, token in enumerate(tokens):
        if token == "cp":
            if i > 0 and tokens[i - 1] == "dp":
                axes[-1].append("cp")
            elif i + 1 < len(tokens) and tokens[i + 1] == "dp":
                axes.append(["cp"])  # dp joins it next
            else:
                raise ConfigError(f"{SECTION}.order {order!r} with context_parallel_size {sizes['cp']} and "
                                  "pipeline parallelism: DeepSpeed's pipeline grid folds cp into its data axis, which "
                                  "needs cp next to dp in the order; use one like the default tp-cp-ep-dp-pp")
        elif token in ("pp", "tp"):
            axes.append([token])
        elif token == "dp":
            if axes and axes[-1] == ["cp"]:
                axes[-1].append("dp")
            else:
                axes.append(["dp"])
        else:
            raise ConfigError(f"{SECTION}.order {order!r} with {token} size {sizes[token]}: DeepSpeed's pipeline "
                              f"topology has pipe, data and model axes only; set the {token} size to 1 with "
                              "pipeline parallelism")
    return axes


def check_pipeline(parallel, model, batch: DeepSpeedBatchKeys, layout, optimizer_impl: str,
                   plain_deepspeed: bool = False) -> None:
    """Every pipeline rule (ConfigError naming the field and the fix).  ``parallel``: ``ParallelConfig``;
    ``model``: ``GPTConfig`` or None; ``layout``: the job's ``ParallelLayout``; ``plain_deepspeed``: no
    ``"megatron"`` section, a DeepSpeed pipeline job run as ``deepspeed.initialize`` runs it (what DeepSpeed runs
    right is not refused; what it gets wrong still is)."""
    vpp = parallel.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1:
        raise ConfigError(f"{SECTION}.virtual_pipeline_model_parallel_size={vpp}: the interleaved schedule is not "
                          "available (DeepSpeed's pipeline engine runs one model chunk per stage); remove the key or "
                          "set it to 1")
    pp = layout.pp
    explicit = parallel.pipeline_num_layers_per_stage
    if pp == 1:
        if explicit is not None and len(explicit) != 1:
            raise ConfigError(f"{SECTION}.pipeline_num_layers_per_stage has {len(explicit)} entries but "
                              f"pipeline_model_parallel_size is 1; remove it")
        return
    pipeline_grid_axes(layout.dense_generator().order, {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": pp, "ep": 1})
    if batch.zero_stage > 1:
        raise ConfigError(f"zero_optimization.stage={batch.zero_stage} with {SECTION}.pipeline_model_parallel_size="
                          f"{pp}: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only; lower the stage (or use "
                          f"{SECTION}.use_distributed_optimizer)")
    micro_batches = batch.micro_batches(layout.dp)
    if micro_batches is not None and micro_batches < pp and not plain_deepspeed:
        raise ConfigError(f"gradient_accumulation_steps={micro_batches} is below {SECTION}.pipeline_model_parallel_size="
                          f"{pp}: each optimizer step runs that many micro-batches through the pipeline, and fewer "
                          f"than the stages leaves some idle for the whole step; set gradient_accumulation_steps >= {pp}")
    if optimizer_impl != "megatron" and batch.gradient_clipping > 0:
        # Measured: DeepSpeed's clip_grad_norm_ counts replicated params on model-parallel rank 0 of its grid only,
        # i.e. on the first stage, so later stages' norms go missing (PP=2 drifted 1e-3 from PP=1 in 10 steps).
        raise ConfigError(f"gradient_clipping={batch.gradient_clipping} with {SECTION}.pipeline_model_parallel_size="
                          f"{pp} and {SECTION}.optimizer_impl \"{optimizer_impl}\": DeepSpeed's pipeline clipping "
                          "leaves out the replicated parameters of every stage but the first; use optimizer_impl "
                          "\"megatron\" (the true global norm over all stages) or set gradient_clipping to 0")
    pipe = batch.pipeline or {}
    if parallel.sequence_parallel and (pipe.get("pipe_partitioned") or pipe.get("grad_partitioned")):
        raise ConfigError("pipeline.pipe_partitioned / grad_partitioned with sequence_parallel: DeepSpeed would split "
                          "and regather activations that are already different on every TP rank; set both to false")
    if model is not None:
        if explicit is not None:
            if len(explicit) != pp or any(not isinstance(n, int) or n < 1 for n in explicit) \
                    or sum(explicit) != model.num_layers:
                raise ConfigError(f"{SECTION}.pipeline_num_layers_per_stage={list(explicit)} must give {pp} stages "
                                  f"of at least one layer each, summing to model.num_layers={model.num_layers}")
        elif model.num_layers < pp:
            raise ConfigError(f"model.num_layers={model.num_layers} is below {SECTION}.pipeline_model_parallel_size="
                              f"{pp}: every stage needs a transformer layer; lower the pipeline size")
        else:
            stage_layer_counts(model.num_layers, pp, parallel.pipeline_partition_method)
        if model.num_experts and optimizer_impl != "megatron":
            raise ConfigError(f"an MoE model with {SECTION}.pipeline_model_parallel_size={pp} needs "
                              f"{SECTION}.optimizer_impl \"megatron\" (routing-loss gradients on every stage are "
                              "scaled with its loss scale); set it")
