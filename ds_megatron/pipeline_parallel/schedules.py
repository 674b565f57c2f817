"""The pipeline runtime: each rank executes its order of ``schedule_table`` over its model chunks.

``PipelineSchedule.run`` takes this rank's chunks (local chunk ``c`` is virtual stage ``c * p + rank``)
and the step's micro-batches, and executes ``rank_operations``: Megatron's warm-up forwards, 1F1B
pairs and cool-down backwards, interleaved over the chunks when there are several (the same order the
CUDA-graph capture plan is made from).  For each operation:

* forward of chunk ``c`` for micro-batch ``k``: the input is micro-batch ``k``'s tokens on the first
  virtual stage, else the activation received from the previous virtual stage; the last virtual stage
  also gets the labels (and the tokens, when the chunk ``takes_tokens``: multi-token prediction) and
  returns the loss; any other sends its output on;
* backward: the loss (divided by the micro-batches, as gradient accumulation does) on the last virtual
  stage, else the output with the gradient received from the next virtual stage; the input's
  gradient goes back to the previous virtual stage.

Activations and gradients have one shape, known before the step (``tensor_shape``: this rank's
[sequence, micro-batch, hidden] slice, with sequence and context parallelism already applied), so
receive buffers are allocated and posted ahead, in each channel's send order
(``p2p_communication``).  A send is waited on and dropped at the first message from its receiver that
proves it taken (``schedule_table.send_releases``), so a stage holds a bounded number of sends whatever the
micro-batch count, and never blocks on a receiver that is not ready (an evaluation of one chunk a rank, which
gets no message back, waits on its oldest send once pp are in flight).  Every rank draws each micro-batch
from its iterator, in order: the first and last virtual stages for the tokens and labels, every stage for
a packed micro-batch's documents (``position_ids`` / ``cu_seqlens`` / ``padding_mask``, turned into the chunks'
``packed_seq_params`` by ``prepare_documents``), which travel with the micro-batch as Megatron-Bridge's do: every
stage's iterator must yield the same micro-batches.

The zero-bubble schedule (``schedule_table.zero_bubble_orders``) splits each backward: B runs it
with the chunk's linear layers deferring their weight-gradient GEMMs into a ``WeightGradStore``
under (chunk, micro-batch), and W runs that key's GEMMs later.

Nothing here knows DeepSpeed, the optimizer or the gradient buffers: ``before_backward(chunk,
last)`` tells the caller, before each backward (or W), whether it is the chunk's last of that kind in
the step (where its bucket reductions may start); ``before_forward(chunk, microbatch)`` tells it which
micro-batch a training forward is (the CUDA graph each layer replays); the loss scale is applied by the
chunk's own output hook.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import contextlib
import time

import torch

from ..parallel_state import ParallelGroup
from ..tensor_parallel.weight_grad_store import WeightGradStore
from .p2p_communication import PipelineChannels
from .schedule_table import Operation, channel_messages, rank_operations, receives_of, send_releases, sends_of

Message = Tuple[str, int, int]
DOCUMENT_KEYS = ("position_ids", "cu_seqlens", "padding_mask")  # a packed micro-batch's documents


class MicroBatch(NamedTuple):
    tokens: torch.Tensor
    labels: Optional[torch.Tensor]
    loss_mask: Optional[torch.Tensor]
    documents: Dict[str, torch.Tensor]  # those of DOCUMENT_KEYS the batch carries


def split_micro_batch(batch: Any) -> MicroBatch:
    """A micro-batch as DeepSpeed's pipeline engine takes it (``(tokens, labels)`` or
    ``(tokens, (labels, loss_mask))``) or as our loader yields it (a dict, with a packed micro-batch's documents)."""
    if isinstance(batch, dict):
        documents = {key: batch[key] for key in DOCUMENT_KEYS if batch.get(key) is not None}
        return MicroBatch(batch["tokens"], batch.get("labels"), batch.get("loss_mask"), documents)
    tokens, labels = batch
    if isinstance(labels, (tuple, list)):
        labels, loss_mask = labels
        return MicroBatch(tokens, labels, loss_mask, {})
    return MicroBatch(tokens, labels, None, {})


class PipelineSchedule:
    """One rank's executor of the interleaved 1F1B schedule (one chunk: plain 1F1B) or of ZB-H1
    (``schedule`` "zero_bubble", with the ``weight_grad_store`` the chunks' linear layers hold).

    ``chunks``: this rank's model chunks; each is called as ``chunk(tokens_or_hidden, labels, loss_mask)``
    and returns its output (the loss on the last virtual stage).  ``group_size``: Megatron's
    ``microbatch_group_size_per_vp_stage`` (default: the pipeline size).  ``prepare_documents(tokens,
    documents)``: what a packed micro-batch's documents become for the chunks (their ``packed_seq_params``
    keyword; None: nothing, and the chunks are called without it).
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], pp: ParallelGroup, channels: PipelineChannels,
                 tensor_shape: Tuple[int, ...], dtype: torch.dtype, device, group_size: Optional[int] = None,
                 schedule: str = "interleaved_1f1b", weight_grad_store: Optional[WeightGradStore] = None,
                 prepare_documents: Optional[Callable[[torch.Tensor, Dict[str, torch.Tensor]], Any]] = None):
        if schedule == "zero_bubble" and weight_grad_store is None:
            raise ValueError("the zero-bubble schedule defers weight gradients into a WeightGradStore; pass one "
                             "(and attach it to the chunks' linear layers)")
        self.schedule, self.weight_grad_store = schedule, weight_grad_store
        self.prepare_documents = prepare_documents
        self.chunks, self.pp, self.channels = list(chunks), pp, channels
        self.tensor_shape, self.dtype, self.device = tuple(tensor_shape), dtype, device
        self.group_size = group_size or pp.size
        self.executed: List[Operation] = []  # the last run's operations, in the order they ran
        self.sends_held: List[int] = []  # the last run's sends not yet released before each operation, and at its end
        self.record_timings = False  # benchmarks: time each operation's compute (not its waits)
        self.compute_seconds = 0.0  # the last run's forward + backward compute, with record_timings
        self.span_seconds = 0.0  # from the last run's start to the end of its last operation, with record_timings

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
                               microbatch_group_size_per_vp_stage=self.group_size, forward_only=forward_only,
                               schedule=self.schedule)

    def run(self, data_iter: Iterator[Any], num_microbatches: int, forward_only: bool = False,
            before_backward: Optional[Callable[[int, bool], None]] = None,
            before_forward: Optional[Callable[[int, int], None]] = None) -> List[torch.Tensor]:
        """Execute the step; returns the last virtual stage's losses (detached, one per micro-batch; empty on
        other ranks).  ``forward_only``: the forwards in table order, without building autograd graphs."""
        p, v, rank = self.pp.size, self.num_chunks, self.pp.rank
        ops = self.operations(num_microbatches, forward_only)
        # What each neighbour sends here, in its send order: the order this rank posts receives in.
        expected: Dict[int, Deque[Message]] = {}
        for src in {(rank - 1) % p, (rank + 1) % p} - {rank}:
            src_ops = rank_operations(num_microbatches, v, pipeline_parallel_size=p, pipeline_parallel_rank=src,
                                      microbatch_group_size_per_vp_stage=self.group_size, forward_only=forward_only,
                                      schedule=self.schedule)
            expected[src] = deque(channel_messages(src_ops, src, p, v).get(rank, []))
        posted: Dict[Message, Tuple[torch.Tensor, Any]] = {}
        # Sends in flight (the work and the tensor it reads) by (destination, message), until send_releases says
        # their receiver has taken them.
        sending: Dict[Tuple[int, Message], Tuple[Any, torch.Tensor]] = {}
        releases = send_releases(num_microbatches, v, p, rank, self.group_size, self.schedule, forward_only)
        # An evaluation's straight pipeline (one chunk a rank) sends only downstream: no message comes back to
        # prove a send taken.  Its receiver takes them in order, needing nothing more from this rank, so waiting
        # on the oldest once pp are in flight cannot block for good (the last rank sends nothing), and holds a
        # rank to pp sends as training's 1F1B holds it to pp micro-batches.
        evaluation_window = p if forward_only and v == 1 else None
        batches: Dict[int, Tuple[MicroBatch, Any]] = {}  # (micro-batch, its packed_seq_params) until v forwards
        forwards_of: Dict[int, int] = {}
        next_batch = 0
        stored: List[Deque[Tuple[Optional[torch.Tensor], torch.Tensor]]] = [deque() for _ in range(v)]
        backwards_left = [num_microbatches] * v
        weights_left = [num_microbatches] * v
        losses: List[torch.Tensor] = []
        self.executed, self.sends_held = [], []
        self.compute_seconds = 0.0
        clock = time.perf_counter if self.record_timings else None
        began = clock() if clock else 0.0

        def receive(src: int, message: Message, release: Sequence[Tuple[int, Message]]) -> torch.Tensor:
            while message not in posted:
                nxt = expected[src].popleft()  # IndexError would mean the orders disagree: a bug, not input
                buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
                posted[nxt] = (buffer, self.channels.recv(buffer, src))
            buffer, work = posted.pop(message)
            work.wait()
            for sent in release:  # taken by their receiver before it sent ``message``: done, or finishing alone
                sending.pop(sent)[0].wait()
            return buffer

        def batch_of(mb: int) -> Tuple[MicroBatch, Any]:
            nonlocal next_batch
            while next_batch <= mb:
                batch = split_micro_batch(next(data_iter))
                packed = None
                if batch.documents and self.prepare_documents is not None:
                    packed = self.prepare_documents(batch.tokens.to(self.device, non_blocking=True), batch.documents)
                batches[next_batch] = (batch, packed)
                next_batch += 1
            return batches[mb]

        grad_mode = torch.no_grad() if forward_only else torch.enable_grad()
        with grad_mode:
            for op, release in zip(ops, releases):
                self.executed.append(op)
                self.sends_held.append(len(sending))
                needed = receives_of(op, rank, p, v)
                if op.forward:
                    (tokens, labels, loss_mask, _), packed = batch_of(op.microbatch)
                    documents = {} if packed is None else {"packed_seq_params": packed}
                    if needed is None:
                        inputs = tokens.to(self.device, non_blocking=True)
                    else:
                        inputs = receive(needed[0], needed[1], release)
                        inputs.requires_grad_(not forward_only)
                    if before_forward is not None and not forward_only:
                        before_forward(op.chunk, op.microbatch)
                    start = clock() if clock else 0.0
                    if self._is_last(op.chunk):
                        chunk = self.chunks[op.chunk]
                        # multi-token prediction embeds the tokens k ahead on the last stage
                        extra = {"tokens": tokens.to(self.device, non_blocking=True)} \
                            if getattr(chunk, "takes_tokens", False) else {}
                        output = chunk(inputs, labels.to(self.device, non_blocking=True),
                                       None if loss_mask is None else loss_mask.to(self.device, non_blocking=True),
                                       **extra, **documents)
                        losses.append(output.detach())
                    else:
                        output = self.chunks[op.chunk](inputs, **documents)
                    if clock:
                        self.compute_seconds += clock() - start
                    if not self._is_last(op.chunk):
                        if tuple(output.shape) != self.tensor_shape or output.dtype != self.dtype:
                            raise RuntimeError(
                                f"pipeline chunk {op.chunk} on rank {rank} returned {tuple(output.shape)} "
                                f"{output.dtype}, but the stages exchange {self.tensor_shape} {self.dtype}: every "
                                "micro-batch must be [micro_batch_size, seq_length] tokens")
                        dst, message = sends_of(op, rank, p, v)
                        sent = output.detach()
                        sending[dst, message] = (self.channels.send(sent, dst), sent)
                        if evaluation_window is not None and len(sending) > evaluation_window:
                            sending.pop(next(iter(sending)))[0].wait()
                    forwards_of[op.microbatch] = forwards_of.get(op.microbatch, 0) + 1
                    if forwards_of[op.microbatch] == v:  # this rank's last forward of it
                        batches.pop(op.microbatch)
                    if not forward_only:
                        stored[op.chunk].append((None if needed is None else inputs, output))
                    continue
                if op.part == "weight":  # W: the weight gradients its B left in the store
                    weights_left[op.chunk] -= 1
                    if before_backward is not None:
                        before_backward(op.chunk, weights_left[op.chunk] == 0)
                    start = clock() if clock else 0.0
                    self.weight_grad_store.run((op.chunk, op.microbatch))
                    if clock:
                        self.compute_seconds += clock() - start
                    continue
                inputs, output = stored[op.chunk].popleft()
                backwards_left[op.chunk] -= 1
                if before_backward is not None:
                    before_backward(op.chunk, backwards_left[op.chunk] == 0)
                grad = None if needed is None else receive(needed[0], needed[1], release)
                start = clock() if clock else 0.0
                deferring = self.weight_grad_store.deferring((op.chunk, op.microbatch)) if op.part == "input" \
                    else contextlib.nullcontext()
                with deferring:
                    if grad is None:  # the last virtual stage: the loss, averaged over the micro-batches
                        torch.autograd.backward(output / num_microbatches)
                    else:
                        torch.autograd.backward(output, grad)
                if clock:
                    self.compute_seconds += clock() - start
                sent_to = sends_of(op, rank, p, v)
                if sent_to is not None:
                    grad = inputs.grad
                    sending[sent_to] = (self.channels.send(grad, sent_to[0]), grad)
                del inputs, output
        if clock:
            self.span_seconds = clock() - began
        self.sends_held.append(len(sending))
        for work, _ in sending.values():  # covered by no later message: the step's last sends
            work.wait()
        if posted or any(expected.values()):
            raise RuntimeError(f"pipeline rank {rank}: messages left unreceived after the step: "
                               f"{sorted(posted) + [m for q in expected.values() for m in q]}")
        return losses


__all__ = ["DOCUMENT_KEYS", "MicroBatch", "PipelineSchedule", "split_micro_batch"]
