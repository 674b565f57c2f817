"""``DistributedOptimizer``: Megatron's distributed optimizer (fp32 main params and optimizer state sharded over DP).

Every bucket of a distributed-optimizer ``ParamAndGradBuffer`` splits into DP
equal, contiguous shards; DP rank ``r`` owns shard ``r`` of every bucket,
regardless of param boundaries (a param may be cut between ranks).  The rank
owns, for those elements only:

* the reduced gradient: the DDP's reduce-scatter leaves it in the rank's shard
  of the grad buffer;
* the fp32 ``main_param`` (a new fp32 tensor for fp16/bf16 params, a view of
  the param buffer for fp32 params) and the inner optimizer's state (Adam's
  moments), which therefore take 1/DP of the memory of the non-distributed
  optimizer;
* the update: after the inner step its main shards are written into its shard
  of the param buffer and the buckets are all-gathered, so every rank ends with
  the full updated params (with ``overlap_param_gather`` the all-gather runs
  while the next forward starts; forward pre-hooks of the DDP wait for each
  bucket group just before its params are used).

The range maps are Megatron's: per buffer, per bucket, ``{"param_map": {param:
{"gbuf_world", "gbuf_world_in_bucket", "gbuf_local", "param"}}}`` (see
``distributed.buffer_layout.bucket_shard_param_ranges``), the reverse map
``model_param_gbuf_map[param] = (gbuf_index, (param_dtype, grad_dtype),
bucket_index)``, and the optimizer group ranges that keep every original param
group (possibly empty on a rank) so that group indices agree on every rank.

Grad scaling, the inf/nan skip and clipping work as in the non-distributed
wrappers, but each rank sees only its shards: ``found_inf``, the squared-norm
sum and the zero count are therefore reduced over the whole job (each element
is owned by exactly one DP rank of its model-parallel coordinate, and TP
duplicates are counted on TP rank 0 only).

With ``fp8_param_gather`` the fp8 layers' weights are fp8 bytes in a uint8 buffer: their main params start
from the 16-bit values they had (``fp8.param``), and after each step (and a load) this rank's main shards of them
are cast into the buffer with each whole weight's scale, agreed over DP and TP (an expert's over expert-DP and
ETP), before the all-gather.

Checkpoints: ``state_dict`` gathers the shards into the non-distributed
format, full per-param tensors keyed by the param's position in the original
param groups (what ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer``
save), so a checkpoint does not depend on the DP size: ``load_state_dict``
cuts the current rank's shards out of it for any DP size, and a checkpoint can
move between the distributed and the non-distributed optimizer.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..distributed.buffer_layout import Range, bucket_shard_param_ranges
from ..fp8.param import FP8_PARAM_DTYPE, FP8ParamCast, is_fp8_param, release_init_value
from ..parallel_state import ParallelGroup, ParallelState
from ..tensor_parallel.params import is_expert_param, param_is_not_tensor_parallel_duplicate
from ..utils.collectives import all_gather_into, all_gather_object
from .clip_grads import count_zeros_fp32
from .grad_scaler import MegatronGradScaler
from .megatron_optimizer import _FLOAT16, _PARAM_ATTRIBUTES, MegatronOptimizer

MAIN_PARAM = "main_param"  # key of the fp32 main param among a param's gathered tensors


def _has_main_param(param: torch.Tensor) -> bool:
    """fp16 / bf16 params and fp8 ones (``fp8_param_gather``) have fp32 main params; fp32 params are their own."""
    return param.dtype in _FLOAT16 or is_fp8_param(param)


class DistributedOptimizer(MegatronOptimizer):
    """``DistributedOptimizer(optimizer, model_chunks, clip_grad, log_num_zeros_in_grad, grad_scaler, parallel_state)``.

    ``optimizer``: a fresh torch optimizer (no state yet) over the model params;
    ``model_chunks``: the ``DistributedDataParallel`` wrappers (built with
    ``use_distributed_optimizer=True``) whose buffers hold those params.  The
    inner optimizer is rebuilt in place to step this rank's shards only; its
    param-group dicts stay the same objects, so LR schedulers built on it keep working.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model_chunks: Sequence[Any], clip_grad: float = 0.0,
                 log_num_zeros_in_grad: bool = False, grad_scaler: Optional[MegatronGradScaler] = None,
                 parallel_state: Optional[ParallelState] = None):
        if parallel_state is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("DistributedOptimizer needs the job's parallel_state: its shards, norms and inf checks "
                             "span every rank")
        super().__init__(optimizer, clip_grad, log_num_zeros_in_grad, parallel_state, model_chunks)
        if not self.model_chunks:
            raise ValueError("model_chunks is empty; pass the DistributedDataParallel wrapper(s) of the model")
        for chunk in self.model_chunks:
            if not chunk.ddp_config.use_distributed_optimizer:
                raise ValueError("a model chunk's DistributedDataParallelConfig has use_distributed_optimizer=False, "
                                 "so its buffers are not padded for sharding and grads are all-reduced; build the "
                                 "DDP with use_distributed_optimizer=True")
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError("the optimizer already has state; wrap a fresh optimizer and restore state afterwards "
                             "with load_state_dict (the state is resharded there)")
        self.ddp_config = self.model_chunks[0].ddp_config
        self.buffers = [buffer for chunk in self.model_chunks for buffer in chunk.all_buffers]
        self.grad_scaler = grad_scaler
        # Ranks hold different shards, so inf/nan flags, norms and zero counts are reduced over the whole job.
        self.grad_stats_parallel_group = self.parallel_state.world
        self.found_inf_groups = [self.grad_stats_parallel_group]

        # Original groups, before their params are replaced by shards: the checkpoint is keyed by these.
        self.model_params_in_groups: List[List[torch.nn.Parameter]] = [list(g["params"]) for g in optimizer.param_groups]
        self._check_params_match_buffers()
        if grad_scaler is None and any(p.dtype == torch.float16 for g in self.model_params_in_groups for p in g):
            raise ValueError("fp16 params need a grad scaler (fp16 gradients underflow without loss scaling); "
                             "pass a ConstantGradScaler or DynamicGradScaler")

        self.gbuf_ranges = [self._build_gbuf_range_map(buffer) for buffer in self.buffers]
        self.model_param_gbuf_map = self._build_model_param_gbuf_map(self.gbuf_ranges)
        self.model_param_group_index_map, self.opt_group_ranges = self._build_optimizer_group_ranges(
            optimizer.param_groups, self.gbuf_ranges)
        (self.model_float16_groups, self.model_fp32_groups, self.shard_float16_groups, self.shard_fp32_groups,
         self.shard_fp32_from_float16_groups) = self._build_model_and_main_param_groups(self.opt_group_ranges)
        # Same dicts (hyperparameters, LR-scheduler fields), params now this rank's shards.
        self.optimizer.param_groups = [g["orig_group"] for g in self.opt_group_ranges]

        device = self.buffers[0].grad_data.device if self.buffers else torch.device("cpu")
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        # Fixed views for the multi-tensor ops of a step: each shard's slice of its param's grad
        # (main_grad) and of its bucket's param buffer (where the updated 16-bit shard is written).
        self._shard_grad_view: Dict[int, torch.Tensor] = {}
        self._model_shard_views: List[torch.Tensor] = []
        self._main_shards: List[torch.Tensor] = []
        self._model_param_shard_views: List[torch.Tensor] = []
        for model_param, shard in self._local_pairs():
            r = self._get_model_param_range_map(model_param)["param"]
            self._shard_grad_view[id(shard)] = model_param.main_grad.view(-1)[r.start:r.end]
        # fp8_param_gather: the fp8 weights of the buffers by the groups their cast agrees over (the same list on
        # every rank of those groups), with this rank's main shards of them and their fp8 slots in the param buffer.
        fp8_params: Dict[Tuple[ParallelGroup, ParallelGroup], List[torch.nn.Parameter]] = {}
        for buffer in self.buffers:
            if buffer.param_dtype == torch.uint8:
                split = self.parallel_state.etp if is_expert_param(buffer.params[0]) else self.parallel_state.tp
                fp8_params.setdefault((buffer.data_parallel_group, split), []).extend(buffer.params)
        self._fp8_casts = [FP8ParamCast(params, groups) for groups, params in fp8_params.items()]
        fp8_cast_of = {p: c for c in self._fp8_casts for p in c.params}
        for model_group, shard_group in zip(self.model_float16_groups, self.shard_fp32_from_float16_groups):
            for model_param, shard_main_param in zip(model_group, shard_group):
                world_range = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_index = self.model_param_gbuf_map[model_param]
                bucket_param_data = self.buffers[gbuf_index].buckets[bucket_index].param_data
                view = bucket_param_data[world_range.start:world_range.end]
                r = self._get_model_param_range_map(model_param)["param"]
                if model_param in fp8_cast_of:
                    fp8_cast_of[model_param].add(model_param, r.start, shard_main_param, view.view(FP8_PARAM_DTYPE))
                    continue
                self._model_shard_views.append(view)
                self._main_shards.append(shard_main_param)
                self._model_param_shard_views.append(model_param.detach().view(-1)[r.start:r.end])
        if fp8_cast_of:
            # The 16-bit values are in the main params now; the first fp8 bytes and scales come from them.
            for p in fp8_cast_of:
                release_init_value(p)
            self._copy_main_params_to_model_params()
            self.start_param_sync(force_sync=True)

    # -- construction --------------------------------------------------------------------------------
    def _check_params_match_buffers(self) -> None:
        buffered = {p for buffer in self.buffers for p in buffer.params}
        in_groups = [p for g in self.model_params_in_groups for p in g]
        missing = [p for p in in_groups if p not in buffered]
        if missing:
            raise ValueError(f"{len(missing)} optimizer param(s) (first of shape {tuple(missing[0].shape)}) are in no "
                             "grad buffer of model_chunks; build the optimizer over the wrapped model's params")
        unoptimized = buffered - set(in_groups)
        if unoptimized:
            p = next(iter(unoptimized))
            raise ValueError(f"{len(unoptimized)} buffered param(s) (e.g. of shape {tuple(p.shape)}) are in no "
                             "optimizer param group, so their owner rank would never update them; give the "
                             "optimizer every trainable param (or freeze the rest before wrapping in DDP)")

    @classmethod
    def _build_model_gbuf_range(cls, buffer, bucket_index: int) -> Dict[str, Any]:
        """This rank's ranges for the params of one bucket that overlap its shard (Megatron's four ranges)."""
        dp_rank = buffer.data_parallel_group.rank
        by_position = bucket_shard_param_ranges(buffer.layout, bucket_index, dp_rank)
        param_map = {buffer.params[i]: {"gbuf_world": r.gbuf_world, "gbuf_world_in_bucket": r.gbuf_world_in_bucket,
                                        "gbuf_local": r.gbuf_local, "param": r.param}
                     for i, r in by_position.items()}
        return {"param_map": param_map}

    @classmethod
    def _build_gbuf_range_map(cls, buffer) -> Dict[Tuple[torch.dtype, torch.dtype], List[Dict[str, Any]]]:
        return {(buffer.param_dtype, buffer.grad_dtype): [cls._build_model_gbuf_range(buffer, b)
                                                          for b in range(len(buffer.buckets))]}

    @classmethod
    def _build_model_param_gbuf_map(cls, gbuf_ranges) -> Dict[torch.nn.Parameter, Tuple[int, Any, int]]:
        """param -> (gbuf_index, (param_dtype, grad_dtype), bucket_index), for this rank's params only."""
        out = {}
        for gbuf_index, by_dtype in enumerate(gbuf_ranges):
            for dtype, buckets in by_dtype.items():
                for bucket_index, bucket_range in enumerate(buckets):
                    for param in bucket_range["param_map"]:
                        if param in out:
                            raise AssertionError("a param appears in two buckets; a param is never split across them")
                        out[param] = (gbuf_index, dtype, bucket_index)
        return out

    @classmethod
    def _build_optimizer_group_ranges(cls, param_groups, gbuf_ranges):
        """(param -> (group_index, index in group), one range per original group with this rank's params).

        Every original group gets a range, empty or not, so group i means the
        same hyperparameters on every rank.
        """
        world_param_group_map = {p: i for i, group in enumerate(param_groups) for p in group["params"]}
        local_param_group_map = {}
        group_ranges = [{"params": [], "orig_group": group, "orig_group_idx": i}
                        for i, group in enumerate(param_groups)]
        for by_dtype in gbuf_ranges:
            for buckets in by_dtype.values():
                for bucket_range in buckets:
                    for param in bucket_range["param_map"]:
                        group_index = world_param_group_map[param]
                        params = group_ranges[group_index]["params"]
                        params.append(param)
                        local_param_group_map[param] = (group_index, len(params) - 1)
        return local_param_group_map, group_ranges

    def _get_model_param_range_map(self, param: torch.nn.Parameter) -> Dict[str, Range]:
        gbuf_index, dtype, bucket_index = self.model_param_gbuf_map[param]
        return self.gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][param]

    def _build_model_and_main_param_groups(self, opt_group_ranges):
        """This rank's model params and their shards, per group; fp32 main shards for fp16/bf16 params."""
        model_float16_groups, model_fp32_groups = [], []
        shard_float16_groups, shard_fp32_groups, shard_fp32_from_float16_groups = [], [], []
        for group_range in opt_group_ranges:
            model_float16, model_fp32, shard_float16, shard_fp32, shard_main = [], [], [], [], []
            for model_param in group_range["params"]:
                r = self._get_model_param_range_map(model_param)["param"]
                # A view of the param buffer (params live there with the distributed optimizer).
                shard_model_param = model_param.detach().view(-1)[r.start:r.end]
                for name in _PARAM_ATTRIBUTES:
                    if hasattr(model_param, name):
                        setattr(shard_model_param, name, getattr(model_param, name))
                if _has_main_param(model_param):
                    # An fp8 weight's main param starts from the 16-bit value it had before it became bytes.
                    if is_fp8_param(model_param) and not hasattr(model_param, "fp8_init_value"):
                        raise ValueError("an fp8 weight's 16-bit value went to an earlier DistributedOptimizer's "
                                         "main params; build one optimizer over a fresh DistributedDataParallel")
                    value = model_param.fp8_init_value if is_fp8_param(model_param) else model_param.detach()
                    shard_main_param = value.reshape(-1)[r.start:r.end].clone().float()
                    for name in _PARAM_ATTRIBUTES:
                        if hasattr(model_param, name):
                            setattr(shard_main_param, name, getattr(model_param, name))
                    model_param.main_param = shard_main_param
                    model_param.main_param_sharded = True
                    model_float16.append(model_param)
                    shard_float16.append(shard_model_param)
                    shard_main.append(shard_main_param)
                elif model_param.dtype == torch.float32:
                    # The inner optimizer updates the param buffer in place: no copy back needed.
                    model_fp32.append(model_param)
                    shard_fp32.append(shard_model_param)
                else:
                    raise TypeError(f"wrapped parameters must be float16, bfloat16 or float32; got {model_param.dtype}")
            model_float16_groups.append(model_float16)
            model_fp32_groups.append(model_fp32)
            shard_float16_groups.append(shard_float16)
            shard_fp32_groups.append(shard_fp32)
            shard_fp32_from_float16_groups.append(shard_main)
            group_range["orig_group"]["params"] = [*shard_fp32, *shard_main]
        return (model_float16_groups, model_fp32_groups, shard_float16_groups, shard_fp32_groups,
                shard_fp32_from_float16_groups)

    # -- the group list is fixed by the sharding -------------------------------------------------------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        # A fresh list of the same group dicts: a rank may own no param of some group and must still
        # keep it, but DeepSpeed drops empty groups from a client optimizer's list in place
        # (engine._configure_optimizer), which would misalign group indices between ranks.
        return list(self.optimizer.param_groups)

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.optimizer.param_groups = value

    def _local_pairs(self):
        """(model param, its fp32 shard the inner optimizer steps), over all groups."""
        for model_group, shard_group in zip(self.model_float16_groups, self.shard_fp32_from_float16_groups):
            yield from zip(model_group, shard_group)
        for model_group, shard_group in zip(self.model_fp32_groups, self.shard_fp32_groups):
            yield from zip(model_group, shard_group)

    def main_param_tensors(self) -> List[torch.Tensor]:
        return [p for group in self.shard_fp32_from_float16_groups for p in group]

    # -- norm, zeros: over shards, so over the whole job --------------------------------------------------
    def _norm_partitions(self, params: List[torch.Tensor]) -> List[Tuple[ParallelGroup, List[int]]]:
        # Each element is owned by one DP rank of its model-parallel coordinate: sum over the whole job
        # (a ``shared`` copy, PP's last-stage tied embedding, not at all: the first stage's counts).
        counted = [i for i, p in enumerate(params)
                   if param_is_not_tensor_parallel_duplicate(p, self.tp_rank) and not getattr(p, "shared", False)]
        return [(self.grad_stats_parallel_group, counted)]

    def count_zeros(self) -> int:
        return count_zeros_fp32(self.get_parameters(), self.grad_stats_parallel_group, self.tp_rank)

    # -- the step ---------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model and shard grads (the grad buffers themselves are zeroed by the DDP)."""
        for model_param, shard in self._local_pairs():
            for t in (model_param, shard):
                if set_to_none:
                    t.grad = None
                elif t.grad is not None:
                    t.grad.detach_().zero_()
        self._grads_bound = False

    def _fixed_main_grads(self, params: List[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """Each shard's grad is this rank's reduced slice of its param's ``main_grad`` (after the DDP's
        reduce-scatter only this rank's shard of each bucket holds reduced values, which is what is read)."""
        views = [self._shard_grad_view[id(p)] for p in params]
        return views if all(v.dtype == torch.float32 for v in views) else None

    def _rebind_indices(self, params: List[torch.Tensor]) -> List[int]:
        return []  # shards are this wrapper's own tensors: nobody else clears their .grad

    def _gather_main_grads(self, params: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        for p in params:  # 16-bit grads reduced in 16 bits: fp32 copies every step
            p.grad = self._shard_grad_view[id(p)].float()
        return [p.grad for p in params]

    def _release_main_grads(self) -> None:
        if self._plan().fixed_grads is None:
            for p in self.get_parameters():
                p.grad = None

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        """Write the updated fp32 main shards of fp16/bf16 params into this rank's shard of the param buffer; fp8
        weights' shards are cast to fp8 with each whole weight's scale (``fp8.param.FP8ParamCast``)."""
        if self._main_shards:
            torch._foreach_copy_(self._model_shard_views, self._main_shards)
        for fp8_cast in self._fp8_casts:
            fp8_cast.cast()

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather every bucket's updated shards (async with ``overlap_param_gather`` unless ``force_sync``)."""
        for chunk in self.model_chunks:
            chunk.start_param_sync(force_sync=force_sync)

    def finish_param_sync(self) -> None:
        for chunk in self.model_chunks:
            chunk.finish_param_sync()

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Megatron's: the step on this rank's shards, then the params all-gathered (a skipped step gathers
        nothing: it never gets here)."""
        super().step_with_ready_grads()
        self.start_param_sync()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 main shards from the model params (after loading model weights only)."""
        if self._fp8_casts:
            raise ValueError("fp8_param_gather: the fp8 weights are casts of the fp32 main params, not their source; "
                             "load the optimizer state with the weights (a full resume) or drop fp8_param_gather")
        if self._main_shards:
            torch._foreach_copy_(self._main_shards, self._model_param_shard_views)

    # -- checkpoints --------------------------------------------------------------------------------------
    def state_dict_params(self) -> Tuple[List[torch.nn.Parameter], List[List[torch.nn.Parameter]]]:
        return ([list(group) for group in self.model_params_in_groups],
                [[p for p in group if _has_main_param(p)] for group in self.model_params_in_groups])

    def _flat_index(self) -> Dict[torch.nn.Parameter, int]:
        params = [p for group in self.model_params_in_groups for p in group]
        return {p: i for i, p in enumerate(params)}

    def _shard_of(self) -> Dict[torch.nn.Parameter, torch.Tensor]:
        return dict(self._local_pairs())

    def _gather_buffer_states(self, gbuf_index: int, flat_index, shards) -> Dict[torch.nn.Parameter, Dict[str, Any]]:
        """Full per-param tensors (fp32 main param, inner-state tensors) and scalars of one buffer's params."""
        buffer = self.buffers[gbuf_index]
        group, size = buffer.data_parallel_group, buffer.data_parallel_world_size
        (bucket_ranges,) = self.gbuf_ranges[gbuf_index].values()
        # Which state entries are shard-shaped (gathered elementwise) and which are per-param scalars
        # (Adam's step): the same optimizer on every rank, but a rank may own nothing yet.
        local_keys, scalars = set(), {}
        for bucket_range in bucket_ranges:
            for param in bucket_range["param_map"]:
                state = self.optimizer.state.get(shards[param], {})
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() == 1 and value.numel() == shards[param].numel():
                        local_keys.add(key)
                    else:
                        scalars.setdefault(flat_index[param], {})[key] = value
        keys_and_scalars = all_gather_object((sorted(local_keys), scalars), group)
        keys = sorted(set().union(*(k for k, _ in keys_and_scalars)))
        if buffer.param_dtype in _FLOAT16 or buffer.param_dtype == torch.uint8:
            keys = [MAIN_PARAM] + keys
        merged_scalars = {}
        for _, rank_scalars in keys_and_scalars:
            for index, values in rank_scalars.items():
                merged_scalars.setdefault(index, values)

        out: Dict[torch.nn.Parameter, Dict[str, Any]] = {p: {} for p in buffer.params}
        for bucket, bucket_range in zip(buffer.buckets, bucket_ranges):
            shard_numel = bucket.grad_data.numel() // size
            for key in keys:
                local = torch.zeros(shard_numel, dtype=torch.float32, device=bucket.grad_data.device)
                for param, ranges in bucket_range["param_map"].items():
                    shard = shards[param]
                    value = shard.detach() if key == MAIN_PARAM else self.optimizer.state.get(shard, {}).get(key)
                    if value is not None:
                        local[ranges["gbuf_local"].start:ranges["gbuf_local"].end].copy_(value)
                full = torch.empty(shard_numel * size, dtype=torch.float32, device=local.device)
                all_gather_into(full, local, group)
                for param in bucket.params_list:
                    start, end = bucket.param_to_index[param]
                    out[param][key] = full[start:end].view(param.shape).clone()
        for param in buffer.params:
            out[param].update(merged_scalars.get(flat_index[param], {}))
        return out

    @contextlib.contextmanager
    def gathered_state_dict(self):
        """Gather on every rank now; ``state_dict()`` inside the block returns that, with no collective.

        DeepSpeed's MoE checkpoint path asks only the expert-data-parallel writer
        ranks for ``state_dict()``; a collective there would wait for ranks that never come.
        """
        self._gathered_state = self.state_dict()
        try:
            yield self._gathered_state
        finally:
            self._gathered_state = None

    def state_dict(self) -> Dict[str, Any]:
        """The non-distributed optimizers' format, gathered from every DP rank (a collective: call on all ranks).

        ``{"optimizer": torch's {"state": {i: full tensors}, "param_groups": [...]},
        "fp32_from_fp16_params": [[full fp32 main params]], "grad_scaler": ...}``
        with ``i`` a param's position in the original param groups; nothing in it
        depends on the DP size.
        """
        if getattr(self, "_gathered_state", None) is not None:
            return self._gathered_state
        self.finish_param_sync()
        flat_index, shards = self._flat_index(), self._shard_of()
        gathered: Dict[torch.nn.Parameter, Dict[str, Any]] = {}
        for gbuf_index in range(len(self.buffers)):
            gathered.update(self._gather_buffer_states(gbuf_index, flat_index, shards))
        state = {}
        for param, index in flat_index.items():
            entries = {k: v for k, v in gathered[param].items() if k != MAIN_PARAM}
            if entries:
                state[index] = entries
        groups = []
        for group, params in zip(self.optimizer.param_groups, self.model_params_in_groups):
            saved = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            saved["params"] = [flat_index[p] for p in params]
            groups.append(saved)
        out: Dict[str, Any] = {"optimizer": {"state": state, "param_groups": groups}}
        if any(_has_main_param(p) for group in self.model_params_in_groups for p in group):
            out["fp32_from_fp16_params"] = [[gathered[p][MAIN_PARAM] for p in group if _has_main_param(p)]
                                            for group in self.model_params_in_groups]
        if self.grad_scaler is not None:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    def load_state_dict(self, state_dict: Dict[str, Any], load_optimizer_states: bool = True) -> None:
        """Load a gathered checkpoint (any DP size, distributed or not) and cut out this rank's shards."""
        inner = state_dict["optimizer"]
        saved_groups = inner["param_groups"]
        shape_saved = [len(g["params"]) for g in saved_groups]
        shape_ours = [len(g) for g in self.model_params_in_groups]
        if shape_saved != shape_ours:
            raise ValueError(f"the checkpoint's optimizer param groups hold {shape_saved} params, this model's "
                             f"{shape_ours}; resume with the same model, param groups and tensor/pipeline layout")
        main_saved = state_dict.get("fp32_from_fp16_params")
        if main_saved is None and self.main_param_tensors():
            raise KeyError("the checkpoint has no fp32_from_fp16_params but this model has fp16/bf16 params; "
                           "resume with the same precision it was saved with")
        saved_index, saved_main = {}, {}
        for g, (saved, params) in enumerate(zip(saved_groups, self.model_params_in_groups)):
            float16 = iter(main_saved[g]) if main_saved is not None else iter(())
            for index, param in zip(saved["params"], params):
                saved_index[param] = index
                if _has_main_param(param):
                    saved_main[param] = next(float16)
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = copy.deepcopy(value)

        state = inner["state"]
        for model_param, shard in self._local_pairs():
            r = self._get_model_param_range_map(model_param)["param"]
            saved = state.get(saved_index[model_param], state.get(str(saved_index[model_param])))
            self.optimizer.state.pop(shard, None)
            if saved:
                local = {}
                for key, value in saved.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        if value.numel() != model_param.numel():
                            raise ValueError(f"checkpoint state {key!r} of a param has {value.numel()} elements, the "
                                             f"param {model_param.numel()}; resume with the same model")
                        local[key] = value.detach().reshape(-1)[r.start:r.end].to(shard.device).clone()
                    else:
                        local[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
                self.optimizer.state[shard] = local
            if model_param in saved_main:
                shard.data.copy_(saved_main[model_param].reshape(-1)[r.start:r.end])
        if self.grad_scaler is not None:
            if "grad_scaler" not in state_dict:
                raise KeyError("the checkpoint has no grad_scaler state but this run uses a loss scaler; "
                               "resume with the same fp16 settings it was saved with")
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        # Model params from the fp32 main params (as after a step), gathered on every rank.
        self._copy_main_params_to_model_params()
        self.start_param_sync(force_sync=True)
