"""Each schedule's peak activation memory per rank, measured on the runtime, against ``ds-megatron plan``'s.

The plan walks the rank's own order (``planning.memory.schedule_peak_activations``): a chunk's activations of
a micro-batch are alive from its forward to its backward (ZB-H1: to its W).  The measurement is the highest
point CPU allocations reach during one step's schedule (``PipelineSchedule.run``, the optimizer step
excluded), after a warm-up step, the lowest of three (gloo's threads release a collective's tensors on
their own schedule).  Within 10%, as the one-rank activation plan is held in ``tests/optimizer/test_planning.py``,
at 2 and at 8 micro-batches per stage.  From the one to the other the peak grows by what the plan grows by (nothing:
the runtime lets go of its sends as the step goes, ``schedule_table.send_releases``; kept to the step's end, every
micro-batch's sent output and input gradient would stay) plus, on the last stage, the step's losses (one fp32
scalar per micro-batch, which the plan leaves out), to the byte.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.models import GPTConfig
from ds_megatron.models.gpt_chunks import GPTModelChunks
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.planning.memory import plan_memory
from ds_megatron.utils.memory import peak_allocated_bytes

MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512,
             make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0)
MBS = 4
SCHEDULES = {"1f1b": {"pipeline_schedule": "interleaved_1f1b"},
             "interleaved-v2": {"virtual_pipeline_model_parallel_size": 2},
             "zero-bubble": {"pipeline_schedule": "zero_bubble"}}


def _measure(pipeline, M):
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": M, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "megatron": {"pipeline_model_parallel_size": 2, **pipeline}}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(0)
    model = GPTModelChunks(GPTConfig(**MODEL), state,
                           num_model_chunks=pipeline.get("virtual_pipeline_model_parallel_size", 1))
    engine, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    tokens = torch.randint(0, 512, (M, MBS, 65), generator=torch.Generator().manual_seed(1))
    batches = [(t[:, :-1], (t[:, 1:], torch.ones(MBS, 64))) for t in tokens]
    engine.train_batch(iter(batches))  # warm-up: optimizer state, RNG, caches
    runtime = engine.megatron.pipeline_runtime
    peaks = []
    for _ in range(3):
        runtime.ddp.zero_grad_buffer()
        dist.barrier()
        peaks.append(peak_allocated_bytes(lambda: runtime.schedule.run(iter(batches), M))[0])
    rank = state.pp.rank
    engine.megatron.destroy()
    return rank, min(peaks)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_peak_activations_per_rank_are_the_plans(name):
    pipeline = SCHEDULES[name]
    schedule = pipeline.get("pipeline_schedule", "interleaved_1f1b")
    planned, measured = {}, {}
    for m in (4, 16):
        plans = plan_memory(GPTConfig(**MODEL), ParallelLayout(world_size=2, pp=2), "fp32", micro_batch=MBS,
                            micro_batches=m, schedule=schedule,
                            num_model_chunks=pipeline.get("virtual_pipeline_model_parallel_size", 1))
        for rank, peak in run_on_ranks(2, _measure, pipeline, m, timeout=300):
            planned[rank, m], measured[rank, m] = plans[rank].activation_bytes, peak
            assert abs(planned[rank, m] / peak - 1) < 0.10, (name, rank, m, planned[rank, m], peak)
    for rank in range(2):
        losses = 4 * (16 - 4) if rank == 1 else 0
        assert measured[rank, 16] - measured[rank, 4] == planned[rank, 16] - planned[rank, 4] + losses, \
            (name, rank, "planned", planned[rank, 4], planned[rank, 16], "measured", measured[rank, 4],
             measured[rank, 16])
