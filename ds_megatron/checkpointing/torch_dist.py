"""Layout-independent training checkpoints (``megatron.train.ckpt_format: "torch_dist"``).

Written with ``torch.distributed.checkpoint`` (DCP): every rank writes its own
shards in parallel, each stored with its offsets inside a tensor of the one-rank
model (``global_shards``), and DCP's reader cuts any other layout's shards
out of them.  So a checkpoint saved at one TP / PP / EP / ETP / DP resumes at
another: weights, fp32 main params, optimizer moments, the loss scaler, the
LR schedule, DeepSpeed's step counters and the caller's client state (step, data
position).  Replicated tensors (norms, KV heads copied over TP ranks, the tied
embedding's last-stage copy, data-parallel replicas) are written once: DCP keeps
one of the identical items.

The optimizer state goes through our optimizers' own ``state_dict`` /
``load_state_dict`` (the distributed optimizer gathers and cuts its shards there),
re-keyed from "index in this rank's param groups" to the one-rank model's
parameter names; ``state_dict_params()`` says which param each index is.

Keys of the checkpoint (the one-rank ``GPTModel``'s names, ``N``):
``model.N``; ``optimizer.state.N.<key>`` (moments sharded like the param, the
step replicated); ``optimizer.main.N`` (fp32 main params of 16-bit params);
``optimizer.param_groups``, ``optimizer.grad_scaler``, ``lr_scheduler``,
``engine``, ``client``, ``meta``: small objects; ``fp8.<linear>.amax_history`` / ``.scale``: the delayed
fp8 recipe's state (``fp8_scaling``), replicated.

Needs our optimizer path (a ``MegatronOptimizer``) and our GPT (``GPTModel`` or a
``GPTPipelineModule`` stage) whose tensors are its parameters (``moe_grouped_gemm``
keeps experts in stacked weights: refused).  ``check_supported`` says so before training.

DCP is imported when a checkpoint is written or read, not with this module: it takes ~1.7 s of every rank's
start-up (``torch.distributed.tensor`` and sympy come with it).
"""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Tuple

import torch

if TYPE_CHECKING:  # annotations only: DCP itself is imported when used (see the module docstring)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

from ..convert.model_io import model_tensors
from ..fp8.param import is_fp8_param
from ..integration.seams import engine_counters, set_engine_counters
from ..models import GPTConfig
from ..optimizer import MegatronOptimizer
from .fp8_scaling import PREFIX as FP8_PREFIX, load_scaling_tensors, scaling_tensors
from .global_shards import GlobalShard, RankCoordinates, global_shards
from .rng import saved_layout

FORMAT_VERSION = 1
METADATA_FILE = ".metadata"  # what DCP writes last, on the coordinator: its presence marks a complete save


class CheckpointFormatError(ValueError):
    """The job or the checkpoint cannot use the layout-independent format; the message names the fix."""


def is_dist_checkpoint(tag_dir: str) -> bool:
    return os.path.isfile(os.path.join(tag_dir, METADATA_FILE))


class _Shards:
    """This rank's blocks of one global tensor, for DCP's planners (write items on save, chunks on load)."""

    def __init__(self, global_shape: Tuple[int, ...]):
        self.global_shape = torch.Size(global_shape)
        self.blocks: Dict[Tuple[int, ...], torch.Tensor] = {}

    def add(self, offsets: Tuple[int, ...], block: torch.Tensor) -> None:
        self.blocks[tuple(offsets)] = block

    def size(self) -> torch.Size:  # DCP compares this with the saved size at load
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=block.size()),
                              properties=TensorProperties(dtype=block.dtype), size=self.global_shape))
                for offsets, block in self.blocks.items()]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=block.size())
                for offsets, block in self.blocks.items()]

    def block(self, offsets) -> torch.Tensor:
        return self.blocks[tuple(offsets)]


def _lookup(state_dict: Dict[str, Any], index: MetadataIndex):
    obj = state_dict[index.fqn]
    return obj.block(index.offset) if isinstance(obj, _Shards) else None


