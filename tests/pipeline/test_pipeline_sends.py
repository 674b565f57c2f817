"""The pipeline runtime lets go of its sends as the step goes, not at its end: on 2 gloo ranks, many micro-batches.

``PipelineSchedule.run`` over tiny float64 chunks (a linear layer and tanh each; the last adds a squared-error loss),
1F1B, interleaved (v = 2) and ZB-H1, with 4 x pp and 8 x pp micro-batches.  Before each operation the runtime's count
of sends in flight is what ``schedule_table.send_releases`` predicts, at most 2 v pp (the step's in-flight chunk
micro-batches; without releases it would reach v m), and the same peak at both micro-batch counts.  The losses and
every weight's gradient equal those of the whole model run on one rank in float64, micro-batch after micro-batch.
"""
import pytest
import torch

from harness import run_on_ranks

from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.pipeline_parallel.schedule_table import rank_operations, send_releases, sends_of
from ds_megatron.tensor_parallel.weight_grad_store import WeightGradStore, linear

SEQ, MBS, HIDDEN = 3, 2, 8


class _Chunk(torch.nn.Module):
    """One virtual stage: tanh(x W^T + b); the last adds the masked squared error against the labels."""

    def __init__(self, stage: int, last: bool):
        super().__init__()
        g = torch.Generator().manual_seed(100 + stage)
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN ** .5)
        self.bias = torch.nn.Parameter(torch.randn(HIDDEN, generator=g, dtype=torch.float64) / 10)
        self.last = last
        self.weight_grad_store = None  # ZB-H1: its weight gradient deferred to W

    def forward(self, x, labels=None, loss_mask=None):
        y = torch.tanh(linear(x, self.weight, self.bias, self.weight_grad_store))
        if not self.last:
            return y
        return (((y - labels) ** 2).sum(-1) * loss_mask).sum() / loss_mask.sum()


def _micro_batches(m):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(SEQ, MBS, HIDDEN, generator=g, dtype=torch.float64),
             (torch.randn(SEQ, MBS, HIDDEN, generator=g, dtype=torch.float64),
              (torch.rand(SEQ, MBS, generator=g) > 0.3).double()))
            for _ in range(m)]


def _reference(stages, m):
    """The whole model on this rank: each micro-batch's loss, and the gradients summed as the schedule averages."""
    chunks = [_Chunk(s, s == stages - 1) for s in range(stages)]
    losses = []
    for tokens, (labels, mask) in _micro_batches(m):
        x = tokens
        for chunk in chunks[:-1]:
            x = chunk(x)
        loss = chunks[-1](x, labels, mask)
        (loss / m).backward()
        losses.append(loss.detach())
    return losses, [(c.weight.grad, c.bias.grad) for c in chunks]


def _run(v, schedule_name):
    from ds_megatron.pipeline_parallel.p2p_communication import PipelineChannels
    from ds_megatron.pipeline_parallel.schedules import PipelineSchedule
    state = ParallelState.build(ParallelLayout(world_size=2, pp=2))
    p, rank = state.pp.size, state.pp.rank
    channels = PipelineChannels(state)
    out = []
    for m in (4 * p, 8 * p):
        chunks = [_Chunk(c * p + rank, c * p + rank == p * v - 1) for c in range(v)]
        store = None
        if schedule_name == "zero_bubble":
            store = WeightGradStore()
            for chunk in chunks:
                chunk.weight_grad_store = store
        schedule = PipelineSchedule(chunks, state.pp, channels, (SEQ, MBS, HIDDEN), torch.float64,
                                    torch.device("cpu"), schedule=schedule_name, weight_grad_store=store)
        losses = schedule.run(iter(_micro_batches(m)), m)
        ref_losses, ref_grads = _reference(p * v, m)
        ops = rank_operations(m, v, pipeline_parallel_size=p, pipeline_parallel_rank=rank, schedule=schedule_name)
        predicted, held = [], 0
        for op, released in zip(ops, send_releases(m, v, p, rank, None, schedule_name)):
            predicted.append(held)
            held += (sends_of(op, rank, p, v) is not None) - len(released)
        out.append((m, schedule.sends_held, predicted + [held], losses, ref_losses if rank == p - 1 else [],
                    [(c.weight.grad, c.bias.grad) for c in chunks], [ref_grads[c * p + rank] for c in range(v)]))
    channels.destroy()
    state.destroy()
    return out


@pytest.mark.parametrize("v,schedule", [(1, "interleaved_1f1b"), (2, "interleaved_1f1b"), (1, "zero_bubble")],
                         ids=["1f1b", "interleaved", "zb-h1"])
def test_sends_are_released_during_the_step_and_results_are_one_ranks(v, schedule):
    p = 2
    for per_m in run_on_ranks(p, _run, v, schedule, timeout=120):
        peaks = []
        for m, held, predicted, losses, ref_losses, grads, ref_grads in per_m:
            assert held == predicted, m
            assert max(held) <= 2 * v * p, (m, max(held))
            peaks.append(max(held))
            torch.testing.assert_close(torch.stack(losses) if losses else torch.zeros(0),
                                       torch.stack(ref_losses) if ref_losses else torch.zeros(0),
                                       rtol=1e-12, atol=0)
            torch.testing.assert_close(grads, ref_grads, rtol=1e-12, atol=1e-15)
        assert peaks[0] == peaks[1], "the sends held grow with the micro-batches"


def _evaluate():
    """``forward_only`` over 1F1B's straight pipeline at 4 x pp and 8 x pp micro-batches: the sends held before each
    operation, and the losses."""
    from ds_megatron.pipeline_parallel.p2p_communication import PipelineChannels
    from ds_megatron.pipeline_parallel.schedules import PipelineSchedule
    state = ParallelState.build(ParallelLayout(world_size=2, pp=2))
    p, rank = state.pp.size, state.pp.rank
    channels = PipelineChannels(state)
    chunks = [_Chunk(rank, rank == p - 1)]
    schedule = PipelineSchedule(chunks, state.pp, channels, (SEQ, MBS, HIDDEN), torch.float64, torch.device("cpu"))
    out = []
    for m in (4 * p, 8 * p):
        losses = schedule.run(iter(_micro_batches(m)), m, forward_only=True)
        out.append((m, schedule.sends_held, losses, _reference(p, m)[0] if rank == p - 1 else []))
    channels.destroy()
    state.destroy()
    return out


def test_an_evaluation_holds_at_most_pp_sends_and_its_losses_are_one_ranks():
    """No message comes back in an evaluation's straight pipeline: the first rank holds pp sends at most (it sent
    every micro-batch before without a bound), the same at both micro-batch counts, and the losses are the whole
    model's on one rank."""
    p = 2
    for rank, per_m in enumerate(run_on_ranks(p, _evaluate, timeout=120)):
        peaks = []
        for m, held, losses, ref_losses in per_m:
            peaks.append(max(held))
            torch.testing.assert_close(torch.stack(losses) if losses else torch.zeros(0),
                                       torch.stack(ref_losses) if ref_losses else torch.zeros(0),
                                       rtol=1e-12, atol=0)
        assert peaks[0] == peaks[1] == (p if rank == 0 else 0), (rank, peaks)
