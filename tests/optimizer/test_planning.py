"""``ds-megatron plan`` figures against the tensors a built GPTModel and our optimizer allocate per rank."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.models.gpt import GPTModel
from ds_megatron.config import GPTConfig
from ds_megatron.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer, get_param_groups
from ds_megatron.planning import activation_bytes, plan_memory

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=300,
             hidden_dropout=0.0, attention_dropout=0.0)


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(dtype):
    state = ds_megatron.initialize_model_parallel({"megatron": {"tensor_model_parallel_size": 2}})
    model = GPTModel(GPTConfig(**MODEL), state).to(dtype)
    inner = torch.optim.AdamW(get_param_groups(model, 0.1), lr=1e-3)
    opt = (FP32Optimizer(inner, parallel_state=state) if dtype == torch.float32 else
           Float16OptimizerWithFloat16Params(inner, grad_scaler=None, parallel_state=state))
    tokens = torch.randint(0, 300, (2, 17))
    model({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}).backward()
    params = list(model.parameters())
    measured = {"params": sum(p.numel() for p in params), "model_param_bytes": _nbytes(params),
                "grad_bytes": _nbytes([p.grad for p in params])}
    if dtype != torch.float32:
        opt._copy_model_grads_to_main_grads()
        measured["main_grad_bytes"] = _nbytes([p.main_param.grad for p in params])
        measured["main_param_bytes"] = _nbytes([p.main_param for p in params])
    opt.step()
    measured["optimizer_state_bytes"] = _nbytes([t for s in opt.state.values() for k, t in s.items() if k != "step"])
    tp_rank = state.tp.rank
    state.destroy()
    return tp_rank, measured


def test_plan_matches_measured_tensors_on_every_rank():
    cfg = GPTConfig(**MODEL)
    from ds_megatron.config import ParallelConfig
    layout = ParallelConfig(tensor_model_parallel_size=2).layout(4)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        plans = plan_memory(cfg, layout, name, "adamw", micro_batch=2)
        for rank, (tp_rank, measured) in enumerate(run_on_ranks(4, _measure, dtype)):
            plan = plans[tp_rank]
            assert rank in plan.ranks
            for key, value in measured.items():
                assert getattr(plan, key) == value, (name, rank, key)
            if name == "bf16":  # the seed's accounting: 2 + 2 + 4 + 8 bytes per param (+4 main grads)
                assert plan.model_param_bytes + plan.grad_bytes + plan.main_param_bytes + \
                    plan.optimizer_state_bytes == 16 * plan.params
            else:
                assert plan.main_param_bytes == 0 and plan.optimizer_state_bytes == 8 * plan.params


def test_cli_prints_each_role_and_fails_in_one_line(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "megatron": {"tensor_model_parallel_size": 2, "model": MODEL}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    run = subprocess.run([sys.executable, "-m", "ds_megatron.cli", "plan", "--config", str(path), "--world-size", "4",
                          "--json"], capture_output=True, text=True, timeout=60)
    doc = json.loads(run.stdout)
    assert [r["role"] for r in doc["roles"]] == ["tp rank 0", "tp rank 1"] and doc["roles"][0]["ranks"] == [0, 2]
    assert "bf16" in doc["header"] and "torch" not in run.stderr
    (comm,) = doc["comm"]  # the bytes on the wire (tests/test_bytes_on_wire.py holds them to measured steps)
    assert sorted(comm["bus_bytes"]) == ["dp-cp", "optimizer", "tp"] and comm["total"] > 0
    text = subprocess.run([sys.executable, "-m", "ds_megatron.cli", "plan", "--config", str(path), "--world-size",
                           "4"], capture_output=True, text=True, timeout=60).stdout
    assert "bus MB per step per rank" in text and "every rank: dp-cp" in text
    cfg["fp16"] = {"enabled": True}
    path.write_text(json.dumps(cfg))
    bad = subprocess.run([sys.executable, "-m", "ds_megatron.cli", "plan", "--config", str(path), "--world-size", "4"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "ds-megatron plan: error: fp16.enabled and bf16.enabled are both true; enable at most one of them"]


def _measure_moe(layout_kwargs, model_kwargs):
    megatron = {"tensor_model_parallel_size": layout_kwargs["tp"], "expert_model_parallel_size": layout_kwargs["ep"],
                "expert_tensor_parallel_size": layout_kwargs["etp"]}
    state = ds_megatron.initialize_model_parallel({"megatron": megatron})
    model = GPTModel(GPTConfig(**MODEL, **model_kwargs), state)
    out = (sum(p.numel() for p in model.parameters()), list(state.tp.ranks))
    state.destroy()
    return out


def test_plan_counts_moe_experts_as_built_on_every_rank():
    from ds_megatron.config import ParallelConfig
    moe = dict(num_experts=4, moe_ffn_hidden_size=48, moe_layer_freq=2)
    for layout_kwargs, model_kwargs in ((dict(tp=2, ep=4, etp=1), moe),  # folding
                                        (dict(tp=1, ep=2, etp=1), dict(moe, moe_shared_expert_ffn_hidden_size=16,
                                                                      moe_layer_freq=1))):
        cfg = GPTConfig(**MODEL, **model_kwargs)
        layout = ParallelConfig(tensor_model_parallel_size=layout_kwargs["tp"],
                                expert_model_parallel_size=layout_kwargs["ep"],
                                expert_tensor_parallel_size=layout_kwargs["etp"]).layout(4)
        plans = plan_memory(cfg, layout, "fp32", "adamw")
        assert plans[0].params_expert > 0
        for rank, (numel, _) in enumerate(run_on_ranks(4, _measure_moe, layout_kwargs, model_kwargs)):
            plan = next(p for p in plans if rank in p.ranks)
            assert plan.params == numel, (layout_kwargs, rank)


def _measure_distributed(model_kwargs):
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "megatron": {"tensor_model_parallel_size": 2, "use_distributed_optimizer": True}}
    state = ds_megatron.initialize_model_parallel(cfg)
    model = GPTModel(GPTConfig(**MODEL, **model_kwargs), state)
    engine, optimizer, _, _ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    engine.backward(engine({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}))
    engine.step()
    measured = optimizer.state_bytes()
    num_tensors = len(list(model.parameters()))
    engine.megatron.ddp_in_engine.detach()
    state.destroy()
    return measured, num_tensors


def test_plan_shards_main_params_and_states_with_the_distributed_optimizer():
    from ds_megatron.config import ParallelConfig
    cfg = GPTConfig(**MODEL)
    layout = ParallelConfig(tensor_model_parallel_size=2).layout(4)
    plan = plan_memory(cfg, layout, "bf16", "adamw", distributed_optimizer=True)[0]
    full = plan_memory(cfg, layout, "bf16", "adamw")[0]
    assert plan.main_param_bytes == 4 * -(-full.params // 2)
    for measured, num_tensors in run_on_ranks(4, _measure_distributed, {}):
        # The buffers align each param to 64 elements and a bucket to lcm(DP, 128); Adam keeps a
        # 4-byte step per param piece.  Everything else is the 1/DP shard the plan counts.
        slack = (64 * num_tensors + 128) * (4 + 8) + 4 * num_tensors
        planned = plan.main_param_bytes + plan.optimizer_state_bytes
        assert abs(measured["total"] - planned) <= slack, (measured, planned, slack)
        assert measured["total"] < 0.75 * (full.main_param_bytes + full.optimizer_state_bytes)


ACTIVATION_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512,
                        make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0)


def _measured_activations(tp, extra, dtype_name, cp=1):
    """The highest point allocations reach in one forward + backward of a GPT (over the params alive before),
    with the logits buffer the output layer keeps between steps.  The lowest of three passes: gloo's worker
    threads drop their references to a collective's tensors on their own schedule, which moves one pass's
    peak by up to three [s, b, h] buffers under sequence parallelism (the model's own need does not move)."""
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    from ds_megatron.tensor_parallel import RNGStatesTracker, model_parallel_seed
    from ds_megatron.utils.memory import peak_allocated_bytes
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, cp=cp))
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**{**ACTIVATION_MODEL, **extra}), state,
                     rng_tracker=model_parallel_seed(0, state.tp.rank, tracker=RNGStatesTracker()))
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name])
    tokens = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    model(batch).backward()  # warm: lazily made state (RNG, caches) is not an activation

    def peak_of_one_pass():
        for p in model.parameters():
            p.grad = None
        return peak_allocated_bytes(lambda: model(batch).backward())[0]

    peak = min(peak_of_one_pass() for _ in range(3))
    kept = model.logits_buffer._tensor  # the logits' buffer lives from step to step: part of the peak
    state.destroy()
    return peak + (kept.numel() * kept.element_size() if kept is not None else 0)


