"""The delayed recipe in real training steps: the amax history advances once per optimizer step, on Megatron's
optimizer path (``finalize_model_grads``) and on DeepSpeed's (after its optimizer step).

The test records, with its own hooks, every fp8 linear's amaxes as the layer sees them (its input, its weight,
the gradient of its output), folds them (MAX) over the micro-batches of a step and over all ranks (TP x DP), and
computes the history and the next step's scales from the recipe's definition: ``fp8_max / max(history) /
2^margin`` with ``fp8_amax_compute_algo "max"`` over a history of 2 steps.  The layers' scales must equal that
exactly after every step, be the same on every rank, and be the same in both micro-batches of a step (the
scales the forward quantized with, read by a pre-hook).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.fp8.recipe import E4M3_MAX, ROLES
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear

STEPS, ACCUMULATION, MARGIN = 3, 2, 1
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
             make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0, fp8="e4m3",
             fp8_recipe="delayed", fp8_amax_history_len=2, fp8_amax_compute_algo="max", fp8_margin=MARGIN)


def _first_tensor(out):
    return out[0] if isinstance(out, tuple) else out


def _train_and_record(impl: str, tp: int):
    import ds_megatron
    from ds_megatron.optimizer import get_param_groups
    world = dist.get_world_size()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUMULATION,
           "steps_per_print": 10 ** 6, "bf16": {"enabled": True},
           "megatron": {"tensor_model_parallel_size": tp, "sequence_parallel": tp > 1, "optimizer_impl": impl}}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(3)
    model = GPTModel(GPTConfig(**MODEL, sequence_parallel=tp > 1), state)
    optimizer = torch.optim.AdamW(get_param_groups(model), lr=5e-2)
    engine, _, _, _ = ds_megatron.initialize(model=model, optimizer=optimizer, config=cfg, parallel_state=state)
    linears = {n: m for n, m in engine.module.named_modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.fp8 is not None}
    assert len(linears) == 8
    step_amax = {}  # (name, role) -> this rank's MAX over the step's micro-batches
    used = []  # per micro-batch: {(name, role): scale the forward quantized with}

    def fold(name, role, t):
        a = t.detach().abs().amax().float()
        step_amax[name, role] = torch.maximum(step_amax.get((name, role), a), a)

    def pre(name, m, args):
        fold(name, "input", args[0])
        fold(name, "weight", m.weight)
        used[-1].update({(name, r): m.fp8.scale[r].clone() for r in ROLES})

    def post(name, m, args, out):
        _first_tensor(out).register_hook(lambda g: fold(name, "grad_output", g))

    for name, m in linears.items():
        m.register_forward_pre_hook(lambda m, a, name=name: pre(name, m, a))
        m.register_forward_hook(lambda m, a, o, name=name: post(name, m, a, o))
    g = torch.Generator().manual_seed(0)
    batches = torch.randint(0, 64, (STEPS * ACCUMULATION, world // tp, 17), generator=g)
    dp = state.dp
    history = {k: torch.zeros(2) for k in ((n, r) for n in linears for r in ROLES)}
    expected_scales, got_scales, used_per_step = [], [], []
    for step in range(STEPS):
        step_amax.clear()
        start = len(used)
        for micro in range(ACCUMULATION):
            used.append({})
            rows = batches[step * ACCUMULATION + micro, dp.rank:dp.rank + 1]
            engine.backward(engine(rows[:, :-1], rows[:, 1:]))
            engine.step()
        used_per_step.append(used[start:])
        keys = sorted(step_amax)
        agreed = torch.stack([step_amax[k] for k in keys])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank: TP and DP
        expected = {}
        for k, a in zip(keys, agreed):
            history[k] = torch.stack([a, history[k][0]])
            expected[k] = torch.tensor(E4M3_MAX) / history[k].max() / 2.0 ** MARGIN
        expected_scales.append(expected)
        got_scales.append({(n, r): m.fp8.scale[r].clone() for n, m in linears.items() for r in ROLES})
    engine.megatron.destroy()
    return expected_scales, got_scales, used_per_step


@pytest.mark.parametrize("impl,world,tp", [("megatron", 4, 2), ("deepspeed", 2, 1)], ids=["megatron-tp2-dp2",
                                                                                          "deepspeed-dp2"])
def test_scales_follow_the_steps_amaxes_over_tp_and_dp(impl, world, tp):
    results = run_on_ranks(world, _train_and_record, impl, tp)
    expected, got, used = results[0]
    for step in range(STEPS):
        for key, value in expected[step].items():
            assert got[step][key] == value, (step, key, got[step][key], value)
        # what each micro-batch of the step quantized with: the previous step's scales (1 at the first step)
        for micro in used[step]:
            for key, scale in micro.items():
                want = torch.tensor(1.0) if step == 0 else expected[step - 1][key]
                assert scale == want, (step, key, scale, want)
    assert any(v != 1.0 for v in expected[0].values())
    for other in results[1:]:  # every rank the same scales
        assert all(other[1][s][k] == got[s][k] for s in range(STEPS) for k in got[s])
