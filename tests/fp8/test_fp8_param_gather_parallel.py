"""``megatron.fp8_param_gather`` with pipeline parallelism (1F1B, interleaved, ZB-H1), context parallelism and MoE
experts (EP, ETP), each on 4 ranks with data parallelism.

Reference: the same job with fp8_param_gather off, which must train bit-identically (losses and fp32 main params),
as ``test_fp8_param_gather`` holds at TP / DP.  Why that is the exact relation: the bytes and scale of an fp8 weight
are those its layer makes from the bf16 weight when it quantizes it itself (``ds_megatron/fp8/param.py``), so every
forward and backward is the same arithmetic, and no clipping keeps the gradient norm's DP-shard order out of it.
What each layout adds: a stage holds only its own layers' fp8 weights (one stage below holds none:
``first_last_layers_bf16``), the interleaved schedule two chunks' in one buffer, ZB-H1 defers the fp8 weights'
gradients to its W pass (which must still reach their ``main_grad``), and CP puts the CP ranks into the DP group
over which the buffer is sharded and the amax agreed; the experts' fp8 weights are sharded over expert-DP and
split over ETP, their amax agreed over both (not EP), one scale per expert of a grouped weight.  That fp8 at PP,
CP and EP equals the one-rank fp8 model is held by ``test_fp8_pipeline``, ``test_fp8_context_parallel`` and
``test_fp8_experts``.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "pipeline"))
import test_pipeline_equivalence as equivalence  # noqa: E402
from harness import run_on_ranks  # noqa: E402

import ds_megatron  # noqa: E402
from ds_megatron.models import GPTConfig, GPTModel  # noqa: E402
from ds_megatron.models.gpt_chunks import GPTModelChunks  # noqa: E402

# equivalence's 4-layer GPT and data (buckets of 400 elements: DP shards cut the fp8 weights), fp8 tensorwise
MODEL = dict(equivalence.MODEL, fp8="e4m3")
# stage 0 of 2 holds layers 0 and 1, both kept in bf16: it has no fp8 weight
BF16_STAGE = dict(first_last_layers_bf16=True, num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=0)
STEPS = 2


def _train(gather: bool, pp: int = 1, cp: int = 1, ep: int = 1, pipeline=None, model=None):
    """STEPS steps of the global batch; the losses, the fp32 main params by one-rank name (gathered over every
    rank) and each rank's count of fp8 weights."""
    world = dist.get_world_size()
    pipeline = pipeline or {}
    cfg = equivalence._config(pp, 1, world // (pp * cp), "bf16", True, False, ep > 1, ep, "megatron", 0.0,
                              dict(pipeline, context_parallel_size=cp, fp8_param_gather=gather))
    state = ds_megatron.initialize_model_parallel(cfg)
    config = GPTConfig(**MODEL, **(model or {}))
    torch.manual_seed(7)
    if pp > 1:
        gpt = GPTModelChunks(config, state, num_model_chunks=pipeline.get("virtual_pipeline_model_parallel_size", 1))
        names = dict(gpt.named_gpt_parameters())
    else:
        gpt = GPTModel(config, state)
        names = dict(gpt.named_parameters())
    engine, optimizer, *_ = ds_megatron.initialize(model=gpt, config=cfg, parallel_state=state)
    losses = []
    for step in range(STEPS):
        losses.append(float(equivalence.step_loss(engine, state, step)))
    name_of = {p: n for n, p in names.items()}
    _, with_main = optimizer.state_dict_params()  # the params of the (gathered) main params, group by group
    expert = f"@ep{state.ep.rank}.etp{state.etp.rank}"  # an expert's weight is keyed by its holder too
    mains = optimizer.state_dict()["fp32_from_fp16_params"]
    mine = {name_of[p] + (expert if getattr(p, "is_expert", False) else ""): t.clone()
            for params, group in zip(with_main, mains) for p, t in zip(params, group)}
    fp8 = sum(p.dtype == torch.float8_e4m3fn for p in gpt.parameters())
    # what the plan counts: the fp8 weights one byte each, the other params two
    param_bytes = sum(p.numel() * (1 if p.dtype == torch.float8_e4m3fn else 2) for p in gpt.parameters())
    engine.megatron.destroy()
    everyone = [None] * world
    dist.all_gather_object(everyone, (mine, (fp8, param_bytes, state.layout)))
    main = {name: t for d, _ in everyone for name, t in d.items()}
    return losses, main, [r for _, r in everyone]


