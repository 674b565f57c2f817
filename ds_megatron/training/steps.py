"""One training step and one evaluation pass, for each way the engine runs a step.

* ``MicroBatchStep``: the plain DeepSpeed loop, ``engine(batch)`` / ``engine.backward(loss)`` /
  ``engine.step()`` for each of the step's micro-batches (the engine steps the optimizer at the
  accumulation boundary).
* ``PipelineStep``: a pipeline engine's ``train_batch`` / ``eval_batch``, which run the step's
  micro-batches through the stages in their schedule.

Both return the step's loss as a device tensor (no host sync), which the loop gathers and reports
once per log interval; evaluation returns the mean over the validation batches and data parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional

import torch

from ..optimizer import MegatronOptimizer
from ..optimizer.clip_grads import get_grad_norm_with_experts
from ..parallel_state import ParallelState
from ..utils.collectives import all_reduce


def batch_to_device(batch: Dict[str, Any], device) -> Dict[str, Any]:
    """Every tensor of a loader batch on the engine's device (``non_blocking`` from pinned memory)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def pipeline_micro_batches(batches: Iterator[Dict[str, Any]], count: int, as_dicts: bool):
    """``count`` loader batches as the pipeline engine takes them: our runtime the loader's dicts (a packed
    micro-batch's documents included), DeepSpeed's ``PipelineEngine`` ``(tokens, (labels, loss_mask))``."""
    for _ in range(count):
        batch = next(batches)
        yield batch if as_dicts else (batch["tokens"], (batch["labels"], batch["loss_mask"]))


@dataclass
class StepOutput:
    loss: torch.Tensor  # float64 scalar on the device: the step's loss (mean over its micro-batches)
    grad_norm: Optional[float] = None  # the loop's own measure of the true global norm, where the engine has none


class MicroBatchStep:
    """The step as DeepSpeed's plain loop runs it."""

    def __init__(self, engine, model: torch.nn.Module, state: ParallelState, micro_batches: int):
        self.engine, self.model, self.state, self.micro_batches = engine, model, state, micro_batches
        # Our optimizer path (and DeepSpeed's own fp16/bf16/ZeRO optimizers) report the true global norm
        # through engine.get_global_grad_norm(); only DeepSpeed's plain fp32 path leaves it to the loop.
        self.measures_grad_norm = not (isinstance(engine.optimizer, MegatronOptimizer) or engine.fp16_enabled()
                                       or engine.bfloat16_enabled() or engine.zero_optimization())

    def train(self, batches: Iterator[Dict[str, Any]], want_grad_norm: bool) -> StepOutput:
        engine, device = self.engine, self.engine.device
        out = StepOutput(torch.zeros((), dtype=torch.float64, device=device))
        for micro in range(self.micro_batches):
            loss = engine(batch_to_device(next(batches), device))
            engine.backward(loss)
            if micro == self.micro_batches - 1 and self.measures_grad_norm and want_grad_norm:
                # Grads are DP-reduced now and still unclipped: Megatron's true global norm (experts counted once
                # over their own grid, which folding spreads over data-parallel ranks).
                out.grad_norm = get_grad_norm_with_experts(list(self.model.parameters()), self.state.tp.rank,
                                                           self.state.mp, self.state.expert_mp)
            engine.step()
            out.loss += loss.detach().double() / self.micro_batches
            # Keep no reference to this micro-batch's autograd graph: it would hold the parameters'
            # AccumulateGrad nodes alive into the next forward (a CUDA graph capture there needs them fresh).
            del loss
        return out

    def evaluate(self, batches) -> float:
        """The mean loss over ``batches`` and data parallelism."""
        engine, device, dp = self.engine, self.engine.device, self.state.dp
        engine.eval()
        total, n = torch.zeros((), dtype=torch.float64, device=device), 0
        with torch.no_grad():
            for batch in batches:
                total += engine(batch_to_device(batch, device)).double()
                n += 1
        engine.train()
        total /= max(n, 1)
        all_reduce(total, dp)
        return float(total) / dp.size


class PipelineStep:
    """The step as a pipeline engine runs it: its schedule over the stages, its optimizer step."""

    measures_grad_norm = False  # the engine reports the norm

    def __init__(self, engine, micro_batches: int, our_runtime: bool):
        """``our_runtime``: the engine runs our pipeline runtime (``GPTModelChunks``), not DeepSpeed's."""
        self.engine, self.micro_batches, self.as_dicts = engine, micro_batches, our_runtime

    def train(self, batches: Iterator[Dict[str, Any]], want_grad_norm: bool) -> StepOutput:
        # The engine's loss is the mean over the micro-batches and data parallelism already.
        out = StepOutput(torch.zeros((), dtype=torch.float64, device=self.engine.device))
        out.loss += self.engine.train_batch(pipeline_micro_batches(batches, self.micro_batches,
                                                                   self.as_dicts)).double()
        return out

    def evaluate(self, batches) -> float:
        """The mean loss over ``batches`` and data parallelism, on every stage."""
        batches = list(batches)
        return float(self.engine.eval_batch(pipeline_micro_batches(iter(batches), len(batches), self.as_dicts),
                                            num_micro_batches=len(batches)))


__all__ = ["MicroBatchStep", "PipelineStep", "StepOutput", "batch_to_device", "pipeline_micro_batches"]
