"""Pipeline parallelism before launch: which transformer layers each stage holds, and what a pipeline refuses.

Pure Python.  The stage split is Megatron's: the embedding sits on the first
stage, the final LayerNorm and the (tied) output layer on the last, and the
transformer layers are divided among the stages:

* ``"uniform"`` (default): ``num_layers / pp`` each; ``num_layers`` must divide;
* ``"parameters"``: contiguous runs balanced by parameter count (MoE layers are
  heavier than dense ones), every stage at least one layer;
* ``pipeline_num_layers_per_stage: [n0, n1, ...]``: given explicitly (sum =
  ``num_layers``), one entry per virtual stage;
* Megatron's ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``: that many
  layers on the first / last pipeline rank (the ranks that also hold the embedding, or the output
  layer and the loss), the rest split evenly over the other ranks.

With ``virtual_pipeline_model_parallel_size`` v > 1 (or ``num_layers_per_virtual_pipeline_stage``)
the model is cut into ``p * v`` virtual stages and rank ``r`` holds stages ``r, r + p, ...``; each
rank's layers are split evenly over its v chunks.  ``pipeline_schedule``: ``"1f1b"`` (default with
one chunk), ``"interleaved_1f1b"`` (default with v > 1, allowed with v = 1) or ``"zero_bubble"``
(ZB-H1, one chunk).  ds_megatron's GPT runs every one of them on our runtime
(``pipeline_parallel.schedules``, a ``GPTModelChunks``); ``pipeline_runtime`` says which runtime a
job gets: DeepSpeed's ``PipelineEngine`` only runs a ``PipelineModule`` (a user's, or
``GPTPipelineModule``), which ``ds-megatron train`` builds only on DeepSpeed's optimizer path
(``optimizer_impl "deepspeed"``, whose reduction and optimizer are DeepSpeed's, with "1f1b").

``check_pipeline`` holds every rule that makes a pipeline job wrong or
unrunnable, checked against the world size before any process group exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from ..errors import ConfigError, check_choice
from .parsing import SECTION, deepspeed_section

PARTITION_METHODS = ("uniform", "parameters")
SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")


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
                       layer_weights: Optional[Sequence[float]] = None, *, vpp: int = 1,
                       first: Optional[int] = None, last: Optional[int] = None) -> List[int]:
    """Transformer layers per virtual stage (``pp * vpp`` entries; with ``vpp`` 1, per stage), as the module
    docstring says.  ``layer_weights``: for ``"parameters"``; ``first`` / ``last``: Megatron's
    ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``."""
    stages = pp * vpp
    if layers_per_stage is not None:
        return list(layers_per_stage)
    if first is not None or last is not None:
        middle = pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and rest % middle):
            raise ConfigError(f"{SECTION}.decoder_first_pipeline_num_layers={first} / decoder_last_pipeline_num_layers="
                              f"{last} leave {rest} of model.num_layers={num_layers} layers for {middle} other "
                              "stages, which must divide evenly; change the counts")
        per_rank = [rest // middle if middle else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        if any(n % vpp or n < vpp for n in per_rank):
            raise ConfigError(f"{SECTION}.decoder_first/last_pipeline_num_layers give the pipeline ranks {per_rank} "
                              f"layers, each of which must be a positive multiple of "
                              f"virtual_pipeline_model_parallel_size={vpp}; change the counts")
        return [per_rank[vs % pp] // vpp for vs in range(stages)]
    if method == "uniform":
        if num_layers % stages:
            what = f"{SECTION}.pipeline_model_parallel_size={pp}" + (
                f" x virtual_pipeline_model_parallel_size={vpp}" if vpp > 1 else "")
            raise ConfigError(f"model.num_layers={num_layers} is not divisible by {what}; change one, or give "
                              f"{SECTION}.pipeline_num_layers_per_stage (or decoder_first/last_pipeline_num_layers"
                              + (", or pipeline_partition_method \"parameters\")" if vpp == 1 else ")"))
        return [num_layers // stages] * stages
    if method == "parameters":
        weights = list(layer_weights) if layer_weights is not None else [1.0] * num_layers
        if len(weights) != num_layers:
            raise ValueError(f"{len(weights)} layer weights for {num_layers} layers")
        bounds = partition_balanced(weights, stages)
        return [bounds[i + 1] - bounds[i] for i in range(stages)]
    raise ConfigError(f"{SECTION}.pipeline_partition_method={method!r} is unknown; use one of "
                      f"{', '.join(PARTITION_METHODS)}")


def rank_layers(counts: Sequence[int], pp: int, rank: int) -> List[int]:
    """The global transformer-layer indices pipeline rank ``rank`` holds, from the per-virtual-stage counts
    (its chunks ``rank, rank + pp, ...`` in order)."""
    ranges = stage_layer_ranges(counts)
    return [i for vs in range(rank, len(counts), pp) for i in ranges[vs]]


def pipeline_schedule(parallel) -> str:
    """The schedule a job runs: ``pipeline_schedule``, or by default ``"interleaved_1f1b"`` with v > 1, else
    ``"1f1b"``."""
    if parallel.pipeline_schedule is not None:
        return parallel.pipeline_schedule
    return "interleaved_1f1b" if (parallel.virtual_pipeline_model_parallel_size or 1) > 1 \
        or parallel.num_layers_per_virtual_pipeline_stage is not None else "1f1b"


def pipeline_runtime(parallel, optimizer_impl: str) -> str:
    """Which runtime ``ds-megatron train`` runs a pipeline job's GPT on: ``"ds_megatron"`` (ours, a
    ``GPTModelChunks``) or ``"deepspeed"`` (DeepSpeed's ``PipelineEngine`` over a ``GPTPipelineModule``,
    for ``pipeline_schedule`` "1f1b" on DeepSpeed's optimizer path, which our runtime cannot drive)."""
    if pipeline_schedule(parallel) == "1f1b" and optimizer_impl != "megatron":
        return "deepspeed"
    return "ds_megatron"


def virtual_pipeline_size(parallel, num_layers: Optional[int], pp: int) -> int:
    """v: ``virtual_pipeline_model_parallel_size``, or ``num_layers / (pp * num_layers_per_virtual_pipeline_stage)``
    (ConfigError if both are given, or the layers do not divide)."""
    vpp, per = parallel.virtual_pipeline_model_parallel_size, parallel.num_layers_per_virtual_pipeline_stage
    if vpp is not None and per is not None:
        raise ConfigError(f"{SECTION}.virtual_pipeline_model_parallel_size and num_layers_per_virtual_pipeline_stage "
                          "are both set; give one")
    if per is None:
        return vpp or 1
    if num_layers is None:
        raise ConfigError(f"{SECTION}.num_layers_per_virtual_pipeline_stage needs the model section's num_layers; "
                          "give virtual_pipeline_model_parallel_size instead")
    if num_layers % (pp * per):
        raise ConfigError(f"{SECTION}.num_layers_per_virtual_pipeline_stage={per}: model.num_layers={num_layers} is "
                          f"not divisible by pipeline_model_parallel_size={pp} x {per}; change one")
    return num_layers // (pp * per)


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
    pp = layout.pp
    explicit = parallel.pipeline_num_layers_per_stage
    schedule = check_choice(f"{SECTION}.pipeline_schedule", pipeline_schedule(parallel), SCHEDULES)
    vpp = virtual_pipeline_size(parallel, model.num_layers if model is not None else None, pp)
    first, last = parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers
    if pp == 1:
        if explicit is not None and len(explicit) != 1:
            raise ConfigError(f"{SECTION}.pipeline_num_layers_per_stage has {len(explicit)} entries but "
                              f"pipeline_model_parallel_size is 1; remove it")
        if vpp > 1:
            raise ConfigError(f"{SECTION}.virtual_pipeline_model_parallel_size={vpp} needs "
                              "pipeline_model_parallel_size > 1 (virtual stages interleave over the pipeline ranks)")
        if first is not None or last is not None:
            raise ConfigError(f"{SECTION}.decoder_first/last_pipeline_num_layers need pipeline_model_parallel_size "
                              "> 1; remove them")
        return
    if schedule == "zero_bubble" and vpp > 1:
        raise ConfigError(f"{SECTION}.pipeline_schedule \"zero_bubble\" (ZB-H1) runs one model chunk per stage but "
                          f"virtual_pipeline_model_parallel_size is {vpp}; drop the virtual stages or use "
                          "\"interleaved_1f1b\"")
    if schedule == "1f1b" and vpp > 1:
        raise ConfigError(f"{SECTION}.pipeline_schedule \"1f1b\" runs one model chunk per stage but "
                          f"virtual_pipeline_model_parallel_size is {vpp}; use \"interleaved_1f1b\" or drop the "
                          "virtual stages")
    if explicit is not None and (first is not None or last is not None):
        raise ConfigError(f"{SECTION}.pipeline_num_layers_per_stage and decoder_first/last_pipeline_num_layers are "
                          "both set; give one")
    if schedule != "1f1b" or (optimizer_impl == "megatron" and not plain_deepspeed):
        _check_our_runtime(parallel, batch, layout, optimizer_impl, vpp, plain_deepspeed, schedule)
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
        stages = pp * vpp
        if explicit is not None:
            if len(explicit) != stages or any(not isinstance(n, int) or n < 1 for n in explicit) \
                    or sum(explicit) != model.num_layers:
                raise ConfigError(f"{SECTION}.pipeline_num_layers_per_stage={list(explicit)} must give {stages} "
                                  f"{'virtual ' if vpp > 1 else ''}stages of at least one layer each, summing to "
                                  f"model.num_layers={model.num_layers}")
        elif model.num_layers < stages:
            raise ConfigError(f"model.num_layers={model.num_layers} is below the {stages} "
                              f"{'virtual ' if vpp > 1 else ''}pipeline stages: every stage needs a transformer "
                              "layer; lower the pipeline size")
        else:
            if vpp > 1 and parallel.pipeline_partition_method != "uniform" and first is None and last is None:
                raise ConfigError(f"{SECTION}.pipeline_partition_method={parallel.pipeline_partition_method!r} with "
                                  f"virtual_pipeline_model_parallel_size={vpp}: virtual stages are split uniformly, "
                                  "or by pipeline_num_layers_per_stage / decoder_first/last_pipeline_num_layers")
            stage_layer_counts(model.num_layers, pp, parallel.pipeline_partition_method, vpp=vpp, first=first,
                               last=last)
        if model.num_experts and optimizer_impl != "megatron":
            raise ConfigError(f"an MoE model with {SECTION}.pipeline_model_parallel_size={pp} needs "
                              f"{SECTION}.optimizer_impl \"megatron\" (routing-loss gradients on every stage are "
                              "scaled with its loss scale); set it")
        if model.mtp_num_layers and optimizer_impl != "megatron":
            raise ConfigError(f"model.mtp_num_layers={model.mtp_num_layers} with {SECTION}.pipeline_model_parallel_size="
                              f"{pp} needs {SECTION}.optimizer_impl \"megatron\" (our pipeline runtime gives the "
                              "last stage the tokens multi-token prediction embeds; DeepSpeed's PipelineEngine does "
                              "not); set it")


def _check_our_runtime(parallel, batch: DeepSpeedBatchKeys, layout, optimizer_impl: str, vpp: int,
                       plain_deepspeed: bool, schedule: str) -> None:
    """What ``pipeline_schedule`` "interleaved_1f1b" or "zero_bubble" (our runtime) needs."""
    if plain_deepspeed:
        raise ConfigError(f"{SECTION}.pipeline_schedule \"{schedule}\" runs ds_megatron's GPT chunks; a "
                          "DeepSpeed PipelineModule runs on DeepSpeed's engine: drop the key")
    if optimizer_impl != "megatron":
        raise ConfigError(f"{SECTION}.pipeline_schedule \"{schedule}\" with {SECTION}.optimizer_impl "
                          f"\"{optimizer_impl}\": the runtime drives ds_megatron's gradient buffers and optimizer; "
                          "set optimizer_impl \"megatron\"")
    group = parallel.microbatch_group_size_per_vp_stage or layout.pp
    micro_batches = batch.micro_batches(layout.dp)
    if vpp > 1 and micro_batches is not None and micro_batches % group:
        raise ConfigError(f"gradient_accumulation_steps={micro_batches} is not a multiple of {SECTION}."
                          f"microbatch_group_size_per_vp_stage={group} (default: pipeline_model_parallel_size), "
                          "which the interleaved schedule runs its micro-batches in; change one")