def _planned_param_bytes(layout, model, num_model_chunks: int):
    """Each rank's model param bytes by the memory plan with fp8_param_gather."""
    from ds_megatron.planning.memory import plan_memory
    plans = plan_memory(GPTConfig(**MODEL, **(model or {})), layout, "bf16", "adamw", micro_batch=equivalence.MBS,
                        distributed_optimizer=True, num_model_chunks=num_model_chunks, fp8_param_gather=True)
    return [next(p.model_param_bytes for p in plans if rank in p.ranks) for rank in range(layout.world_size)]


def _same_training(fp8_weights_per_rank, **case):
    """And the memory plan counts each rank's param bytes as allocated (the fp8 weights one byte each)."""
    off_losses, off_main, off_ranks = run_on_ranks(4, _train, False, **case)[0]
    on_losses, on_main, on_ranks = run_on_ranks(4, _train, True, **case)[0]
    on_fp8, off_fp8 = [r[0] for r in on_ranks], [r[0] for r in off_ranks]
    assert on_fp8 == fp8_weights_per_rank and off_fp8 == [0] * 4, (on_fp8, off_fp8)  # the bytes really are fp8
    v = (case.get("pipeline") or {}).get("virtual_pipeline_model_parallel_size", 1)
    assert [r[1] for r in on_ranks] == _planned_param_bytes(on_ranks[0][2], case.get("model"), v)
    assert on_losses == off_losses and len(set(on_losses)) == STEPS, (on_losses, off_losses)
    assert on_main.keys() == off_main.keys() and len(on_main) > 0
    for name in off_main:
        assert torch.equal(on_main[name], off_main[name]), (name, (on_main[name] - off_main[name]).abs().max())


@pytest.mark.parametrize("schedule,pipeline,model,fp8_per_rank", [
    ("1f1b", equivalence.ONE_CHUNK, BF16_STAGE, [0, 0, 8, 8]),
    ("interleaved", equivalence.V2, None, [8] * 4),
    ("zero_bubble", equivalence.ZB, equivalence.MOE, [12] * 4),
])
def test_pipeline_training_with_fp8_param_gather_is_bit_identical_to_without(schedule, pipeline, model, fp8_per_rank):
    """PP 2 x DP 2, 2 layers a stage: 4 fp8 linears a layer; with ZB-H1 every MLP 4 experts at EP 2 (QKV, proj
    and 2 local experts' fc1, fc2 a layer), whose deferred weight gradients must reach the fp8 weights' main_grad
    too."""
    _same_training(fp8_per_rank, pp=2, ep=2 if model is equivalence.MOE else 1,
                   pipeline=pipeline, model=model)


def test_context_parallel_training_with_fp8_param_gather_is_bit_identical_to_without():
    """CP 2 x DP 2: the fp8 buffer sharded and the amax agreed over the dp-cp group of 4."""
    _same_training([16] * 4, cp=2)


@pytest.mark.parametrize("grouped,etp,bias", [(False, 1, False), (True, 1, False), (True, 2, True)])
def test_expert_training_with_fp8_param_gather_is_bit_identical_to_without(grouped, etp, bias):
    """DP 4 with EP 2: each expert's fp8 weights sharded and their amax agreed over expert-DP (2), or with ETP 2
    (expert-DP 1) over the ETP ranks that split them; the grouped experts' weight holds two experts, each with its
    own scale.  With gpt-oss's expert biases (``bias``) the biases stay 16-bit: the same count of fp8 weights."""
    moe = dict(equivalence.MOE, moe_grouped_gemm=grouped, moe_add_bias_linear=bias)
    _same_training([8 + (8 if grouped else 16)] * 4, ep=2, model=moe,  # QKV, proj; 2 local experts x fc1, fc2
                   pipeline={"expert_tensor_parallel_size": etp})