@functools.lru_cache(maxsize=None)
def _planners():
    """DCP's default save and load planners, finding our ``_Shards``' blocks (made on first use, with DCP)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def lookup_object(self, index: MetadataIndex) -> Any:
            found = _lookup(self.state_dict, index)
            return found if found is not None else super().lookup_object(index)

    class LoadPlanner(DefaultLoadPlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
            # The default set-up rebuilds the dict through a walk that turns objects it does not know (ours) into
            # None; it only materialises meta-device tensors, which we never pass.
            super().set_up_planner({}, metadata, is_coordinator)
            self.original_state_dict = self.state_dict = state_dict

        def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
            found = _lookup(self.state_dict, index)
            return found if found is not None else super().lookup_tensor(index)

    return SavePlanner, LoadPlanner


def check_supported(engine) -> None:
    """Refuse, before training, a job whose state this format cannot hold."""
    module = engine.module
    if not isinstance(getattr(module, "config", None), GPTConfig):
        raise CheckpointFormatError("megatron.train.ckpt_format \"torch_dist\" saves ds_megatron's GPT (GPTModel or "
                                    f"GPTPipelineModule), not {type(module).__name__}; use ckpt_format \"deepspeed\"")
    if not isinstance(engine.optimizer, MegatronOptimizer):
        raise CheckpointFormatError("megatron.train.ckpt_format \"torch_dist\" needs ds_megatron's optimizer path "
                                    f"(got {type(engine.optimizer).__name__}); set megatron.optimizer_impl "
                                    "\"megatron\" without a DeepSpeed optimizer section, or ckpt_format \"deepspeed\"")
    _param_shards(module, engine.megatron.state)


ViewShards = List[Tuple[Callable[[torch.Tensor], torch.Tensor], List[GlobalShard]]]


def _same_view(view: torch.Tensor, param: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function that cuts ``view`` out of ``param``, applied to another contiguous tensor of its shape
    (a moment, a main param): GroupedMLP's experts are transposed slices of stacked weights."""
    if view is param:
        return lambda t: t
    if not param.is_contiguous():
        raise CheckpointFormatError("a parameter holding several checkpoint tensors is not contiguous; use "
                                    "megatron.train.ckpt_format \"deepspeed\"")
    size, stride, offset = view.size(), view.stride(), view.storage_offset() - param.storage_offset()

    def cut(t: torch.Tensor) -> torch.Tensor:
        if not t.is_contiguous():  # never a load target: those are the parameter or buffers made here
            t = t.contiguous()
        return t.as_strided(size, stride, t.storage_offset() + offset)
    return cut


def _param_shards(module, parallel_state) -> Dict[int, Tuple[torch.nn.Parameter, ViewShards]]:
    """id(param) -> (param, [(how to cut a tensor out of it, that tensor's global shards)]), for every
    parameter of the module (``model_tensors`` names; a stacked expert weight holds several)."""
    config = module.config
    coords = RankCoordinates.of(parallel_state)
    params = {id(p): p for p in module.parameters()}
    out: Dict[int, Tuple[torch.nn.Parameter, ViewShards]] = {}
    for name, tensor in model_tensors(module).items():
        param = params.get(id(tensor))
        if param is None and tensor._base is not None:  # a view (GroupedMLP's experts): of which parameter
            param = params.get(id(tensor._base))
        if param is None:
            raise CheckpointFormatError(f"{name} is not held by a parameter of the model; use "
                                        "megatron.train.ckpt_format \"deepspeed\"")
        split = bool(getattr(param, "tensor_model_parallel", False)) and tensor is param
        shards = global_shards(config, name, tuple(tensor.shape), split, coords)
        out.setdefault(id(param), (param, []))[1].append((_same_view(tensor, param), shards))
    missing = [n for n, p in module.named_parameters() if id(p) not in out]
    if missing:
        raise CheckpointFormatError(f"parameters {missing[:3]} have no place in the one-rank model; use "
                                    "megatron.train.ckpt_format \"deepspeed\"")
    return out


def _add_sharded(state: Dict[str, Any], prefix: str, tensor: torch.Tensor, views: ViewShards,
                 suffix: str = "") -> None:
    """Every tensor cut out of ``tensor`` (a parameter, or a state tensor of its shape) under
    ``prefix + its one-rank name + suffix``, each as its global shards."""
    for cut, shards in views:
        local = cut(tensor.detach())
        for s in shards:
            entry = state.setdefault(f"{prefix}{s.name}{suffix}", _Shards(s.global_shape))
            entry.add(s.offsets, local[s.local_rows[0]:s.local_rows[1]])


