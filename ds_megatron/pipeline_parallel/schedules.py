"""The pipeline runtime: each rank executes its order of ``schedule_table`` over its model chunks.

``PipelineSchedule.run`` takes this rank's chunks (local chunk ``c`` is virtual stage ``c * p + rank``)
and the step's micro-batches, and executes ``rank_operations``: Megatron's warm-up forwards, 1F1B
pairs and cool-down backwards, interleaved over the chunks when there are several (the same order the
CUDA-graph capture plan is made from).  For each operation:

* forward of chunk ``c`` for micro-batch ``k``: the input is micro-batch ``k``'s tokens on the first
  virtual stage, else the activation received from the previous virtual stage; the last virtual stage
  also gets the labels and returns the loss; any other sends its output on;
* backward: the loss (divided by the micro-batches, as gradient accumulation does) on the last virtual
  stage, else the output with the gradient received from the next virtual stage; the input's
  gradient goes back to the previous virtual stage.

Activations and gradients have one shape, known before the step (``tensor_shape``: this rank's
[sequence, micro-batch, hidden] slice, with sequence and context parallelism already applied), so
receive buffers are allocated and posted ahead, in each channel's send order
(``p2p_communication``).  Micro-batches are drawn from the iterator by the ranks that hold the
first or last virtual stage only, in order, as DeepSpeed's pipeline engine draws them.

Nothing here knows DeepSpeed, the optimizer or the gradient buffers: ``before_backward(chunk,
last)`` tells the caller which backward is a chunk's last of the step (where its bucket reductions
may start), and the loss scale is applied by the chunk's own output hook.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..parallel_state import ParallelGroup
from .p2p_communication import PipelineChannels
from .schedule_table import Operation, channel_messages, rank_operations, receives_of, sends_of

Message = Tuple[str, int, int]


def split_micro_batch(batch: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(tokens, labels, loss_mask)`` of a micro-batch as DeepSpeed's pipeline engine takes it
    (``(tokens, labels)`` or ``(tokens, (labels, loss_mask))``) or as our loader yields it (a dict)."""
    if isinstance(batch, dict):
        return batch["tokens"], batch.get("labels"), batch.get("loss_mask")
    tokens, labels = batch
    if isinstance(labels, (tuple, list)):
        labels, loss_mask = labels
        return tokens, labels, loss_mask
    return tokens, labels, None


