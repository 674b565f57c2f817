"""``DistributedDataParallel``: Megatron's DDP, gradients in contiguous buffers reduced bucket by bucket.

Wrapping a module allocates ``ParamAndGradBuffer``s for its trainable params
(dense params over the data-and-context-parallel group, expert params over the
expert-data-parallel group) and hooks each param so that after backward
accumulates ``param.grad`` it is added into ``param.main_grad`` and freed.
Over micro-batches the grads accumulate in ``main_grad`` (fp32 with
``grad_reduce_in_fp32``).  On the last micro-batch, with
``overlap_grad_reduce``, a bucket group's reduction starts as soon as all its
grads are in, while backward goes on; ``finish_grad_sync()`` waits for all of
them (and starts those not started).  ``no_sync()`` marks accumulation-only
micro-batches; ``zero_grad_buffer()`` clears the buffers for the next step.

With ``overlap_param_gather`` (distributed optimizer) the all-gather of the
updated params, started after the optimizer step, is waited for bucket group
by bucket group in forward pre-hooks of the modules that own the params, and
in a ``state_dict`` pre-hook (a checkpoint never reads half-gathered params).

With ``fp8_param_gather`` (distributed optimizer) the weights of the fp8 linears live in a uint8 buffer of their
own as fp8 bytes (``fp8.param``; the fp8 experts' in a uint8 expert buffer over expert-DP), grouped with the other
buffers' buckets as seed 004 says
(``bucket_group.partition_buckets``); their gradients are buffered as every other's.

Expert params are recognized by their marks (``tensor_parallel.params.is_expert_param``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional

import torch

from ..config.ddp import DistributedDataParallelConfig, default_bucket_size
from ..parallel_state import ParallelGroup, ParallelState
from ..tensor_parallel.layers import fp8_weights
from ..tensor_parallel.params import is_expert_param
from ..utils import collectives
from .bucket_group import ParamAndGradBucketGroup, partition_buckets
from .param_and_grad_buffer import ParamAndGradBuffer

_FLOAT16 = (torch.float16, torch.bfloat16)


class DistributedDataParallel(torch.nn.Module):
    """``DistributedDataParallel(module, ddp_config, parallel_state, disable_bucketing=False)``.

    ``parallel_state``: the job's ``ParallelState``; its ``dp_cp`` group reduces
    dense grads and its ``edp`` group expert grads.  ``expert_group``: the group
    an expert param is reduced over when it is not ours (DeepSpeed's MoE layer
    keeps its own expert-data-parallel groups); default ``edp`` for every expert.
    ``disable_bucketing``: one bucket group for everything (a single reduction at the end).
    """

    def __init__(self, module: torch.nn.Module, ddp_config: DistributedDataParallelConfig,
                 parallel_state: ParallelState, disable_bucketing: bool = False,
                 expert_group: Optional[Callable[[torch.nn.Parameter], ParallelGroup]] = None):
        super().__init__()
        self.module = module
        self.ddp_config = ddp_config
        dp_cp, edp = parallel_state.dp_cp, parallel_state.edp
        bucket_size = ddp_config.bucket_size
        if bucket_size is None:
            bucket_size = default_bucket_size(dp_cp.size)
        # Without overlap there is nothing to gain from splitting: one bucket, one collective.
        if not ddp_config.overlap_grad_reduce or disable_bucketing:
            bucket_size = None
        self.bucket_size = bucket_size

        param_to_name = {p: n for n, p in module.named_parameters()}
        # fp8_param_gather: the fp8 linears' and experts' weights go into uint8 buffers as fp8 bytes (seed 004)
        self.fp8_recipes = dict(fp8_weights(module)) if ddp_config.fp8_param_gather else {}
        if ddp_config.fp8_param_gather and not self._any_stage_has_fp8(parallel_state):
            raise ValueError("fp8_param_gather is true but the model has no fp8 linear layer (model.fp8 null, or "
                             "every layer kept in 16-bit); set model.fp8 or drop fp8_param_gather")
        dense: List[torch.nn.Parameter] = []
        experts: Dict[ParallelGroup, List[torch.nn.Parameter]] = {}
        for p in module.parameters():
            if p.requires_grad:
                if is_expert_param(p):
                    experts.setdefault(expert_group(p) if expert_group is not None else edp, []).append(p)
                else:
                    dense.append(p)

        # Grads of the global batch are the mean over dp-cp ranks' micro-batches.  Expert grads
        # already sum tokens routed from the whole expert-parallel group, so summing them
        # over their expert-data-parallel group and dividing by dp-cp gives the same mean
        # (Megatron's expert factor).
        def factor(group: ParallelGroup) -> float:
            return group.size / dp_cp.size if ddp_config.average_in_collective else 1.0 / dp_cp.size

        self.buffers = self._allocate_buffers(dense, dp_cp, 1.0 if ddp_config.average_in_collective
                                              else 1.0 / dp_cp.size, param_to_name)
        self.expert_parallel_buffers = [buffer for group, params in experts.items()
                                        for buffer in self._allocate_buffers(params, group, factor(group),
                                                                             param_to_name)]
        self.bucket_groups: List[ParamAndGradBucketGroup] = partition_buckets(
            self.buffers, force_single_bucket_group=disable_bucketing)
        self.expert_parallel_bucket_groups: List[ParamAndGradBucketGroup] = [
            group for params_group in experts
            for group in partition_buckets([b for b in self.expert_parallel_buffers
                                            if b.data_parallel_group == params_group],
                                           force_single_bucket_group=disable_bucketing)]
        # Set by finalize_model_grads when this window's sync (DP and model-parallel) is complete.
        self.grads_finalized = False
        self.param_to_bucket_group: Dict[torch.nn.Parameter, ParamAndGradBucketGroup] = {}
        for group in self.bucket_groups + self.expert_parallel_bucket_groups:
            for p in group.params:
                self.param_to_bucket_group[p] = group

        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_backward_post_hook(p))
                              for p in self.param_to_bucket_group]
        if ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather:
            for submodule in module.modules():
                if any(p in self.param_to_bucket_group for p in submodule.parameters(recurse=False)):
                    self._hook_handles.append(submodule.register_forward_pre_hook(self._make_forward_pre_hook()))
            self._hook_handles.append(module.register_state_dict_pre_hook(
                lambda *args, **kwargs: self.finish_param_sync()))

    def _any_stage_has_fp8(self, parallel_state: ParallelState) -> bool:
        """Whether some pipeline stage holds an fp8 linear: a stage whose layers all stay 16-bit
        (``first_last_layers_bf16``) has no fp8 buffer, as a model without fp8 layers would."""
        count = torch.tensor([float(len(self.fp8_recipes))], device=next(self.module.parameters()).device)
        collectives.all_reduce(count, parallel_state.pp, op=collectives.MAX)
        return count.item() > 0

    def _make_forward_pre_hook(self):
        def hook(module: torch.nn.Module, inputs) -> None:
            # The params this module is about to use must have their all-gather finished.
            for p in module.parameters(recurse=False):
                group = self.param_to_bucket_group.get(p)
                if group is not None:
                    group.finish_param_sync()
        return hook

    def _allocate_buffers(self, params, group: ParallelGroup, gradient_scaling_factor,
                          param_to_name) -> List[ParamAndGradBuffer]:
        by_dtypes: Dict[tuple, List[torch.nn.Parameter]] = {}
        indices: Dict[tuple, List[int]] = {}
        count: Dict[torch.dtype, int] = {}
        for p in params:
            grad_dtype = torch.float32 if self.ddp_config.grad_dtype_is_fp32(p.dtype in _FLOAT16) else p.dtype
            # An fp8 param's index counts among the params of its 16-bit dtype (Megatron's, for checkpoints).
            key = (torch.uint8 if p in self.fp8_recipes else p.dtype, grad_dtype)
            by_dtypes.setdefault(key, []).append(p)
            indices.setdefault(key, []).append(count.get(p.dtype, 0))
            count[p.dtype] = count.get(p.dtype, 0) + 1
        return [ParamAndGradBuffer(self.ddp_config, param_dtype, grad_dtype, ps, group, self.bucket_size,
                                   gradient_scaling_factor, indices[(param_dtype, grad_dtype)], param_to_name,
                                   self.fp8_recipes if param_dtype == torch.uint8 else None)
                for (param_dtype, grad_dtype), ps in by_dtypes.items()]

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        def hook(p: torch.Tensor) -> None:
            # Runs after autograd accumulated this backward's grad into p.grad.  Autograd also runs it when no
            # gradient came: an fp8 param's came straight into main_grad (grad_added_to_main_grad), a linear's
            # whose weight gradient the zero-bubble schedule deferred did not come (nothing is ready).
            if p.grad is not None:
                param.main_grad.add_(p.grad)
                p.grad = None
            elif getattr(param, "grad_added_to_main_grad", False):
                param.grad_added_to_main_grad = False
            else:
                return
            if self.ddp_config.overlap_grad_reduce:
                self.param_to_bucket_group[param].register_grad_ready(param)
        return hook

    def accumulate_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Add a gradient computed outside autograd (the zero-bubble schedule's deferred weight gradients) into
        ``param``'s buffer, as the backward hook adds autograd's, and tell its bucket it is in."""
        param.main_grad.add_(grad)
        if self.ddp_config.overlap_grad_reduce:
            self.param_to_bucket_group[param].register_grad_ready(param)

    @property
    def all_buffers(self) -> List[ParamAndGradBuffer]:
        return self.buffers + self.expert_parallel_buffers

    @property
    def all_bucket_groups(self) -> List[ParamAndGradBucketGroup]:
        return self.bucket_groups + self.expert_parallel_bucket_groups

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def set_is_last_microbatch(self, is_last: bool, params=None) -> None:
        """Whether the coming backward completes the accumulation window (reductions may start).

        ``params``: only the bucket groups holding any of them (a pipeline chunk's: the other chunks'
        buckets keep their own answer)."""
        groups = self.all_bucket_groups if params is None else \
            {self.param_to_bucket_group[p] for p in params if p in self.param_to_bucket_group}
        for group in groups:
            group.is_last_microbatch = is_last

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate into ``main_grad``; nothing is reduced."""
        self.set_is_last_microbatch(False)
        try:
            yield
        finally:
            self.set_is_last_microbatch(True)

    def start_grad_sync(self) -> None:
        """Issue every reduction not issued yet (async)."""
        for group in self.all_bucket_groups:
            if group.grad_reduce_handles is None:
                group.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Wait until every bucket group is reduced; afterwards ``main_grad`` holds the averaged grads
        (with the distributed optimizer: each rank's own shard of every bucket)."""
        for group in self.all_bucket_groups:
            group.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        """Zero all grad buffers (one op each) and reset the bucket groups for a new step."""
        for buffer in self.all_buffers:
            buffer.reset()
        for group in self.all_bucket_groups:
            group.reset()
        self.grads_finalized = False

    def start_param_sync(self, force_sync: bool = False) -> None:
        """(Distributed optimizer) all-gather updated param shards into every rank's param buffer."""
        for group in self.all_bucket_groups:
            group.start_param_sync(force_sync=force_sync)
        if force_sync or not self.ddp_config.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        for group in self.all_bucket_groups:
            group.finish_param_sync()

    def remove_hooks(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []

    # The wrapper is invisible in checkpoints: keys are the module's own.
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)
