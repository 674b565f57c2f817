"""Every part of DeepSpeed that ds_megatron reads, writes, wraps or replaces beyond its public API, by name.

DeepSpeed's public API (``deepspeed.initialize``, the engine's forward / ``backward`` / ``step`` /
``train_batch`` / ``save_checkpoint`` / ``load_checkpoint`` and its query methods, ``PipelineModule``,
``TiedLayerSpec``, ``ProcessTopology``, ``deepspeed.moe.layer.MoE``, ``deepspeed.init_distributed``) is
called where it is needed inside ``integration/``.  Everything else (private names, engine state
DeepSpeed keeps for itself, the one engine method we replace, the one module function we wrap, and
the file names we read back) is reached only through the accessors below.  ``SEAMS`` lists each one
with what we rely on, and ``check_seams()`` holds them to the installed DeepSpeed without building
an engine (``tests/test_deepspeed_seams.py``): a DeepSpeed upgrade that moves one fails there, in
one test, naming it.  The DeepSpeed version is checked here, once, at import.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import deepspeed
import deepspeed.ops
import torch
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.pipe import PipelineModule, p2p
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import groups as ds_groups

from ..config.precision import PrecisionConfig
from ..parallel_state import ParallelGroup

# The versions whose internals the seams were read from and tested against.
TESTED_DEEPSPEED = ("0.19",)
MIN_DEEPSPEED = (0, 16)


def check_deepspeed_version(version: str) -> None:
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if parts < MIN_DEEPSPEED:
        raise ImportError(f"ds_megatron needs DeepSpeed >= {'.'.join(map(str, MIN_DEEPSPEED))}, found {version}; "
                          "pip install 'deepspeed>=0.19,<0.20'")
    if not version.startswith(TESTED_DEEPSPEED):
        warnings.warn(f"ds_megatron was tested with DeepSpeed {', '.join(v + '.x' for v in TESTED_DEEPSPEED)}, this "
                      f"is {version}: the seams in ds_megatron/integration/seams.py may have moved; run "
                      "tests/test_deepspeed_seams.py", stacklevel=2)


check_deepspeed_version(deepspeed.__version__)


# -- who reduces gradients ---------------------------------------------------------------------------------------

def set_deepspeed_reduces_gradients(engine, enabled: bool) -> None:
    """DeepSpeed's own data-parallel all-reduce on or off (off: our buffers reduce).  The flags the engine checks
    in ``_backward_epilogue`` / ``step``, and the pipeline engine in ``_exec_reduce_grads``; the pipeline engine
    turns the first off itself for the same reason."""
    engine.enable_backward_allreduce = enabled
    if isinstance(engine, PipelineEngine):
        engine.pipeline_enable_backward_allreduce = enabled


def inside_no_sync(engine) -> bool:
    """Whether the caller is inside ``engine.no_sync()`` (the engine's own flag)."""
    return engine.inside_no_sync_ctxt


def pipeline_micro_batches(engine) -> int:
    """The micro-batches of one ``train_batch`` of a pipeline engine."""
    return engine.micro_batches


# -- the precision queries and the fp32 clipping ---------------------------------------------------------------

def _our_optimizer_clips() -> None:
    """Stands in for ``DeepSpeedEngine.clip_fp32_gradients`` on our path (see ``report_precision``)."""


def report_precision(engine, precision: PrecisionConfig) -> None:
    """Make the engine's precision queries answer with our path's settings.

    DeepSpeed must be built with fp16 / bf16 off and ``gradient_clipping`` 0 on our path
    (``integration.optimizer``): otherwise it wraps our optimizer in its own, refuses fp16 on a
    CPU, and clips the still-scaled gradients.  Its queries (``fp16_enabled()``,
    ``bfloat16_enabled()``, ``gradient_clipping()``, ``loss_scale()``, ``dynamic_loss_scale()``,
    ``initial_dynamic_scale()``) read that config, so they would answer False / 0.0 while our path
    trains in bf16 with clipping, and users' loops branch on them.  So what is in force is written
    into ``engine._config`` after ``deepspeed.initialize``.  Every place DeepSpeed reads these flags
    after ``__init__`` was checked (0.19.8):

    * ``_take_model_step``: with fp16 / bf16 on it skips its own fp32 clipping and calls
      ``optimizer.zero_grad()`` (ours clears the model grads); with fp32 and clipping > 0 it would
      clip itself (``clip_fp32_gradients``) before our step, on gradients our buffers have not
      reduced yet, so that one method is replaced on the instance by a no-op: our optimizer clips by
      the true global norm (the only engine method we replace);
    * ``step``: with fp16 on, the monitor gets ``Train/Samples/loss_scale`` from ``optimizer.cur_scale``;
    * ``load_checkpoint``: with fp16 / bf16 on it passes ``load_optimizer_states=`` to
      ``optimizer.load_state_dict``, which our optimizers accept;
    * ``communication_data_type`` and the ZeRO checkpoint names: read only by DeepSpeed's own
      reduction and ZeRO, both off on our path.
    """
    config = engine._config
    fp16 = config.float16_config
    fp16.enabled = precision.params_dtype == "fp16"
    if fp16.enabled:
        fp16.loss_scale = precision.loss_scale
        fp16.initial_scale_power = precision.initial_scale_power
        fp16.loss_scale_window = precision.loss_scale_window
        fp16.hysteresis = precision.hysteresis
        fp16.min_loss_scale = precision.min_loss_scale
    config.bfloat16_config.enabled = precision.params_dtype == "bf16"
    config.gradient_clipping = precision.clip_grad
    if precision.params_dtype == "fp32" and precision.clip_grad > 0:
        set_fp32_clipping(engine, _our_optimizer_clips)


def set_fp32_clipping(engine, clip: Callable[[], None]) -> None:
    """``clip()`` in place of ``engine.clip_fp32_gradients``, which ``_take_model_step`` calls before the optimizer
    step when fp16, bf16 and ZeRO are off and ``gradient_clipping`` > 0 (replaced on the instance)."""
    engine.clip_fp32_gradients = clip


def after_optimizer_step(engine, then: Callable[[], None]) -> None:
    """``then()`` after every ``engine.optimizer.step()``, which ``_take_model_step`` calls once per accumulation
    boundary on every engine (the plain one, the ``PipelineEngine``), a skipped step too (replaced on the
    instance)."""
    step = engine.optimizer.step

    def step_then(*args, **kwargs):
        result = step(*args, **kwargs)
        then()
        return result
    engine.optimizer.step = step_then


def undo_construction_step(engine) -> bool:
    """Undo the optimizer step DeepSpeed's 16-bit optimizers without ZeRO (``FP16_Optimizer``,
    ``FP16_UnfusedOptimizer``) take at construction (``initialize_optimizer_states``: a step with zero gradients,
    which Adam counts, so its first update comes out 0.74x with Adam's betas (bias correction of step 2), and
    which decays the fp32 weights once).  The inner optimizer's state is emptied (it is made at the next step,
    as for a fresh optimizer) and the fp32 weights are copied again from the 16-bit ones they were made from.
    True when the engine's optimizer is one of them."""
    if not isinstance(engine.optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        return False
    engine.basic_optimizer.state.clear()
    engine.optimizer.refresh_fp32_params()
    return True


# -- the step counters a checkpoint carries ----------------------------------------------------------------------

ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


def engine_counters(engine) -> Dict[str, int]:
    """The engine's step, sample and skipped-step counters (what ``engine.save_checkpoint`` saves of them)."""
    return {name: getattr(engine, name) for name in ENGINE_COUNTERS}


def set_engine_counters(engine, counters: Dict[str, int]) -> None:
    """Restore the counters from a checkpoint DeepSpeed did not write (the layout-independent format)."""
    for name in ENGINE_COUNTERS:
        setattr(engine, name, counters[name])


# -- expert groups and expert checkpoint files -------------------------------------------------------------------

_EXPERT_TABLES = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                  "_EXPERT_DATA_PARALLEL_GROUP_RANKS")


def clear_expert_groups() -> None:
    """Empty DeepSpeed's expert-group tables: it reuses any entry of the same name, even of a destroyed group, and
    its "largest ep_size" lookup at checkpoint time would find an earlier engine's."""
    for table in _EXPERT_TABLES:
        getattr(ds_groups, table).clear()


def register_expert_groups(name: str, ep: ParallelGroup, edp: ParallelGroup) -> None:
    """Put our ep / edp groups where DeepSpeed looks expert groups up, under ``name`` (``ep_size_<EP>``)."""
    clear_expert_groups()
    ds_groups._EXPERT_PARALLEL_GROUP[name] = ep.group
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = list(ep.ranks)
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp.group
    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = list(edp.ranks)


def create_deepspeed_expert_groups(layer, mpu, use_data_before_expert_parallel: bool) -> None:
    """What ``MoE._create_process_groups`` does for a ``deepspeed.moe.layer.MoE`` (``moe/layer.py``) short of
    binding the group to the gate, which may happen once only: the engine's own call binds it later and finds
    the groups made.  ``groups.mpu`` is set as the engine would (the builder reads the pipeline size from it)."""
    if layer.expert_group_name in ds_groups._get_expert_parallel_group_dict():
        return
    ds_groups.mpu = mpu
    if mpu is None or not layer.enable_expert_tensor_parallelism:
        ds_groups._create_expert_and_data_parallel(
            layer.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel)
    else:
        ds_groups._create_expert_data_and_model_parallel(
            layer.ep_size, mpu=mpu, use_data_before_expert_parallel_=use_data_before_expert_parallel)


def deepspeed_expert_groups(name: str) -> Tuple[Tuple[List[int], Any], Tuple[List[int], Any]]:
    """``((ep ranks, ep group), (edp ranks, edp group))`` DeepSpeed holds under ``name``."""
    return ((ds_groups._get_expert_parallel_group_ranks(name), ds_groups._get_expert_parallel_group(name)),
            (ds_groups._get_expert_data_parallel_group_ranks(name), ds_groups._get_expert_data_parallel_group(name)))


def mark_engine_has_moe(engine, num_experts: List[int]) -> None:
    """DeepSpeed's MoE switches on a built engine (its optimizer path): the engine then reduces params marked
    ``allreduce=False`` over the registered expert-data-parallel groups (``_reduce_expert_gradients``) and saves
    optimizer state per expert rank (``_save_moe_checkpoint``)."""
    engine.has_moe_layers = True
    engine.num_experts = list(num_experts)
    engine.expert_parallel_group = ds_groups._get_expert_parallel_group_dict()
    engine.expert_data_parallel_group = ds_groups._get_expert_data_parallel_group_dict()


@contextlib.contextmanager
def engines_built_with_moe(num_experts: List[int]) -> Iterator[None]:
    """Inside the block, a ``DeepSpeedEngine`` under construction knows our MoE layers before it builds its
    optimizer: ``mark_engine_has_moe`` runs at the start of ``_configure_optimizer``.

    The engine finds MoE layers by ``isinstance(module, deepspeed.moe.layer.MoE)`` in
    ``_configure_distributed_model``, which ours are not, and hands ZeRO 1/2 ``has_moe_layers`` and the expert
    groups when it builds them (``_configure_zero_optimizer``): too early for ``mark_engine_has_moe`` on the built
    engine, so ZeRO would partition the expert groups over the dense data-parallel group and fail on their first
    reduction.  The class method is wrapped for the block only (``deepspeed.initialize``)."""
    original = DeepSpeedEngine.__dict__["_configure_optimizer"]

    def configure_optimizer(self, client_optimizer, model_parameters):
        mark_engine_has_moe(self, num_experts)
        return original(self, client_optimizer, model_parameters)

    DeepSpeedEngine._configure_optimizer = configure_optimizer
    try:
        yield
    finally:
        DeepSpeedEngine._configure_optimizer = original


def expert_checkpoint_name(save_dir: str, tag: str, layer_id: int, expert_id: int, etp_rank: int) -> str:
    """DeepSpeed's file for one expert's weights (``layer_<L>_expert_<E>_mp_rank_<TT>_model_states.pt``)."""
    return DeepSpeedEngine._get_expert_ckpt_name(save_dir, layer_id, expert_id, tag, checkpoint_mp_rank=etp_rank)


# -- DeepSpeed's bf16 optimizer without ZeRO, in checkpoints -----------------------------------------------------

def bf16_optimizer_without_zero(engine) -> bool:
    """Whether the engine's optimizer is DeepSpeed's ``BF16_Optimizer`` with ZeRO off (a ``PipelineEngine`` in
    bf16 at stage 0), whose state ``engine.load_checkpoint`` cannot load.  That optimizer keeps each data-parallel
    rank's partition of the fp32 weights and Adam state; ``save_checkpoint`` writes it to the rank's
    ``bf16_zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt`` (it saves ZeRO files for any optimizer with a
    ``dp_process_group``), but ``load_checkpoint`` reads those files only with ZeRO on and otherwise hands
    ``BF16_Optimizer.load_state_dict`` the one state dict of the model file, where it indexes the list it
    expects by data-parallel rank (``KeyError: 0``)."""
    return isinstance(engine.optimizer, BF16_Optimizer) and not engine.zero_optimization()


def load_bf16_optimizer_partitions(engine, load_dir: str, tag: str) -> None:
    """Load this rank's ``bf16_zero_*`` file into a ``BF16_Optimizer`` with ZeRO off, as ``load_checkpoint`` does
    with ZeRO on (``_load_zero_checkpoint``: the fp32 weights and the optimizer state, a changed data-parallel
    size refused); call it after ``engine.load_checkpoint(..., load_optimizer_states=False)``."""
    if not engine._load_zero_checkpoint(load_dir, tag, load_optimizer_states=True):
        raise FileNotFoundError(f"{os.path.join(load_dir, tag)} has no bf16_zero_*_optim_states.pt files of "
                                "DeepSpeed's BF16_Optimizer: it was not saved by a bf16 pipeline job at ZeRO stage 0")


# -- activation checkpointing, the CPU runtime -------------------------------------------------------------------

def install_rng_tracker(tracker) -> None:
    """Our model-parallel RNG tracker as the one ``deepspeed.checkpointing.checkpoint`` saves and restores: that
    function replays dropout with its module's own tracker and never asks the mpu."""
    ds_checkpointing._CUDA_RNG_STATE_TRACKER = tracker


def skip_shm_comm_build() -> None:
    """Mark DeepSpeed's shared-memory all-reduce op unavailable: the CPU accelerator's first ``init_distributed``
    would JIT-compile it (about 40 s), and only inference uses it."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


# -- pipeline module internals -----------------------------------------------------------------------------------

# ``PipelineModule`` methods ``GPTPipelineModule`` overrides: their names and what DeepSpeed passes them.
PIPELINE_MODULE_OVERRIDES = {"_partition_layers": ("self", "method"), "_synchronize_tied_weights": ("self",)}


def set_pipeline_parts(module: PipelineModule, parts: List[int], stage_id: int) -> None:
    """What ``_partition_layers`` must leave behind: ``parts`` (the first item of each stage, and the end) and the
    local bounds ``_build`` slices the layer list with."""
    module.parts = list(parts)
    module._set_bounds(start=parts[stage_id], stop=parts[stage_id + 1])


def tied_weights(module: PipelineModule) -> List[Tuple[str, List[int], List[torch.Tensor]]]:
    """``(key, ranks, weights)`` of each tied layer of a pipeline module (its ``tied_comms``)."""
    out = []
    for key, comm in getattr(module, "tied_comms", {}).items():
        weights = [module._recursive_getattr(module.tied_modules[key], attr) for attr in comm["weight_attr"]]
        out.append((key, sorted(comm["ranks"]), weights))
    return out


def pipeline_layer_state_dicts(module: torch.nn.Module) -> Optional[Dict[str, Dict[str, Any]]]:
    """``{"layer_<NN>": state dict}`` of the layers DeepSpeed writes one file each for
    (``layer_<NN>-model_<TT>-model_states.pt``: ``ckpt_layer_path``, ``save_state_dict``); None for a module
    that is not a ``PipelineModule`` (DeepSpeed writes it whole)."""
    if not isinstance(module, PipelineModule):
        return None
    return {f"layer_{module._local_start + i:02d}": layer.state_dict(keep_vars=True)
            for i, layer in enumerate(module.forward_funcs) if isinstance(layer, torch.nn.Module)}


# The groups DeepSpeed's PipelineParallelGrid keeps for this rank (runtime/pipe/topology.py).
_GRID_GROUPS = ("ds_model_proc_group", "dp_proc_group", "pp_proc_group", "slice_proc_group")


def release_pipeline_module_groups(module: PipelineModule) -> List[Any]:
    """The process groups a ``PipelineModule`` made for itself (its world group, its grid's groups, its tied
    layers' groups), which DeepSpeed never frees; the module forgets them.  Returns them for the caller to
    destroy (a process that builds engine after engine keeps none of them)."""
    grid = getattr(module, "_grid", None)
    found = [getattr(module, "world_group", None)]
    found += [getattr(grid, name, None) for name in _GRID_GROUPS]
    for comm in getattr(module, "tied_comms", {}).values():
        found.append(comm.get("group"))
        comm["group"] = None
    module.world_group = None
    if grid is not None:
        for name in _GRID_GROUPS:
            setattr(grid, name, None)
    return [g for g in found if g is not None]


def count_pipeline_sends(record: Callable[[torch.Tensor], None]) -> Callable[[], None]:
    """Have ``record(tensor)`` see every tensor the pipeline engine sends between stages; returns the undo.

    The engine calls the module function ``runtime/pipe/p2p.send`` for each one (activations forward, their
    gradients backward, tensor metadata on the first step); it is replaced by a wrapper that records and passes
    the tensor on unchanged.  The state lives in the wrapper: installing again replaces the earlier wrapper."""
    original = getattr(p2p.send, "__wrapped__", p2p.send)

    def send(tensor, dest_stage, async_op=False):
        record(tensor)
        return original(tensor, dest_stage, async_op=async_op)

    send.__wrapped__ = original
    p2p.send = send

    def undo() -> None:
        if p2p.send is send:
            p2p.send = original
    return undo


# -- the check ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Seam:
    """One part of DeepSpeed we rely on beyond its public API: ``what`` it is, the accessor or module of ours that
    uses it (``used_by``), and ``check``, which returns None when the installed DeepSpeed has it as we rely on,
    else the problem."""

    what: str
    used_by: str
    check: Callable[[], Optional[str]]


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _reads(owner, method: str, *names: str) -> Callable[[], Optional[str]]:
    """``owner.method`` exists and its source mentions every one of ``names``."""
    def check() -> Optional[str]:
        fn = getattr(owner, method, None)
        if fn is None:
            return f"{owner.__name__}.{method} is gone"
        missing = [n for n in names if n not in _source(fn)]
        return f"{owner.__name__}.{method} no longer uses {', '.join(missing)}" if missing else None
    return check


def _sets_in_init(owner, *attrs: str) -> Callable[[], Optional[str]]:
    """``owner.__init__`` assigns every one of ``attrs`` (engine state we read or write)."""
    def check() -> Optional[str]:
        source = _source(owner.__init__)
        missing = [a for a in attrs if f"self.{a} =" not in source and f"self.{a}: " not in source]
        return f"{owner.__name__}.__init__ no longer sets {', '.join(missing)}" if missing else None
    return check


def _has(owner, name: str, kind: type = object, params: Optional[Tuple[str, ...]] = None,
         keywords: Tuple[str, ...] = ()) -> Callable[[], Optional[str]]:
    """``owner.name`` exists, is a ``kind``, takes ``params`` first (in that order: we pass them by position)
    and accepts ``keywords`` (we pass them by name)."""
    def check() -> Optional[str]:
        where = getattr(owner, "__name__", repr(owner))
        if not hasattr(owner, name):
            return f"{where}.{name} is gone"
        value = getattr(owner, name)
        if not isinstance(value, kind):
            return f"{where}.{name} is a {type(value).__name__}, not a {kind.__name__}"
        if params is not None or keywords:
            accepted = tuple(inspect.signature(value).parameters)
            if params is not None and accepted[:len(params)] != params:
                return f"{where}.{name} takes {accepted[:len(params)]} first, not {params}"
            missing = [k for k in keywords if k not in accepted]
            if missing:
                return f"{where}.{name} no longer takes {', '.join(missing)}"
        return None
    return check


def _expert_file_name() -> Optional[str]:
    got = DeepSpeedEngine._get_expert_ckpt_name("ckpt", 3, 5, "tag", checkpoint_mp_rank=1)
    want = os.path.join("ckpt", "tag", "layer_3_expert_5_mp_rank_01_model_states.pt")
    return None if got == want else f"DeepSpeedEngine._get_expert_ckpt_name gives {got!r}, not {want!r}"


def _pipeline_layer_file_name() -> Optional[str]:
    source = _source(PipelineModule.ckpt_layer_path)
    if "layer_{idx:02d}" not in source or "self._local_start" not in source or "-model_states.pt" not in source:
        return "PipelineModule.ckpt_layer_path no longer names files layer_<_local_start + i>-...-model_states.pt"
    return None


def _compatible_ops() -> Optional[str]:
    ops = deepspeed.ops.__compatible_ops__
    if not isinstance(ops, dict) or "deepspeed_shm_comm" not in ops:
        return "deepspeed.ops.__compatible_ops__ has no 'deepspeed_shm_comm' entry"
    return None


def _overrides() -> Optional[str]:
    for name, params in PIPELINE_MODULE_OVERRIDES.items():
        problem = _has(PipelineModule, name, params=params)()
        if problem:
            return problem
    if "self._partition_layers(method=" not in _source(PipelineModule.__init__):
        return "PipelineModule.__init__ no longer calls self._partition_layers(method=...)"
    return None


def _expert_group_getters() -> Optional[str]:
    for kind in ("_parallel", "_data_parallel"):
        for suffix, params in (("", ("group_name",)), ("_ranks", ("group_name",)), ("_dict", ())):
            problem = _has(ds_groups, f"_get_expert{kind}_group{suffix}", params=params)()
            if problem:
                return problem
    return None


def _expert_tables() -> Optional[str]:
    for table in _EXPERT_TABLES:
        problem = _has(ds_groups, table, dict)()
        if problem:
            return problem
    return None


def _construction_step() -> Optional[str]:
    for cls in (FP16_Optimizer, FP16_UnfusedOptimizer):
        problem = (_reads(cls, "__init__", "self.initialize_optimizer_states()")()
                   or _reads(cls, "initialize_optimizer_states", "self.optimizer.step()")()
                   or _has(cls, "refresh_fp32_params", params=("self",))())
        if problem:
            return problem
    return _reads(DeepSpeedEngine, "_configure_optimizer", "self.basic_optimizer = basic_optimizer")()


def _configure_optimizer_order() -> Optional[str]:
    source = _source(DeepSpeedEngine.__init__)
    model, optimizer = source.find("self._configure_distributed_model("), source.find("self._configure_optimizer(")
    if model < 0 or optimizer < model:
        return "DeepSpeedEngine.__init__ no longer calls _configure_optimizer after _configure_distributed_model"
    return None


SEAMS: List[Seam] = [
    Seam("engine.enable_backward_allreduce, pipeline_enable_backward_allreduce: DeepSpeed's own reduction switch",
         "set_deepspeed_reduces_gradients (integration.gradients)",
         lambda: (_sets_in_init(DeepSpeedEngine, "enable_backward_allreduce")()
                  or _reads(DeepSpeedEngine, "_backward_epilogue", "enable_backward_allreduce")()
                  or _reads(DeepSpeedEngine, "step", "enable_backward_allreduce")()
                  or _sets_in_init(PipelineEngine, "pipeline_enable_backward_allreduce")()
                  or _reads(PipelineEngine, "_exec_reduce_grads", "pipeline_enable_backward_allreduce")())),
    Seam("engine.inside_no_sync_ctxt: inside engine.no_sync()", "inside_no_sync (integration.gradients)",
         _sets_in_init(DeepSpeedEngine, "inside_no_sync_ctxt")),
    Seam("pipeline engine.micro_batches, num_stages, stage_id", "pipeline_micro_batches (integration.gradients), "
         "integration.cuda_graphs", _sets_in_init(PipelineEngine, "micro_batches", "num_stages", "stage_id")),
    Seam("engine.global_steps, global_samples, skipped_steps, micro_steps: the step counters",
         "engine_counters / set_engine_counters (checkpointing.torch_dist), integration.cuda_graphs, training",
         _sets_in_init(DeepSpeedEngine, *ENGINE_COUNTERS, "micro_steps")),
    Seam("engine._config.float16_config / bfloat16_config / gradient_clipping behind the precision queries",
         "report_precision (integration.engine)",
         lambda: (_reads(DeepSpeedEngine, "fp16_enabled", "float16_config")()
                  or _reads(DeepSpeedEngine, "bfloat16_enabled", "bfloat16_config")()
                  or _reads(DeepSpeedEngine, "gradient_clipping", "gradient_clipping")())),
    Seam("engine.clip_fp32_gradients, called by _take_model_step on the fp32 path with clipping",
         "set_fp32_clipping (report_precision; integration.engine on DeepSpeed's path), on the instance",
         lambda: (_has(DeepSpeedEngine, "clip_fp32_gradients", params=("self",))()
                  or _reads(DeepSpeedEngine, "_take_model_step", "self.clip_fp32_gradients()")())),
    Seam("FP16_Optimizer / FP16_UnfusedOptimizer step their optimizer at construction "
         "(initialize_optimizer_states), engine.basic_optimizer, refresh_fp32_params()",
         "undo_construction_step (integration.engine)", _construction_step),
    Seam("engine.optimizer.step(), called by _take_model_step once per accumulation boundary",
         "after_optimizer_step (integration.engine: the delayed fp8 recipe on DeepSpeed's optimizer path), on the "
         "instance", _reads(DeepSpeedEngine, "_take_model_step", "self.optimizer.step()")),
    Seam("optimizer.overflow and optimizer._global_grad_norm, read after the client optimizer's step",
         "optimizer.megatron_optimizer (our optimizers set them)",
         _reads(DeepSpeedEngine, "_take_model_step", "self.optimizer.overflow", "self.optimizer._global_grad_norm")),
    Seam("optimizer.refresh_fp32_params(), called by load_checkpoint(load_module_only=True)",
         "optimizer.megatron_optimizer", _reads(DeepSpeedEngine, "_load_checkpoint", "refresh_fp32_params")),
    Seam("groups._EXPERT_PARALLEL_GROUP(_RANKS), _EXPERT_DATA_PARALLEL_GROUP(_RANKS): the expert-group tables",
         "clear_expert_groups / register_expert_groups (integration.moe)", _expert_tables),
    Seam("groups._create_expert_and_data_parallel, _create_expert_data_and_model_parallel, groups.mpu",
         "create_deepspeed_expert_groups (integration.moe)",
         lambda: (_has(ds_groups, "_create_expert_and_data_parallel", params=("expert_parallel_size_",),
                       keywords=("use_data_before_expert_parallel_",))()
                  or _has(ds_groups, "_create_expert_data_and_model_parallel", params=("expert_parallel_size_",),
                          keywords=("mpu", "use_data_before_expert_parallel_"))()
                  or _has(ds_groups, "mpu")())),
    Seam("groups._get_expert_(data_)parallel_group(_ranks|_dict)", "deepspeed_expert_groups, mark_engine_has_moe",
         _expert_group_getters),
    Seam("engine.has_moe_layers, num_experts, expert_parallel_group, expert_data_parallel_group",
         "mark_engine_has_moe (integration.moe)",
         lambda: (_sets_in_init(DeepSpeedEngine, "has_moe_layers", "num_experts")()
                  or _reads(DeepSpeedEngine, "_reduce_expert_gradients", "expert_data_parallel_group")())),
    Seam("DeepSpeedEngine._configure_optimizer(client_optimizer, model_parameters), wrapped while an engine is "
         "built; __init__ calls it after _configure_distributed_model, and ZeRO 1/2 take has_moe_layers and the "
         "expert groups from the engine there", "engines_built_with_moe (integration.engine)",
         lambda: (_has(DeepSpeedEngine, "_configure_optimizer", params=("self", "client_optimizer",
                                                                         "model_parameters"))()
                  or _configure_optimizer_order()
                  or _reads(DeepSpeedEngine, "_configure_zero_optimizer", "has_moe_layers=self.has_moe_layers",
                            "self.expert_data_parallel_group if self.has_moe_layers")())),
    Seam("BF16_Optimizer's state: saved per data-parallel rank to bf16_zero_* files (_configure_checkpointing "
         "saves ZeRO files for an optimizer with a dp_process_group), read back by _load_zero_checkpoint(load_dir, "
         "tag, load_optimizer_states) into load_state_dict's list indexed by data-parallel rank",
         "bf16_optimizer_without_zero / load_bf16_optimizer_partitions (checkpointing.deepspeed_format)",
         lambda: (_reads(DeepSpeedEngine, "_configure_checkpointing", "hasattr(self.optimizer, 'dp_process_group')")()
                  or _has(DeepSpeedEngine, "_load_zero_checkpoint", params=("self", "load_dir", "tag"),
                          keywords=("load_optimizer_states",))()
                  or _reads(BF16_Optimizer, "_load_legacy_checkpoint", "state_dict_list[dp_rank]",
                            "load_from_fp32_weights")())),
    Seam("DeepSpeedEngine._get_expert_ckpt_name and its file name", "expert_checkpoint_name "
         "(checkpointing.deepspeed_format), checkpointing.export_fp32", _expert_file_name),
    Seam("runtime.activation_checkpointing.checkpointing._CUDA_RNG_STATE_TRACKER", "install_rng_tracker "
         "(integration.engine)", _has(ds_checkpointing, "_CUDA_RNG_STATE_TRACKER")),
    Seam("deepspeed.ops.__compatible_ops__['deepspeed_shm_comm']", "skip_shm_comm_build (integration.runtime)",
         _compatible_ops),
    Seam("PipelineModule._partition_layers and _synchronize_tied_weights, overridden",
         "integration.pipeline.GPTPipelineModule", _overrides),
    Seam("PipelineModule.parts, _set_bounds(start, stop), the bounds _build slices the layers with",
         "set_pipeline_parts (integration.pipeline)",
         lambda: (_has(PipelineModule, "_set_bounds", keywords=("start", "stop"))()
                  or _reads(PipelineModule, "_build", "self._local_start", "self._local_stop")())),
    Seam("PipelineModule.tied_comms ({key: ranks, weight_attr, group}), tied_modules, _recursive_getattr",
         "tied_weights (integration.pipeline)",
         lambda: (_sets_in_init(PipelineModule, "tied_comms", "tied_modules")()
                  or _has(PipelineModule, "_recursive_getattr", params=("module", "attr_name"))()
                  or _reads(PipelineModule, "_index_tied_modules", "'ranks'", "'weight_attr'", "'group'")())),
    Seam("PipelineModule.forward_funcs, _local_start and the layer_<NN>-model_<TT>-model_states.pt files",
         "pipeline_layer_state_dicts (checkpointing.deepspeed_format), checkpointing.export_fp32",
         lambda: _sets_in_init(PipelineModule, "forward_funcs", "_local_start")() or _pipeline_layer_file_name()),
    Seam("PipelineModule.world_group, _grid and its *_proc_group groups", "release_pipeline_module_groups",
         lambda: _sets_in_init(PipelineModule, "world_group", "_grid")()),
    Seam("runtime.pipe.p2p.send(tensor, dest_stage, async_op), called by the pipeline engine for every send",
         "count_pipeline_sends (integration.engine)",
         lambda: (_has(p2p, "send", params=("tensor", "dest_stage"), keywords=("async_op",))()
                  or _reads(PipelineEngine, "_exec_send_activations", "p2p.send(")()
                  or _reads(PipelineEngine, "_exec_send_grads", "p2p.send(")())),
]


def check_seams() -> List[str]:
    """One line per seam the installed DeepSpeed no longer has as we rely on it (empty: all hold)."""
    problems = []
    for seam in SEAMS:
        try:
            problem = seam.check()
        except Exception as e:  # noqa: BLE001 - a seam that cannot even be looked at is a broken seam
            problem = f"{type(e).__name__}: {e}"
        if problem:
            problems.append(f"{seam.what} (used by {seam.used_by}): {problem}")
    return problems


__all__ = ["ENGINE_COUNTERS", "PIPELINE_MODULE_OVERRIDES", "SEAMS", "Seam", "after_optimizer_step",
           "check_deepspeed_version", "check_seams",
           "clear_expert_groups", "count_pipeline_sends", "create_deepspeed_expert_groups", "deepspeed_expert_groups",
           "engine_counters", "engines_built_with_moe", "expert_checkpoint_name", "inside_no_sync",
           "install_rng_tracker", "mark_engine_has_moe", "pipeline_layer_state_dicts", "pipeline_micro_batches",
           "register_expert_groups", "release_pipeline_module_groups", "report_precision",
           "set_deepspeed_reduces_gradients", "set_engine_counters", "set_fp32_clipping", "set_pipeline_parts",
           "skip_shm_comm_build", "tied_weights", "undo_construction_step"]
