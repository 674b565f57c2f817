"""CUDA graphs with PP: the capture order is the order the pipeline runs (DeepSpeed's engine, and ours with
one or two chunks per stage), checked on CPU.

The order TE captures a stage's graphs in (``_order``) must be the order the
stage then replays them, or a graph's static buffers are reused while still
in flight.  DeepSpeed's ``TrainSchedule`` decides that order under
``engine.train_batch``; the first test reads it instruction by instruction and
compares it with Megatron's ``convert_schedule_table_to_order`` for one model
chunk, as the helper's plan computes it.  The second runs a real 2-stage
engine with the eager capturer and checks which micro-batch's graph each
forward replays.  The last runs our runtime (interleaved 1F1B, v = 1 and 2) the same way and holds
the capture order to the operations the runtime executed.
"""
import pytest
import torch
from deepspeed.runtime.pipe import schedule as ds_schedule

from harness import run_on_ranks

import ds_megatron
from ds_megatron.config import CudaGraphConfig
from ds_megatron.cuda_graphs.backends import EagerCapturer
from ds_megatron.cuda_graphs.schedule import plan_cuda_graphs
from ds_megatron.integration.cuda_graphs import attach_cuda_graphs
from ds_megatron.models import GPTConfig
from ds_megatron.models.gpt_chunks import GPTModelChunks


def _deepspeed_order(micro_batches, stages, stage):
    order = []
    for step in ds_schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage):
        for cmd in step:
            if isinstance(cmd, ds_schedule.ForwardPass):
                order.append(1)
            elif isinstance(cmd, ds_schedule.BackwardPass):
                order.append(-1)
    return order


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_capture_order_is_the_order_deepspeed_runs(stages):
    for micro_batches in range(stages, 9):
        for stage in range(stages):
            plan = plan_cuda_graphs([2], micro_batches, pipeline_parallel_size=stages, pipeline_parallel_rank=stage)
            assert list(plan.order) == _deepspeed_order(micro_batches, stages, stage), (micro_batches, stage)


MODEL = dict(num_layers=4, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, seq_length=8, vocab_size=40,
             hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=4)
GAS = 3


def _batches(step, micro_batches=GAS):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, MODEL["vocab_size"], (micro_batches, 2, MODEL["seq_length"] + 1), generator=g)
    return iter([(t[:, :-1], (t[:, 1:], torch.ones(2, MODEL["seq_length"]))) for t in tokens])


def _train(graphs):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 6, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "megatron": {"pipeline_model_parallel_size": 2}}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(3)
    model = ds_megatron.GPTPipelineModule(GPTConfig(**MODEL), state)
    engine, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    hook, capturer, replays = None, EagerCapturer(), []
    if graphs:
        hook = attach_cuda_graphs(engine, CudaGraphConfig(impl="transformer_engine", scope=["attn"], warmup_steps=1),
                                  capturer=capturer)
    losses = []
    for step in range(4):  # step 0 eager, captured at step 1's first forward, replays recorded in steps 2 and 3
        if hook is not None and hook.helper.captured:
            for i, runner in enumerate(hook.helper.runners):
                if not hasattr(runner, "_recorded"):
                    replay = runner.replay
                    runner.replay = lambda h, replay=replay, runner=runner, i=i: (
                        replays.append((i, runner.current_microbatch)), replay(h))[1]
                    runner._recorded = True
        losses.append(float(engine.train_batch(_batches(step))))
    out = dict(losses=losses, stage=state.pp.rank, calls=capturer.calls,
               order=hook.helper.plan.order if hook else None, replays=replays)
    engine.megatron.destroy()
    return out


def _eager_and_graphed():
    return _train(False), _train(True)


def test_pipeline_engine_replays_each_micro_batch_graph_in_schedule_order():
    for eager, graphed in run_on_ranks(2, _eager_and_graphed):
        assert graphed["losses"] == eager["losses"]
        assert graphed["calls"] == 1  # captured once, at the first micro-batch after the warm-up step
        assert list(graphed["order"]) == _deepspeed_order(GAS, 2, graphed["stage"])
        # Each stage holds 2 layers; every step replays micro-batch 0, 1, 2's graphs of each layer, in order.
        assert graphed["replays"] == [(layer, mb) for mb in range(GAS) for layer in range(2)] * 2


def _train_ours(graphs, vpp):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 6, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "megatron": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": vpp,
                        "pipeline_schedule": "interleaved_1f1b"}}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(3)
    model = GPTModelChunks(GPTConfig(**MODEL), state, num_model_chunks=vpp)
    engine, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    hook, capturer, replays, executed = None, EagerCapturer(), [], []
    if graphs:
        hook = attach_cuda_graphs(engine, CudaGraphConfig(impl="transformer_engine", scope=["attn"], warmup_steps=1),
                                  capturer=capturer)
    runtime = engine.megatron.pipeline_runtime
    chunk_of_layer = {id(layer): c for c, chunk in enumerate(model.chunks) for layer in chunk.layers}
    losses = []
    for step in range(3):  # step 0 eager, captured at step 1's start, so steps 1 and 2 replay
        if hook is not None and step == 1:
            for runner in hook.helper.runners:
                replay = runner.replay
                runner.replay = lambda h, replay=replay, runner=runner: (
                    replays.append((chunk_of_layer[id(runner.layer)], runner.current_microbatch)), replay(h))[1]
        losses.append(float(engine.train_batch(_batches(step, 4))))
        executed.append([(op.chunk + 1) * (1 if op.forward else -1) for op in runtime.executed])
    forwards = [(op.chunk, op.microbatch) for op in runtime.executed if op.forward]
    out = dict(losses=losses, calls=capturer.calls, order=hook.helper.plan.order if hook else None,
               replays=replays, executed=executed, forwards=forwards, num_captures=hook.num_captures if hook else 0)
    engine.megatron.destroy()
    return out


def _ours_eager_and_graphed(vpp):
    return _train_ours(False, vpp), _train_ours(True, vpp)


@pytest.mark.parametrize("vpp", [1, 2])
def test_our_runtime_captures_in_the_order_it_executes(vpp):
    for eager, graphed in run_on_ranks(2, _ours_eager_and_graphed, vpp):
        assert graphed["losses"] == eager["losses"]
        assert graphed["calls"] == 1 and graphed["num_captures"] == 1
        assert all(list(graphed["order"]) == order for order in graphed["executed"])
        # Each chunk holds 4 / (2 * vpp) layers: every forward of (chunk, micro-batch) replays that micro-batch's
        # graph of each of the chunk's layers, in the executed order, in both replayed steps.
        per_chunk = MODEL["num_layers"] // (2 * vpp)
        assert graphed["replays"] == [f for f in graphed["forwards"] for _ in range(per_chunk)] * 2