def _expert_biases(module) -> Dict[str, torch.Tensor]:
    """The routers' aux-loss-free ``expert_bias`` buffers under their one-rank names (``model.`` + name): fp32,
    the same on every rank of a stage (every layout routes over all experts), so saved whole."""
    to_gpt = getattr(module, "gpt_name", lambda name: name)
    return {f"model.{to_gpt(name)}": b for name, b in module.named_buffers()
            if name.endswith("router.expert_bias") and b is not None}


def _names(views: ViewShards) -> List[str]:
    """The one-rank names of the tensors cut out of a parameter (none: all vocab padding)."""
    return sorted({s.name for _, shards in views for s in shards})


def save(engine, directory: str, client_state: Dict[str, Any]) -> None:
    """Write the engine's whole training state to ``directory`` (collective: every rank of the job)."""
    module, optimizer = engine.module, engine.optimizer
    by_param = _param_shards(module, engine.megatron.state)
    state: Dict[str, Any] = {}
    saved = optimizer.state_dict()  # the distributed optimizer gathers here (a collective)
    groups, float16_groups = optimizer.state_dict_params()
    mains = saved.get("fp32_from_fp16_params", [[] for _ in float16_groups])
    main_of = {id(p): main for params, group in zip(float16_groups, mains) for p, main in zip(params, group)}
    for param, views in by_param.values():
        # fp8_param_gather: a weight's fp8 bytes are not its value; its 16-bit value is its main param rounded
        # (what the same run without fp8_param_gather holds), so the checkpoint does not depend on the setting.
        value = main_of[id(param)].view(param.shape).to(param.fp8_model_dtype) if is_fp8_param(param) else param
        _add_sharded(state, "model.", value, views)
    state.update({key: bias.detach().clone() for key, bias in _expert_biases(module).items()})
    state.update(scaling_tensors(module))  # the delayed fp8 recipe's, agreed by the weight's holders: replicated
    for index, param in enumerate(p for group in groups for p in group):
        views = by_param[id(param)][1]
        for name, value in saved["optimizer"]["state"].get(index, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                _add_sharded(state, "optimizer.state.", value.view(param.shape), views, f".{name}")
            else:  # the step count: the same for every tensor cut out of the param
                for key in _names(views):
                    state[f"optimizer.state.{key}.{name}"] = value
    for params, group_mains in zip(float16_groups, mains):
        for param, main in zip(params, group_mains):
            _add_sharded(state, "optimizer.main.", main.view(param.shape), by_param[id(param)][1])
    state["optimizer.param_groups"] = [{k: v for k, v in group.items() if k != "params"}
                                       for group in saved["optimizer"]["param_groups"]]
    if "grad_scaler" in saved:
        state["optimizer.grad_scaler"] = saved["grad_scaler"]
    if engine.lr_scheduler is not None:
        state["lr_scheduler"] = engine.lr_scheduler.state_dict()
    state["engine"] = engine_counters(engine)
    state["client"] = dict(client_state)
    state["meta"] = {"version": FORMAT_VERSION, "layout": saved_layout(engine.megatron.state)}
    import torch.distributed.checkpoint as dcp
    dcp.save(state, checkpoint_id=directory, planner=_planners()[0]())


def load(engine, directory: str) -> Dict[str, Any]:
    """Read ``directory`` (saved by ``save`` at any layout) into the engine; returns the client state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    module, optimizer = engine.module, engine.optimizer
    reader = dcp.FileSystemReader(directory)
    saved_md = reader.read_metadata().state_dict_metadata
    by_param = _param_shards(module, engine.megatron.state)
    state: Dict[str, Any] = {}

    def expect(key: str, shape: torch.Size) -> None:
        md = saved_md.get(key)
        if md is None:
            raise CheckpointFormatError(f"{directory} has no tensor {key}: it was saved from another model (the "
                                        "config's model section must match the checkpoint's)")
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(shape):
            raise CheckpointFormatError(f"{directory}: {key} has shape {tuple(getattr(md, 'size', ()))}, this "
                                        f"model's is {tuple(shape)}; build the model from the checkpoint's config")

    def add(prefix: str, tensor: torch.Tensor, views: ViewShards, suffix: str = "") -> None:
        before = set(state)
        _add_sharded(state, prefix, tensor, views, suffix)
        for key in set(state) - before:
            expect(key, state[key].global_shape)

    for param, views in by_param.values():
        # read straight into the parameters; an fp8 weight's 16-bit value is read aside (the optimizer's load casts
        # its main params into the bytes)
        add("model.", torch.empty(param.shape, dtype=param.fp8_model_dtype) if is_fp8_param(param) else param, views)
    biases = _expert_biases(module)
    for key, bias in biases.items():
        expect(key, bias.shape)
        state[key] = bias  # read straight into the buffer
    if not biases and any(k.endswith("router.expert_bias") for k in saved_md):
        raise CheckpointFormatError(f"{directory} holds the routers' expert_bias but this model has none; set "
                                    "model.moe_router_enable_expert_bias as the checkpoint's job did")
    fp8 = {key: torch.zeros(tuple(md.size), dtype=md.properties.dtype) for key, md in saved_md.items()
           if key.startswith(FP8_PREFIX) and isinstance(md, TensorStorageMetadata)}
    state.update(fp8)  # every stage's: load_scaling_tensors takes this rank's layers and checks the history length
    groups, float16_groups = optimizer.state_dict_params()
    moments: Dict[int, Dict[str, Any]] = {}  # state index -> {name: buffer, or the key of a replicated value}
    for index, param in enumerate(p for group in groups for p in group):
        views = by_param[id(param)][1]
        names = _names(views)
        if not names:
            continue
        prefix = f"optimizer.state.{names[0]}."
        for key, md in saved_md.items():
            name = key[len(prefix):]
            if not key.startswith(prefix) or "." in name:
                continue
            if isinstance(md, TensorStorageMetadata) and len(md.size) > 0:
                buffer = torch.zeros(param.shape, dtype=md.properties.dtype)
                add("optimizer.state.", buffer, views, f".{name}")
                moments.setdefault(index, {})[name] = buffer
            else:
                state.setdefault(key, torch.zeros(md.size, dtype=md.properties.dtype)
                                 if isinstance(md, TensorStorageMetadata) else None)
                moments.setdefault(index, {})[name] = key
    mains: List[List[torch.Tensor]] = []
    for params in float16_groups:
        mains.append([])
        for param in params:
            buffer = torch.zeros(param.shape, dtype=torch.float32)
            add("optimizer.main.", buffer, by_param[id(param)][1])
            mains[-1].append(buffer)
    objects = ["optimizer.param_groups", "client", "engine", "meta"]
    objects += [k for k in ("optimizer.grad_scaler", "lr_scheduler") if k in saved_md]
    for key in objects:
        if not isinstance(saved_md.get(key), BytesStorageMetadata):
            raise CheckpointFormatError(f"{directory} has no {key}: not a ds_megatron torch_dist checkpoint")
        state[key] = None
    dcp.load(state, storage_reader=reader, planner=_planners()[1]())

    if state["meta"].get("version") != FORMAT_VERSION:
        raise CheckpointFormatError(f"{directory}: format version {state['meta'].get('version')}, this ds_megatron "
                                    f"reads version {FORMAT_VERSION}")
    saved_groups = state["optimizer.param_groups"]
    if len(saved_groups) != len(groups):
        raise CheckpointFormatError(f"{directory}: {len(saved_groups)} optimizer param groups, this job has "
                                    f"{len(groups)}; use the same weight-decay grouping")
    inner_state = {index: {name: (state[v].clone() if torch.is_tensor(state[v]) else state[v])
                           if isinstance(v, str) else v for name, v in entries.items()}
                   for index, entries in moments.items()}
    start, param_groups = 0, []
    for saved_group, params in zip(saved_groups, groups):
        param_groups.append({**saved_group, "params": list(range(start, start + len(params)))})
        start += len(params)
    standard: Dict[str, Any] = {"optimizer": {"state": inner_state, "param_groups": param_groups}}
    if any(float16_groups):
        standard["fp32_from_fp16_params"] = mains
    if optimizer.grad_scaler is not None:
        if "optimizer.grad_scaler" not in state:
            raise CheckpointFormatError(f"{directory} has no loss-scaler state but this job scales the loss; "
                                        "resume with the precision the checkpoint was saved with")
        standard["grad_scaler"] = state["optimizer.grad_scaler"]
    optimizer.load_state_dict(standard)
    if engine.lr_scheduler is not None and "lr_scheduler" in state:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    set_engine_counters(engine, state["engine"])
    load_scaling_tensors(module, fp8, directory)
    return state["client"]
