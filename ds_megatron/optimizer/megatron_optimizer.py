"""Megatron's optimizer wrappers: ``Float16OptimizerWithFloat16Params`` and ``FP32Optimizer``.

Both wrap a plain torch optimizer (Adam, AdamW, SGD, ...) and add what a
model-parallel mixed-precision step needs, in Megatron's order:

0. finish the gradient sync (``finalize_model_grads`` over the model's
   gradient buffers, when the wrapper was given them): the wrappers reduce
   nothing themselves;
1. copy the model grads (``.grad``, or ``.main_grad`` when a grad buffer owns
   them) into fp32 main grads;
2. unscale them by ``inv_scale`` and check for inf/nan; ``found_inf`` is
   summed over the model-parallel group (and the expert one under MoE
   folding), so every rank takes the same decision;
3. update the grad scaler; on overflow skip: nothing else changes (params,
   optimizer state and step counters stay bit-identical);
4. compute the true global L2 norm (each TP shard once, replicated and shared
   params once) and clip by it when ``clip_grad > 0``; optionally count zeros;
5. step the inner optimizer on the fp32 main params, then copy them back into
   the fp16/bf16 model params.

Every pass over the gradients and params is one multi-tensor op
(``torch._foreach_*``, megatron-core's multi-tensor path): the unscale with its
inf/nan check, the per-tensor norms, the clipping, the main-to-model copy.
Without a loss scaler the inf/nan check needs no pass of its own: a non-finite
gradient has a non-finite norm, so the norm pass answers both, and the flag and
the squared norms travel in one all-reduce per group (one host read per step).
What a step reads is fixed when the gradients live in the model's buffers: the
lists of main grads (views of the buffers) are built once (``_StepPlan``), so the
hot path runs no per-parameter Python, except binding ``.grad`` of fp32 model
params, which DeepSpeed clears after every step.

The wrappers are ``torch.optim.Optimizer`` instances so that DeepSpeed uses
them as client optimizers as they are; they expose DeepSpeed's ``overflow``
(so the engine skips its LR step) and ``_global_grad_norm`` (what
``engine.get_global_grad_norm()`` returns).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..distributed import DistributedDataParallel, finalize_model_grads
from ..parallel_state import ParallelGroup, ParallelState
from ..tensor_parallel.params import grad_of, is_expert_param, param_is_not_tensor_parallel_duplicate
from .clip_grads import clip_grads_by_total_norm, count_zeros_fp32, grad_norm_and_found_inf, sum_of_squares
from .grad_scaler import MegatronGradScaler

# Attributes that say how a parameter is split or shared; main params inherit them
# so that norms and zero counts over main params skip the same duplicates.
_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "shared",
                     "allreduce", "is_expert")  # MoE: expert marks, so norms treat main params of experts as experts
_FLOAT16 = (torch.float16, torch.bfloat16)


@dataclass
class _StepPlan:
    """What a step reads, fixed as long as the param groups are (``MegatronOptimizer._plan``).

    ``params``: what the inner optimizer steps; ``parts``: per norm partition, the
    group its squares are summed over and the indices (into ``params``) counted
    in it; ``rest``: indices counted in no partition (TP duplicates), read only
    for the inf/nan check; ``reductions``: each distinct group of the step's
    collectives and the partitions summed over it (the inf/nan flag rides along
    on every one); ``fixed_grads``: the main grads when they are fixed fp32
    tensors (views of the gradient buffers), else None (gathered every step);
    ``rebind``: indices whose ``.grad`` others clear between steps (model params).
    """

    key: tuple
    params: List[torch.Tensor]
    parts: List[Tuple[ParallelGroup, List[int]]]
    rest: List[int]
    reductions: List[Tuple[ParallelGroup, List[int]]]
    fixed_grads: Optional[List[torch.Tensor]]
    rebind: List[int]

    def __post_init__(self):
        fixed = self.fixed_grads
        self.part_grads = None if fixed is None else [[fixed[i] for i in idx] for _, idx in self.parts]
        self.rest_grads = None if fixed is None else [fixed[i] for i in self.rest]


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
        # Every rank of the expert group must join its norm all-reduce, a pipeline stage without MoE layers
        # (moe_layer_freq's dense layers) too: the model's config says whether any stage has experts.
        self.has_experts = any(is_expert_param(p) for p in self.get_parameters()) or any(
            getattr(getattr(getattr(c, "module", c), "config", None), "num_experts", None) for c in self.model_chunks)
        if state.expert_mp.ranks != state.mp.ranks and self.has_experts:
            self.found_inf_groups.append(state.expert_mp)
        self._step_plan: Optional[_StepPlan] = None
        self._grads_bound = False  # fixed main grads bound to .grad (until zero_grad clears them)
        self.grad_scaler: Optional[MegatronGradScaler] = None
        self.overflow = False  # DeepSpeed skips its LR-scheduler step when this is True
        self._global_grad_norm: Optional[float] = None  # what engine.get_global_grad_norm() returns
        self.num_zeros_in_grad: Optional[int] = None
        # step() calls so far: a clock that never goes back (DeepSpeed's global_steps does, at a checkpoint load).
        self.steps_called = 0

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

    def state_dict_params(self) -> Tuple[List[torch.nn.Parameter], List[List[torch.nn.Parameter]]]:
        """The model params behind ``state_dict()``, per param group: all of them (flattened, a param's position is
        its index in ``state_dict()["optimizer"]["state"]``), and those whose fp32 main params
        ``fp32_from_fp16_params`` lists, in its order."""
        return [list(group["params"]) for group in self.optimizer.param_groups], [[] for _ in self.optimizer.param_groups]

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

    # -- what a step reads ---------------------------------------------------------------------------
    def _plan(self) -> _StepPlan:
        """The step plan, rebuilt only when the param groups change (a group added or replaced)."""
        key = tuple((id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups)
        if self._step_plan is None or self._step_plan.key != key:
            self._step_plan = self._build_plan(key)
        return self._step_plan

    def _build_plan(self, key: tuple) -> _StepPlan:
        seen, params = set(), []
        for p in self.get_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        parts = self._norm_partitions(params)
        counted = {i for _, idx in parts for i in idx}
        reductions: List[Tuple[ParallelGroup, List[int]]] = []
        for group in list(self.found_inf_groups) + [g for g, _ in parts]:
            if group.size > 1 and all(group.ranks != g.ranks for g, _ in reductions):
                reductions.append((group, []))
        for j, (group, _) in enumerate(parts):
            for g, members in reductions:
                if g.ranks == group.ranks:
                    members.append(j)
        self._grads_bound = False
        return _StepPlan(key, params, parts, [i for i in range(len(params)) if i not in counted], reductions,
                         self._fixed_main_grads(params), self._rebind_indices(params))

    def _norm_partitions(self, params: List[torch.Tensor]) -> List[Tuple[ParallelGroup, List[int]]]:
        """(group, indices) whose squared norms are summed over that group: TP duplicates are counted on
        TP rank 0 only, and a ``shared`` copy (PP: the last stage's tied embedding) not at all; MoE: expert params
        over the expert-model-parallel group (see ``get_grad_norm_with_experts``)."""
        counted = [i for i, p in enumerate(params)
                   if param_is_not_tensor_parallel_duplicate(p, self.tp_rank) and not getattr(p, "shared", False)]
        if not self.has_experts:
            return [(self.model_parallel_group, counted)]
        return [(self.model_parallel_group, [i for i in counted if not is_expert_param(params[i])]),
                (self.expert_model_parallel_group, [i for i in counted if is_expert_param(params[i])])]

    def _fixed_main_grads(self, params: List[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """The fp32 main grads of ``params`` when all are fixed tensors (buffer views), else None."""
        grads = [getattr(p, "main_grad", None) for p in params]
        return grads if all(g is not None and g.dtype == torch.float32 for g in grads) else None

    def _rebind_indices(self, params: List[torch.Tensor]) -> List[int]:
        """Params whose ``.grad`` the engine clears after a step (model params): bound again every step."""
        return list(range(len(params)))

    def _copy_model_grads_to_main_grads(self) -> List[Optional[torch.Tensor]]:
        """Bind each stepped param's ``.grad`` to its main grad; the main grads, aligned with the plan's params."""
        plan = self._plan()
        if plan.fixed_grads is None:
            return self._gather_main_grads(plan.params)
        if not self._grads_bound:
            for p, g in zip(plan.params, plan.fixed_grads):
                p.grad = g
            self._grads_bound = True
        else:
            for i in plan.rebind:
                plan.params[i].grad = plan.fixed_grads[i]
        return plan.fixed_grads

    def _gather_main_grads(self, params: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """Per step, when the main grads are not fixed tensors: bind and return them (copies where cast)."""
        for p in params:
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad
        return [p.grad for p in params]

    def _release_main_grads(self) -> None:
        """Unbind what the step bound: fixed grads of model params (backward must find ``.grad`` empty)."""
        plan = self._plan()
        if plan.fixed_grads is not None:
            for i in plan.rebind:
                plan.params[i].grad = None

    # -- norm, clipping, zeros --------------------------------------------------------------------
    def _grad_stats(self, grads: List[Optional[torch.Tensor]], found_inf: Optional[torch.Tensor],
                    check: bool = True) -> Tuple[bool, float]:
        """(some rank found inf/nan, the true global L2 norm) of the main grads, from one norm pass and one
        scalar all-reduce per group (``clip_grads.grad_norm_and_found_inf``).

        ``found_inf``: this rank's flag from the unscale pass (None: the norms are the check, so the
        TP duplicates, counted in no partition, are normed too).  ``check=False``: the norm only.
        """
        plan = self._plan()
        device = plan.params[0].device if plan.params else torch.device("cpu")
        if plan.part_grads is not None:
            part_grads, rest_grads = plan.part_grads, plan.rest_grads
        else:
            part_grads = [[grads[i] for i in idx if grads[i] is not None] for _, idx in plan.parts]
            rest_grads = [grads[i] for i in plan.rest if grads[i] is not None]
        squares = [sum_of_squares(g, device) for g in part_grads]
        flag = None
        if check and found_inf is not None:
            flag = torch.where(found_inf.sum() > 0, float("inf"), 0.0).to(torch.float64)
        elif check and rest_grads:
            flag = sum_of_squares(rest_grads, device) * 0.0  # nan when a duplicate is non-finite
        return grad_norm_and_found_inf(squares, plan.reductions, flag, check)

    def get_grad_norm(self) -> float:
        """The true global L2 norm of the current main grads (collectives over the model-parallel groups)."""
        plan = self._plan()
        return self._grad_stats([grad_of(p) for p in plan.params], None, check=False)[1]

    def clip_grad_norm(self, clip_grad: float) -> float:
        """The true global norm of the main grads; clips them to ``clip_grad`` when that is > 0."""
        total_norm = self.get_grad_norm()
        if clip_grad > 0.0:
            plan = self._plan()
            clip_grads_by_total_norm([g for p in plan.params for g in (grad_of(p),) if g is not None],
                                     clip_grad, total_norm)
        return total_norm

    def count_zeros(self) -> int:
        return count_zeros_fp32(self.get_parameters(), self.model_parallel_group, self.tp_rank)

    # -- the step ---------------------------------------------------------------------------------
    def _unscale(self, grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """With a loss scaler: multiply by ``inv_scale`` and flag inf/nan in one pass; None without one."""
        if self.grad_scaler is None:
            return None
        self.found_inf.fill_(0.0)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, self.grad_scaler.inv_scale)
        return self.found_inf

    def _copy_main_params_to_model_params(self) -> None:
        pass

    @torch.no_grad()
    def prepare_grads(self) -> Tuple[bool, float, List[torch.Tensor]]:
        """Megatron's ``prepare_grads``: finish the gradient sync, bind the fp32 main grads, unscale them and check
        for inf/nan; returns (some rank found inf/nan, the true global norm, the main grads present)."""
        if self.model_chunks:
            finalize_model_grads(self.model_chunks, self.parallel_state)
        grads = self._copy_model_grads_to_main_grads()
        present = grads if self._plan().fixed_grads is not None else [g for g in grads if g is not None]
        found_inf, grad_norm = self._grad_stats(grads, self._unscale(present))
        return found_inf, grad_norm, present

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Megatron's ``step_with_ready_grads``: the inner optimizer's step on the main params, then the main
        params copied back into the model's (fp16/bf16) params."""
        self.optimizer.step()
        self._copy_main_params_to_model_params()

    @torch.no_grad()
    def step(self, closure=None) -> Tuple[bool, Optional[float], Optional[int]]:
        """One Megatron step: prepare the grads, update the loss scale, skip on inf/nan (every rank alike), clip by
        the true global norm, step; returns ``(update_successful, grad_norm, num_zeros_in_grad)``."""
        if closure is not None:
            raise ValueError("closure is not supported: the loss is computed by the training loop "
                             "before step(); call step() without arguments")
        self.steps_called += 1
        found_inf, grad_norm, grads = self.prepare_grads()
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
        self.overflow = found_inf
        if found_inf:
            self._global_grad_norm, self.num_zeros_in_grad = None, None
            self._release_main_grads()
            return False, None, None
        if self.clip_grad > 0.0:
            clip_grads_by_total_norm(grads, self.clip_grad, grad_norm)
        self.num_zeros_in_grad = self.count_zeros() if self.log_num_zeros_in_grad else None
        self.step_with_ready_grads()
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
        # Flat lists for the multi-tensor copies; a main param's model param (the source of its grad).
        self._model_params_flat = [p for group in self.float16_groups for p in group]
        self._main_params_flat = [p for group in self.fp32_from_float16_groups for p in group]
        self._model_param_of = {id(main): model for model, main in zip(self._model_params_flat,
                                                                       self._main_params_flat)}

    def state_dict_params(self) -> Tuple[List[torch.nn.Parameter], List[List[torch.nn.Parameter]]]:
        groups = [[self._model_param_of.get(id(p), p) for p in group["params"]] for group in self.optimizer.param_groups]
        return groups, [list(group) for group in self.float16_groups]

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

    def _fixed_main_grads(self, params: List[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        # An fp32 main_grad (the buffers' default for 16-bit params) is used as it is, no copy.
        return super()._fixed_main_grads([self._model_param_of.get(id(p), p) for p in params])

    def _rebind_indices(self, params: List[torch.Tensor]) -> List[int]:
        # Main params are this wrapper's own tensors: bound once.  fp32 model params: every step.
        return [i for i, p in enumerate(params) if id(p) not in self._model_param_of]

    def _gather_main_grads(self, params: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        grads = []
        for p in params:
            model_param = self._model_param_of.get(id(p))
            if model_param is None:  # an fp32 model param
                if getattr(p, "main_grad", None) is not None:
                    p.grad = p.main_grad
            else:
                grad = grad_of(model_param)
                p.grad = None if grad is None else grad.float()
            grads.append(p.grad)
        return grads

    def _release_main_grads(self) -> None:
        if self._plan().fixed_grads is not None:
            super()._release_main_grads()
            return
        for main_param in self._main_params_flat:  # per-step fp32 copies of 16-bit grads: free them
            main_param.grad = None

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        if self._model_params_flat:
            torch._foreach_copy_(self._model_params_flat, self._main_params_flat)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the main params from the model params (after loading model weights only)."""
        if self._model_params_flat:
            torch._foreach_copy_(self._main_params_flat, self._model_params_flat)

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