class PipelineSchedule:
    """One rank's executor of the interleaved 1F1B schedule (one chunk: plain 1F1B).

    ``chunks``: this rank's model chunks; each is called as ``chunk(tokens_or_hidden, labels, loss_mask)``
    and returns its output (the loss on the last virtual stage).  ``group_size``: Megatron's
    ``microbatch_group_size_per_vp_stage`` (default: the pipeline size).
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], pp: ParallelGroup, channels: PipelineChannels,
                 tensor_shape: Tuple[int, ...], dtype: torch.dtype, device, group_size: Optional[int] = None):
        self.chunks, self.pp, self.channels = list(chunks), pp, channels
        self.tensor_shape, self.dtype, self.device = tuple(tensor_shape), dtype, device
        self.group_size = group_size or pp.size
        self.executed: List[Operation] = []  # the last run's operations, in the order they ran

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def _is_first(self, chunk: int) -> bool:
        return self.pp.rank == 0 and chunk == 0

    def _is_last(self, chunk: int) -> bool:
        return self.pp.rank == self.pp.size - 1 and chunk == self.num_chunks - 1

    def operations(self, num_microbatches: int, forward_only: bool = False) -> List[Operation]:
        return rank_operations(num_microbatches, self.num_chunks, pipeline_parallel_size=self.pp.size,
                               pipeline_parallel_rank=self.pp.rank,
                               microbatch_group_size_per_vp_stage=self.group_size, forward_only=forward_only)

    def run(self, data_iter: Iterator[Any], num_microbatches: int, forward_only: bool = False,
            before_backward: Optional[Callable[[int, bool], None]] = None) -> List[torch.Tensor]:
        """Execute the step; returns the last virtual stage's losses (detached, one per micro-batch; empty on
        other ranks).  ``forward_only``: the forwards in table order, without building autograd graphs."""
        p, v, rank = self.pp.size, self.num_chunks, self.pp.rank
        ops = self.operations(num_microbatches, forward_only)
        # What each neighbour sends here, in its send order: the order this rank posts receives in.
        expected: Dict[int, Deque[Message]] = {}
        for src in {(rank - 1) % p, (rank + 1) % p} - {rank}:
            src_ops = rank_operations(num_microbatches, v, pipeline_parallel_size=p, pipeline_parallel_rank=src,
                                      microbatch_group_size_per_vp_stage=self.group_size, forward_only=forward_only)
            expected[src] = deque(channel_messages(src_ops, src, p, v).get(rank, []))
        posted: Dict[Message, Tuple[torch.Tensor, Any]] = {}
        sends: List[Tuple[Any, torch.Tensor]] = []
        batches: Dict[int, Tuple] = {}
        needs_data = any(self._is_first(c) or self._is_last(c) for c in range(v))
        next_batch = 0
        stored: List[Deque[Tuple[Optional[torch.Tensor], torch.Tensor]]] = [deque() for _ in range(v)]
        backwards_left = [num_microbatches] * v
        losses: List[torch.Tensor] = []
        self.executed = []

        def receive(src: int, message: Message) -> torch.Tensor:
            while message not in posted:
                nxt = expected[src].popleft()  # IndexError would mean the orders disagree: a bug, not input
                buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
                posted[nxt] = (buffer, self.channels.recv(buffer, src))
            buffer, work = posted.pop(message)
            work.wait()
            return buffer

        def batch_of(mb: int) -> Tuple:
            nonlocal next_batch
            while next_batch <= mb:
                batches[next_batch] = split_micro_batch(next(data_iter))
                next_batch += 1
            return batches[mb]

        grad_mode = torch.no_grad() if forward_only else torch.enable_grad()
        with grad_mode:
            for op in ops:
                self.executed.append(op)
                needed = receives_of(op, rank, p, v)
                if op.forward:
                    tokens, labels, loss_mask = batch_of(op.microbatch) if needs_data and (
                        self._is_first(op.chunk) or self._is_last(op.chunk)) else (None, None, None)
                    if needed is None:
                        inputs = tokens.to(self.device, non_blocking=True)
                    else:
                        inputs = receive(needed[0], needed[1])
                        inputs.requires_grad_(not forward_only)
                    if self._is_last(op.chunk):
                        output = self.chunks[op.chunk](inputs, labels.to(self.device, non_blocking=True),
                                                       None if loss_mask is None else
                                                       loss_mask.to(self.device, non_blocking=True))
                        losses.append(output.detach())
                        batches.pop(op.microbatch, None)
                    else:
                        output = self.chunks[op.chunk](inputs)
                        if tuple(output.shape) != self.tensor_shape or output.dtype != self.dtype:
                            raise RuntimeError(
                                f"pipeline chunk {op.chunk} on rank {rank} returned {tuple(output.shape)} "
                                f"{output.dtype}, but the stages exchange {self.tensor_shape} {self.dtype}: every "
                                "micro-batch must be [micro_batch_size, seq_length] tokens")
                        dst, message = sends_of(op, rank, p, v)
                        sent = output.detach()
                        sends.append((self.channels.send(sent, dst), sent))
                    if self._is_first(op.chunk) and not self._is_last(op.chunk):
                        batches.pop(op.microbatch, None)
                    if not forward_only:
                        stored[op.chunk].append((None if needed is None else inputs, output))
                    continue
                inputs, output = stored[op.chunk].popleft()
                backwards_left[op.chunk] -= 1
                if before_backward is not None:
                    before_backward(op.chunk, backwards_left[op.chunk] == 0)
                if needed is None:  # the last virtual stage: the loss, averaged over the micro-batches
                    torch.autograd.backward(output / num_microbatches)
                else:
                    torch.autograd.backward(output, receive(needed[0], needed[1]))
                sent_to = sends_of(op, rank, p, v)
                if sent_to is not None:
                    grad = inputs.grad
                    sends.append((self.channels.send(grad, sent_to[0]), grad))
                del inputs, output
        for work, _ in sends:
            work.wait()
        if posted or any(expected.values()):
            raise RuntimeError(f"pipeline rank {rank}: messages left unreceived after the step: "
                               f"{sorted(posted) + [m for q in expected.values() for m in q]}")
        return losses


__all__ = ["PipelineSchedule", "split_micro_batch"]
