"""Megatron's optimizer wrappers: ``Float16OptimizerWithFloat16Params`` and ``FP32Optimizer``.

Both wrap a plain torch optimizer (Adam, AdamW, SGD, ...) and add what a
model-parallel mixed-precision step needs, in Megatron's order:

0. finish the gradient sync (``finalize_model_grads`` over the model's
   gradient buffers, when the wrapper was given them): the wrappers reduce
   nothing themselves;
1. copy the model grads (``.grad``, or ``.main_grad`` when a grad buffer owns
   them) into fp32 main grads;
2. unscale them by ``inv_scale`` and check for inf/nan; ``found_inf`` is
   all-reduced (MAX) over the model-parallel group (and the expert one under
   MoE folding), so every rank takes the same decision;
3. update the grad scaler; on overflow skip: nothing else changes (params,
   optimizer state and step counters stay bit-identical);
4. compute the true global L2 norm (each TP shard once, replicated and shared
   params once) and clip by it when ``clip_grad > 0``; optionally count zeros;
5. step the inner optimizer on the fp32 main params, then copy them back into
   the fp16/bf16 model params.

The wrappers are ``torch.optim.Optimizer`` instances so that DeepSpeed uses
them as client optimizers as they are; they expose DeepSpeed's ``overflow``
(so the engine skips its LR step) and ``_global_grad_norm`` (what
``engine.get_global_grad_norm()`` returns).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..distributed import DistributedDataParallel, finalize_model_grads
from ..parallel_state import ParallelGroup, ParallelState
from ..tensor_parallel.params import grad_of, is_expert_param
from ..utils.collectives import MAX, all_reduce
from .clip_grads import (clip_grad_by_total_norm_fp32, count_zeros_fp32, get_grad_norm_fp32,
                         get_grad_norm_with_experts, grads_for_norm)
from .grad_scaler import MegatronGradScaler

# Attributes that say how a parameter is split or shared; main params inherit them
# so that norms and zero counts over main params skip the same duplicates.
_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "shared",
                     "allreduce", "is_expert")  # MoE: expert marks, so norms treat main params of experts as experts
_FLOAT16 = (torch.float16, torch.bfloat16)


class MegatronOptimizer(torch.optim.Optimizer):
    """Base of the wrappers: grad norm, clipping, zero counting and the view of the inner optimizer.

    ``torch.optim.Optimizer.__init__`` is deliberately not called: the inner
    optimizer owns ``param_groups`` and ``state`` and this object presents
    them (properties), so LR schedulers built on either object, DeepSpeed's
    ``get_lr`` and its param-group checks all see the same groups.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, clip_grad: float = 0.0, log_num_zeros_in_grad: bool = False,
                 parallel_state: Optional[ParallelState] = None,
                 model_chunks: Sequence[DistributedDataParallel] = ()):
        """``parallel_state``: the job's groups (None: one rank); ``model_chunks``: the gradient buffers of the
        model (``DistributedDataParallel``), whose sync ``step()`` finishes first; none when ``.grad`` is final."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {clip_grad}")
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        # The hook registries torch's Optimizer methods expect to find.
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self.clip_grad = float(clip_grad)
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        state = parallel_state if parallel_state is not None else ParallelState.single()
        self.parallel_state = state
        self.model_chunks = list(model_chunks)
        self.tp_rank = state.tp.rank
        self.model_parallel_group = state.mp
        # MoE: expert grads are summed over etp-ep-pp in the norm (clip_grads.get_grad_norm_with_experts).
        self.expert_model_parallel_group = state.expert_mp
        # found_inf must agree on every rank; the model-parallel group covers ranks whose dense
        # grads differ (DP peers share reduced grads); under MoE folding the expert one spans others.
        self.found_inf_groups: List[ParallelGroup] = [state.mp]
        if state.expert_mp.ranks != state.mp.ranks and any(is_expert_param(p) for p in self.get_parameters()):
            self.found_inf_groups.append(state.expert_mp)
        self.grad_scaler: Optional[MegatronGradScaler] = None
        self.overflow = False  # DeepSpeed skips its LR-scheduler step when this is True
        self._global_grad_norm: Optional[float] = None  # what engine.get_global_grad_norm() returns
        self.num_zeros_in_grad: Optional[int] = None

    # -- the inner optimizer seen through this one ---------------------------------------------------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    def get_parameters(self) -> List[torch.Tensor]:
        """The parameters the inner optimizer updates (fp32 main params and fp32 model params)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def main_param_tensors(self) -> List[torch.Tensor]:
        """The fp32 copies kept besides the model params (main params of fp16/bf16 params)."""
        return []

    def state_bytes(self) -> Dict[str, int]:
        """Bytes of optimizer state this rank holds, measured on the tensors.

        ``main_params``: fp32 main params (or shards) of 16-bit params;
        ``optimizer_state``: every tensor in the inner optimizer's state (Adam's moments, step counters).
        """
        main = sum(t.numel() * t.element_size() for t in self.main_param_tensors())
        inner = sum(v.numel() * v.element_size() for s in self.optimizer.state.values() for v in s.values()
                    if torch.is_tensor(v))
        return {"main_params": main, "optimizer_state": inner, "total": main + inner}

    # -- loss scale -------------------------------------------------------------------------------
    def get_loss_scale(self) -> torch.Tensor:
        if self.grad_scaler is None:
            return torch.ones(1)
        return self.grad_scaler.scale

    @property
    def cur_scale(self) -> Optional[float]:
        """The current loss scale as a float (DeepSpeed's name), None when no scaler is used."""
        return None if self.grad_scaler is None else float(self.grad_scaler.scale)

    # -- norm, clipping, zeros --------------------------------------------------------------------
    def get_grad_norm(self) -> float:
        # MoE: expert params counted once, over the expert-model-parallel group
        params = self.get_parameters()
        if any(is_expert_param(p) for p in params):
            return get_grad_norm_with_experts(params, self.tp_rank, self.model_parallel_group,
                                              self.expert_model_parallel_group)
        return get_grad_norm_fp32(grads_for_norm(params, self.tp_rank), self.model_parallel_group)

    def clip_grad_norm(self, clip_grad: float) -> float:
        """The true global norm of the main grads; clips them to ``clip_grad`` when that is > 0."""
        params = self.get_parameters()
        total_norm = self.get_grad_norm()
        if clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, clip_grad, total_norm)
        return total_norm

    def count_zeros(self) -> int:
        return count_zeros_fp32(self.get_parameters(), self.model_parallel_group, self.tp_rank)

    def _reduce_found_inf(self, found_inf: torch.Tensor) -> bool:
        for group in self.found_inf_groups:
            all_reduce(found_inf, group, op=MAX)
        return bool(found_inf.item() > 0)

    # -- the step ---------------------------------------------------------------------------------
    def _prepare_grads(self) -> bool:
        """Make the main grads ready (copied, unscaled); True when some rank found inf/nan."""
        raise NotImplementedError

    def _release_main_grads(self) -> None:
        pass

    def _copy_main_params_to_model_params(self) -> None:
        pass

    @torch.no_grad()
    def step(self, closure=None) -> Tuple[bool, Optional[float], Optional[int]]:
        """One Megatron step; returns ``(update_successful, grad_norm, num_zeros_in_grad)``."""
        if closure is not None:
            raise ValueError("closure is not supported: the loss is computed by the training loop "
                             "before step(); call step() without arguments")
        if self.model_chunks:
            finalize_model_grads(self.model_chunks, self.parallel_state)
        found_inf = self._prepare_grads()
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
        self.overflow = found_inf
        if found_inf:
            self._global_grad_norm, self.num_zeros_in_grad = None, None
            self._release_main_grads()
            return False, None, None
        grad_norm = self.clip_grad_norm(self.clip_grad)
        self.num_zeros_in_grad = self.count_zeros() if self.log_num_zeros_in_grad else None
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        self._release_main_grads()
        self._global_grad_norm = grad_norm
        return True, grad_norm, self.num_zeros_in_grad

    # -- checkpoints ------------------------------------------------------------------------------
    def reload_model_params(self) -> None:
        """Refresh the fp32 main params from the model params (after loading model weights only)."""

    def refresh_fp32_params(self) -> None:
        """DeepSpeed's name for ``reload_model_params``: ``engine.load_checkpoint(load_module_only=True)`` calls it."""
        self.reload_model_params()

    def state_dict(self) -> Dict[str, Any]:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any], load_optimizer_states: bool = True) -> None:
        """``load_optimizer_states``: DeepSpeed's keyword (passed with fp16 / bf16 on); it calls this only when
        it is True."""
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None:
            if "grad_scaler" not in state_dict:
                raise KeyError("the checkpoint has no grad_scaler state but this run uses a loss scaler; "
                               "resume with the same fp16 settings it was saved with")
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r}, clip_grad={self.clip_grad})"


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """fp16/bf16 model params, fp32 main params updated by the inner optimizer.

    ``grad_scaler`` is required for fp16 and optional for bf16 (bf16 has fp32's
    range).  Model params that are already fp32 are stepped as they are.
    Inf/nan gradients are checked for in every case, so a bad step is skipped
    on every rank also in bf16.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, clip_grad: float = 0.0, log_num_zeros_in_grad: bool = False,
                 grad_scaler: Optional[MegatronGradScaler] = None, parallel_state: Optional[ParallelState] = None,
                 model_chunks: Sequence[DistributedDataParallel] = ()):
        super().__init__(optimizer, clip_grad, log_num_zeros_in_grad, parallel_state, model_chunks)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if grad_scaler is None and any(p.dtype == torch.float16 for p in params):
            raise ValueError("fp16 params need a grad scaler (fp16 gradients underflow without loss scaling); "
                             "pass a ConstantGradScaler or DynamicGradScaler")
        self.grad_scaler = grad_scaler
        device = params[0].device if params else torch.device("cpu")
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._scale_one = torch.ones(1, dtype=torch.float32, device=device)

        # float16_groups: the model's fp16/bf16 params; fp32_from_float16_groups: their
        # fp32 main params (what the inner optimizer now holds); fp32_from_fp32_groups:
        # model params that were fp32 already.
        self.float16_groups: List[List[torch.nn.Parameter]] = []
        self.fp32_from_float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.nn.Parameter]] = []
        for group in optimizer.param_groups:
            float16_params, fp32_from_float16, fp32_params = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in _FLOAT16:
                    main_param = param.detach().clone().float()
                    for name in _PARAM_ATTRIBUTES:
                        if hasattr(param, name):
                            setattr(main_param, name, getattr(param, name))
                    param.main_param = main_param
                    group["params"][i] = main_param
                    float16_params.append(param)
                    fp32_from_float16.append(main_param)
                    if param in optimizer.state:
                        optimizer.state[main_param] = optimizer.state.pop(param)
                elif param.dtype == torch.float32:
                    fp32_params.append(param)
                else:
                    raise TypeError(f"wrapped parameters must be float16, bfloat16 or float32; got {param.dtype}")
            self.float16_groups.append(float16_params)
            self.fp32_from_float16_groups.append(fp32_from_float16)
            self.fp32_from_fp32_groups.append(fp32_params)
        # Round-trip the state so any pre-existing per-param state is recast to the fp32 main params.
        optimizer.load_state_dict(optimizer.state_dict())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model params' grads (the main grads are released after every step)."""
        for group in self.float16_groups + self.fp32_from_fp32_groups:
            for p in group:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_().zero_()

    def main_param_tensors(self) -> List[torch.Tensor]:
        return [p for group in self.fp32_from_float16_groups for p in group]

    def _main_grads(self) -> List[torch.Tensor]:
        return [p.grad for group in self.fp32_from_float16_groups + self.fp32_from_fp32_groups
                for p in group if p.grad is not None]

    def _copy_model_grads_to_main_grads(self) -> None:
        # An fp32 main_grad (the buffers' default for 16-bit params) is used as it is, no copy.
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                grad = grad_of(model_param)
                main_param.grad = None if grad is None else grad.float()
        for group in self.fp32_from_fp32_groups:
            for param in group:
                if getattr(param, "main_grad", None) is not None:
                    param.grad = param.main_grad

    def _prepare_grads(self) -> bool:
        self._copy_model_grads_to_main_grads()
        self.found_inf.fill_(0.0)
        inv_scale = self.grad_scaler.inv_scale if self.grad_scaler is not None else self._scale_one
        main_grads = self._main_grads()
        if main_grads:
            # One fused pass: multiply by inv_scale and flag any inf/nan.
            torch._amp_foreach_non_finite_check_and_unscale_(main_grads, self.found_inf, inv_scale)
        return self._reduce_found_inf(self.found_inf)

    def _release_main_grads(self) -> None:
        for group in self.fp32_from_float16_groups:
            for main_param in group:
                main_param.grad = None

    def _model_and_main_data(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        model_data = [p.data for group in self.float16_groups for p in group]
        main_data = [p.data for group in self.fp32_from_float16_groups for p in group]
        return model_data, main_data

    def _copy_main_params_to_model_params(self) -> None:
        model_data, main_data = self._model_and_main_data()
        if model_data:
            torch._foreach_copy_(model_data, main_data)

    def reload_model_params(self) -> None:
        """Refresh the main params from the model params (after loading model weights only)."""
        model_data, main_data = self._model_and_main_data()
        if model_data:
            torch._foreach_copy_(main_data, model_data)

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        state["fp32_from_fp16_params"] = [[p.detach() for p in group] for group in self.fp32_from_float16_groups]
        return state

    def load_state_dict(self, state_dict: Dict[str, Any], load_optimizer_states: bool = True) -> None:
        super().load_state_dict(state_dict, load_optimizer_states)
        saved = state_dict["fp32_from_fp16_params"]
        if [len(g) for g in saved] != [len(g) for g in self.fp32_from_float16_groups]:
            raise ValueError("the checkpoint's fp32 main params do not match this model's param groups "
                             f"({[len(g) for g in saved]} vs {[len(g) for g in self.fp32_from_float16_groups]}); "
                             "resume with the same model and parallel layout")
        for current_group, saved_group in zip(self.fp32_from_float16_groups, saved):
            for current, saved_param in zip(current_group, saved_group):
                current.data.copy_(saved_param.data)
        self._copy_main_params_to_model_params()


class FP32Optimizer(MegatronOptimizer):
    """fp32 model params stepped directly, with the global-norm clipping and the inf/nan skip.

    ``grad_scaler`` is normally None (no loss scaling in fp32); a constant one
    is allowed and then unscales as in the fp16 path.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, clip_grad: float = 0.0, log_num_zeros_in_grad: bool = False,
                 grad_scaler: Optional[MegatronGradScaler] = None, parallel_state: Optional[ParallelState] = None,
                 model_chunks: Sequence[DistributedDataParallel] = ()):
        super().__init__(optimizer, clip_grad, log_num_zeros_in_grad, parallel_state, model_chunks)
        self.grad_scaler = grad_scaler
        params = self.get_parameters()
        bad = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
        if bad:
            raise TypeError(f"FP32Optimizer wraps float32 params only, got {', '.join(bad)}; "
                            "use Float16OptimizerWithFloat16Params for fp16/bf16 models")
        device = params[0].device if params else torch.device("cpu")
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _prepare_grads(self) -> bool:
        grads = []
        for p in self.get_parameters():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad
            if p.grad is not None:
                grads.append(p.grad)
        self.found_inf.fill_(0.0)
        if grads:
            if self.grad_scaler is not None:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, self.grad_scaler.inv_scale)
            else:
                # Check only (read-only pass): a grad holding inf/nan has an inf/nan 2-norm.  The
                # 2-norm, not the max-norm: on CPU the fused max-norm is ~4x slower.  A finite grad
                # whose 2-norm overflows fp32 is skipped too, which is what its clipping would need.
                norms = torch.stack(torch._foreach_norm(grads, 2.0))
                self.found_inf.fill_(float(not bool(torch.isfinite(norms).all())))
        return self._reduce_found_inf(self.found_inf)
