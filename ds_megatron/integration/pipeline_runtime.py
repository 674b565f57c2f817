"""Our pipeline runtime inside DeepSpeed's engine: ``engine.train_batch`` / ``engine.eval_batch`` for model chunks.

With ``pipeline_schedule`` "interleaved_1f1b" the model is a ``GPTModelChunks`` and
``deepspeed.initialize`` builds DeepSpeed's plain engine over it (our mpu, our optimizer path).
``attach_pipeline_runtime`` gives that engine the two methods DeepSpeed's ``PipelineEngine`` has,
with its signatures and return values, so loops written for DeepSpeed's pipeline keep working:

* ``train_batch(data_iter)``: zero the gradient buffers, run ``gradient_accumulation_steps``
  micro-batches through ``pipeline_parallel.schedules.PipelineSchedule``, then ``engine.step()`` at
  the accumulation boundary (our optimizer: ``finalize_model_grads`` with the tied embedding summed
  over the ``embedding`` group, skip on overflow and clipping by the norm over every stage; DeepSpeed:
  the LR schedule, step and sample counters).  Returns the mean loss over the micro-batches and data
  parallelism, on every stage.
* ``eval_batch(data_iter, ..., num_micro_batches=None)``: the forwards only, the same mean.

With ``pipeline_schedule`` "zero_bubble" the chunks' linear layers get a ``WeightGradStore`` whose
deferred weight gradients go into the buffers through ``DistributedDataParallel.accumulate_grad``.

CUDA graphs (``integration.cuda_graphs``): captured in this schedule's order, told before each
training forward which chunk and micro-batch it is.

Megatron's overlap: before each backward the buckets holding that chunk's parameters learn whether it
is the chunk's last backward of the step, so a bucket's reduction starts as soon as the last
backward of every chunk it holds has produced its gradients, while other chunks still compute.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

import torch

from ..distributed import DistributedDataParallel
from ..models.gpt_chunks import GPTModelChunks
from ..parallel_state import ParallelState
from ..pipeline_parallel.p2p_communication import PipelineChannels
from ..pipeline_parallel.schedules import PipelineSchedule
from ..tensor_parallel.layers import attach_weight_grad_store
from ..tensor_parallel.weight_grad_store import WeightGradStore
from ..utils.collectives import all_reduce
from .gradients import check_engine_supports_megatron_ddp
from .seams import set_deepspeed_reduces_gradients


def activation_shape(model: GPTModelChunks, state: ParallelState, micro_batch_size: int):
    """[sequence, micro-batch, hidden] of what the stages exchange: this rank's slice of the sequence after
    context parallelism (its two zigzag chunks) and sequence parallelism (its TP share)."""
    cfg = model.config
    s = cfg.seq_length // state.cp.size
    if cfg.sequence_parallel:
        s //= state.tp.size
    return (s, micro_batch_size, cfg.hidden_size)


class PipelineRuntime:
    """The engine's ``train_batch`` / ``eval_batch`` over ``model``'s chunks (see the module docstring)."""

    def __init__(self, engine, model: GPTModelChunks, state: ParallelState, ddp: DistributedDataParallel,
                 group_size: Optional[int], schedule: str = "interleaved_1f1b"):
        check_engine_supports_megatron_ddp(engine, ddp.ddp_config)
        set_deepspeed_reduces_gradients(engine, False)  # our buffers are the reducer
        self.engine, self.model, self.state, self.ddp = engine, model, state, ddp
        self.channels = PipelineChannels(state)
        dtype = next(model.parameters()).dtype
        store = None
        if schedule == "zero_bubble":  # W: the linear layers' weight-gradient GEMMs, into the buffers later
            store = WeightGradStore(accumulate=ddp.accumulate_grad)
            attach_weight_grad_store(model, store)
        self.schedule = PipelineSchedule(model.chunks, state.pp, self.channels,
                                         activation_shape(model, state, engine.train_micro_batch_size_per_gpu()),
                                         dtype, engine.device, group_size, schedule, store,
                                         prepare_documents=model.packed_seq_params)
        self._chunk_params = [list(chunk.parameters()) for chunk in model.chunks]
        self._train_iterator: Optional[Iterator] = None
        self.cuda_graphs = None  # integration.cuda_graphs.PipelineRuntimeCudaGraphs, when graphs are on

    def _before_backward(self, chunk: int, last: bool) -> None:
        # Only the buckets of this chunk's params: another chunk's may still have backwards to accumulate.
        self.ddp.set_is_last_microbatch(last, params=self._chunk_params[chunk])

    def _data(self, data_iter):
        if data_iter is not None:
            return data_iter
        loader = getattr(self.engine, "training_dataloader", None)
        if loader is None:
            raise ValueError("train_batch() needs data_iter (or training_data given to ds_megatron.initialize)")
        if self._train_iterator is None:
            self._train_iterator = iter(loader)
        return self._train_iterator

    def _mean_loss(self, losses: List[torch.Tensor], micro_batches: int) -> torch.Tensor:
        """The mean over the micro-batches and data parallelism, from the last stage to every stage."""
        total = torch.zeros((), dtype=torch.float32, device=self.engine.device)
        if losses:
            total += torch.stack([loss.float() for loss in losses]).sum() / micro_batches
        all_reduce(total, self.state.dp)
        total /= self.state.dp.size
        all_reduce(total, self.state.pp)  # only the last stage holds a non-zero sum: a broadcast
        return total

    def train_batch(self, data_iter: Optional[Iterator[Any]] = None) -> torch.Tensor:
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled; use eval_batch() instead")
        engine = self.engine
        engine.train()
        self.ddp.zero_grad_buffer()
        for p in self.model.parameters():
            p.grad = None
        micro_batches = engine.gradient_accumulation_steps()
        graphs = self.cuda_graphs
        if graphs is not None:
            graphs.begin_step()  # captures once warmup_steps steps have run
        losses = self.schedule.run(self._data(data_iter), micro_batches, before_backward=self._before_backward,
                                   before_forward=None if graphs is None else graphs.before_forward)
        engine.set_gradient_accumulation_boundary(True)
        try:
            engine.step()
        finally:
            engine.set_gradient_accumulation_boundary(None)
        return self._mean_loss(losses, micro_batches)

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True,
                   num_micro_batches: Optional[int] = None) -> torch.Tensor:
        if return_logits or not compute_loss or reduce_output != "avg" or not bcast_loss:
            raise NotImplementedError("eval_batch here returns the mean loss on every stage (return_logits=False, "
                                      "compute_loss=True, reduce_output='avg', bcast_loss=True)")
        engine = self.engine
        engine.eval()
        micro_batches = num_micro_batches or engine.gradient_accumulation_steps()
        losses = self.schedule.run(data_iter, micro_batches, forward_only=True)
        return self._mean_loss(losses, micro_batches)

    @property
    def executed(self):
        """The operations of the last ``train_batch`` / ``eval_batch`` on this rank, in the order they ran."""
        return self.schedule.executed

    def destroy(self) -> None:
        self.channels.destroy()


def attach_pipeline_runtime(engine, model: GPTModelChunks, state: ParallelState, ddp: DistributedDataParallel,
                            group_size: Optional[int], schedule: str = "interleaved_1f1b") -> PipelineRuntime:
    """Give ``engine`` (DeepSpeed's plain engine over ``model``) ``train_batch`` and ``eval_batch``."""
    runtime = PipelineRuntime(engine, model, state, ddp, group_size, schedule)
    engine.train_batch = runtime.train_batch
    engine.eval_batch = runtime.eval_batch
    return runtime


__all__ = ["PipelineRuntime", "activation_shape", "attach_pipeline_runtime"]