@pytest.mark.parametrize("tp,extra,dtype_name", [
    (1, {}, "fp32"), (1, {}, "bf16"), (1, {"hidden_dropout": 0.1, "attention_dropout": 0.1}, "fp32"),
    (1, {"recompute_granularity": "full"}, "fp32"), (2, {}, "fp32"), (2, {"sequence_parallel": True}, "fp32")],
    ids=["fp32", "bf16", "dropout", "recompute", "tp2", "tp2-sp"])
def test_activation_plan_is_within_ten_percent_of_the_measured_peak(tp, extra, dtype_name):
    cfg = GPTConfig(**{**ACTIVATION_MODEL, **extra})
    planned = activation_bytes(cfg, tp, 4, dtype_name)
    for measured in run_on_ranks(2, _measured_activations, tp, extra, dtype_name):
        assert abs(planned / measured - 1) < 0.10, (planned, measured)


def test_activation_plan_falls_with_context_parallelism_as_measured():
    # Each CP rank holds seq_length / cp tokens: the plan halves, and so does the measured peak.
    cfg = GPTConfig(**ACTIVATION_MODEL)
    planned = activation_bytes(cfg, 1, 4, "fp32", cp=2)
    assert planned < 0.55 * activation_bytes(cfg, 1, 4, "fp32")
    for measured in run_on_ranks(2, _measured_activations, 1, {}, "fp32", 2):
        assert abs(planned / measured - 1) < 0.10, (planned, measured)


def test_cli_plan_of_the_cp2_config_shows_activations_per_rank_falling_with_cp(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = json.load(open(os.path.join(root, "ds_configs", "gpt_cp2_tp2.json")))

    def plan(cp):
        cfg["megatron"]["context_parallel_size"] = cp
        path = tmp_path / f"cp{cp}.json"
        path.write_text(json.dumps(cfg))
        run = subprocess.run([sys.executable, "-m", "ds_megatron.cli", "plan", "--config", str(path),
                              "--world-size", str(2 * cp), "--json"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    one, two = plan(1), plan(2)
    assert "cp=2" in two["header"] and "cp=" not in one["header"]
    ratio = two["roles"][0]["activation_bytes"] / one["roles"][0]["activation_bytes"]
    assert 0.45 < ratio < 0.52, ratio  # all but the output-weight gradient halves
