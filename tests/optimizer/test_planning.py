"""``ds-megatron plan`` figures against the tensors a built GPTModel and our optimizer allocate per rank."""
import json
import math
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
from ds_megatron.planning import activation_bytes, plan_memory
from ds_megatron.planning.memory import BYTES

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=300,
             hidden_dropout=0.0, attention_dropout=0.0)


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


PRECISION = {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
             "fp32": {}}
# (tp of 4 ranks, so DP = 4 / tp; precision; use_distributed_optimizer; grad_reduce_in_fp32 (None: the default))
ENGINE_CASES = [(tp, name, distopt, fp32_grads) for tp in (4, 2, 1) for name, distopt, fp32_grads in (
    ("bf16", False, None), ("bf16", True, None), ("bf16", False, False), ("bf16", True, False),
    ("fp16", False, None), ("fp16", True, False), ("fp32", False, None), ("fp32", True, None))]


def _engine_tensors(tp, name, distopt, fp32_grads):
    """What ``ds_megatron.initialize``'s engine holds on this rank after one step, by the plan's columns; the
    buffers' alignment padding apart (the plan leaves it out), with the padding itself."""
    megatron = {"tensor_model_parallel_size": tp, "use_distributed_optimizer": distopt}
    if fp32_grads is not None:
        megatron["grad_reduce_in_fp32"] = fp32_grads
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **PRECISION[name], "megatron": megatron}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(0)
    engine, *_ = ds_megatron.initialize(model=GPTModel(GPTConfig(**MODEL), state), config=cfg, parallel_state=state)
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(state.dp.rank))
    engine.backward(engine({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}))
    buffers = engine.megatron.ddp.all_buffers
    padding = sum(b.numel - sum(p.numel() for p in b.params) for b in buffers)  # param starts and bucket ends
    bound = sum(63 * len(b.params) + math.lcm(state.dp.size, 128) * len(b.buckets) for b in buffers) if distopt else 0
    model_params = list(engine.module.parameters())
    out = {"params": sum(p.numel() for p in model_params),
           "model_param_bytes": _nbytes(model_params),  # views of the param buffer with the distributed optimizer
           "param_buffer_bytes": sum(_nbytes([b.param_data]) for b in buffers if b.param_data is not None),
           "grad_bytes": sum(_nbytes([b.grad_data]) for b in buffers), "padding": padding, "padding_bound": bound,
           "grad_elem": buffers[0].grad_data.element_size()}
    inner = engine.optimizer.optimizer  # the torch optimizer: it steps the fp32 main params (or their shards)
    main = [p for g in inner.param_groups for p in g["params"]]
    if name != "fp32":
        out["main_param_bytes"] = _nbytes(main)
        engine.optimizer._copy_model_grads_to_main_grads()  # what the step makes (fp32 copies of 16-bit grads)
        in_buffer = {b.grad_data.untyped_storage().data_ptr() for b in buffers}
        out["main_grad_bytes"] = _nbytes([p.grad for p in main if p.grad is not None
                                          and p.grad.untyped_storage().data_ptr() not in in_buffer])
    engine.step()
    out["optimizer_state_bytes"] = _nbytes([t for st in inner.state.values() for k, t in st.items() if k != "step"])
    out["main_numel"] = sum(p.numel() for p in main)
    out["tp_rank"], out["dp"] = state.tp.rank, state.dp.size
    engine.megatron.destroy()
    return out


def _all_engine_cases():
    return [_engine_tensors(*case) for case in ENGINE_CASES]


def test_plan_static_bytes_are_what_the_engine_allocates_on_every_rank():
    """The plan's parameters, gradient buffer, fp32 main params and grads and optimizer states against the
    tensors the real engine holds, for bf16 / fp16 / fp32, with and without the distributed optimizer and
    grad_reduce_in_fp32, at DP 1, 2 and 4: equal up to the buffers' alignment padding, which is measured."""
    from ds_megatron.config import ParallelConfig
    cfg = GPTConfig(**MODEL)
    results = run_on_ranks(4, _all_engine_cases)
    for i, (tp, name, distopt, fp32_grads) in enumerate(ENGINE_CASES):
        layout = ParallelConfig(tensor_model_parallel_size=tp).layout(4)
        plans = plan_memory(cfg, layout, name, "adamw", micro_batch=2, distributed_optimizer=distopt,
                            grad_reduce_in_fp32=fp32_grads)
        for rank, measured in enumerate(r[i] for r in results):
            plan = plans[measured["tp_rank"]]
            what = (tp, name, distopt, fp32_grads, rank)
            assert rank in plan.ranks and plan.params == measured["params"], what
            elem = measured["grad_elem"]
            assert plan.grad_bytes == measured["grad_bytes"] - measured["padding"] * elem, what
            assert measured["padding"] <= measured["padding_bound"], what
            if distopt:  # the params live in the param buffer
                low = BYTES[name]
                assert plan.model_param_bytes == measured["param_buffer_bytes"] - measured["padding"] * low, what
            else:
                assert plan.model_param_bytes == measured["model_param_bytes"], what
            # The distributed optimizer's shards are 1/DP of the padded buffers, so a rank's share of the params
            # is the plan's 1/DP within the padding; over the DP ranks they cover every param once.
            slack = measured["padding"] if distopt else 0
            owned = plan.optimizer_state_bytes // 8
            assert abs(measured["main_numel"] - owned) <= slack, what
            assert measured["optimizer_state_bytes"] == 8 * measured["main_numel"], what
            if name != "fp32":
                assert measured["main_param_bytes"] == 4 * measured["main_numel"], what
                assert plan.main_param_bytes == 4 * owned, what
                # fp32 gradients: the main grads are the buffer itself; 16-bit ones: fp32 copies for the step.
                assert measured["main_grad_bytes"] == (0 if elem == 4 else 4 * measured["main_numel"]), what
                assert plan.main_grad_bytes == (0 if elem == 4 else 4 * owned), what
            else:
                assert plan.main_param_bytes == plan.main_grad_bytes == 0, what
        for tp_rank in range(tp):
            shares = [r[i]["main_numel"] for r in results if r[i]["tp_rank"] == tp_rank]
            assert sum(shares) == plans[tp_rank].params * (1 if distopt else 4 // tp), (tp, name, distopt, shares)


def test_plan_reproduces_megatron_cores_bytes_per_parameter():
    """megatron-core's table: bf16 params with fp32 grads and Adam take 18 bytes per parameter, 6 + 12 / d with
    the distributed optimizer (fp16 the same; fp32: 4 + 4 + 8)."""
    from ds_megatron.config import ParallelConfig
    big = GPTConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=128, vocab_size=32000)
    for dp in (1, 2, 4, 8):
        layout = ParallelConfig().layout(dp)
        for name, distopt, per_param in (("bf16", False, 18), ("fp16", False, 18), ("bf16", True, 6 + 12 / dp),
                                         ("fp32", False, 16), ("fp32", True, 8 + 8 / dp)):
            plan = plan_memory(big, layout, name, "adamw", distributed_optimizer=distopt)[0]
            static = (plan.model_param_bytes + plan.grad_bytes + plan.main_param_bytes + plan.main_grad_bytes
                      + plan.optimizer_state_bytes)
            assert static / plan.params == pytest.approx(per_param, rel=1e-5), (dp, name, distopt)
        # 16-bit gradients instead: 2 + 2 + 4 + 8, and the step's fp32 copies of them (+4).
        plan = plan_memory(big, layout, "bf16", "adamw", grad_reduce_in_fp32=False)[0]
        assert plan.grad_bytes == 2 * plan.params and plan.main_grad_bytes == 4 * plan.params


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
                                                                      moe_layer_freq=1)),
                                        # gpt-oss's biased experts split over ETP
                                        (dict(tp=1, ep=2, etp=2), dict(moe, moe_add_bias_linear=True,
                                                                      gated_linear_unit=True))):
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


SWIGLU = dict(gated_linear_unit=True, activation="silu", ffn_hidden_size=176)
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
LEAN = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"],
            mlp_sequence_tiles=4, loss_sequence_tiles=4)
MLA = dict(position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16,
           qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
# gpt-oss's layer: attention sinks (an unfused core), windows, the clamped quick-GELU GLU with +1, biased experts
GPT_OSS = dict(MOE, gated_linear_unit=True, activation="quick_gelu", activation_func_clamp_value=0.3,
               glu_linear_offset=1.0, softmax_type="learnable", moe_add_bias_linear=True, window_size=[7, 0],
               window_attn_skip_freq=[1, 0])
FP8 = dict(fp8="e4m3")


def _balance_routing(model, rank):
    """Route every token of this rank to ``moe_router_topk`` experts a stride ``num_experts / topk`` apart from
    expert ``rank`` (a test-only weight setting: the router's weight zero, a +10 logits bias on those experts), so
    that each rank's experts receive ``topk`` tokens per token of a rank and each expert as many as the others: the
    plan's balanced routing, whatever the expert-parallel layout."""
    from ds_megatron.moe.router import TopKRouter
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert routers
    for router in routers:
        e, k = router.num_experts, router.topk
        bias = torch.zeros(e, dtype=router.weight.dtype)
        bias[[(rank + i * e // k) % e for i in range(k)]] = 10.0
        with torch.no_grad():
            router.weight.zero_()
            if router.bias is None:
                router.bias = bias  # a plain tensor: the router adds it to its logits as gpt-oss's bias
            else:
                router.bias.copy_(bias)


def _measured_activations(tp, extra, dtype_name, cp=1, inner=None, ep=1, etp=None, balanced=False):
    """The highest point allocations reach in one forward + backward of a GPT (over the params and their
    gradients alive before: the job's gradient buffers are allocated once, and autograd adds into them), with the
    logits buffer the output layer keeps between steps.  The lowest of three passes, of six with TP: gloo's
    worker threads drop their references to a collective's tensors on their own schedule, which moves one pass's
    peak by up to three [s, b, h] buffers under sequence parallelism (the model's own need does not move), and
    in a loaded box's recomputed MoE layers, whose reruns' collectives sit at the peak, by up to a third of it
    (one pass in two or three at the floor, measured)."""
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    from ds_megatron.tensor_parallel import RNGStatesTracker, model_parallel_seed
    from ds_megatron.utils.memory import peak_allocated_bytes
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, cp=cp, ep=ep, etp=etp))
    if inner:  # a2a+p2p: all-to-all inside groups of `inner` CP ranks, the ring across them
        state.build_hierarchical_context_parallel(inner)
    torch.manual_seed(0)
    config = GPTConfig(**{**ACTIVATION_MODEL, **extra})
    model = GPTModel(config, state, rng_tracker=model_parallel_seed(0, state.tp.rank, tracker=RNGStatesTracker()))
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name])
    routed = []  # rows each MoE layer's local experts receive, in every forward (reruns too)
    if balanced:
        _balance_routing(model, dist.get_rank())
        for m in model.modules():
            if hasattr(m, "local_expert_indices") and hasattr(m, "expert_weights"):
                m.register_forward_pre_hook(lambda mod, args: routed.append(sum(args[1])))
    tokens = torch.randint(0, 512, (4, config.seq_length + 1), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    model(batch).backward()  # warm: lazily made state (RNG, caches) is not an activation
    for p in model.parameters():  # the job's gradients live in its buffers, allocated before any pass
        p.grad = torch.zeros_like(p)

    def peak_of_one_pass():
        for p in model.parameters():
            p.grad.zero_()
        return peak_allocated_bytes(lambda: model(batch).backward())[0]

    peak = min(peak_of_one_pass() for _ in range(6 if tp > 1 else 3))
    kept = model.logits_buffer._tensor  # the logits' buffer lives from step to step: part of the peak
    state.destroy()
    # balanced: topk rows per token of the rank's share (1 / TP under SP), gathered over ETP
    expected = config.moe_router_topk * 4 * config.seq_length // tp * state.layout.etp
    assert set(routed) <= {expected}, (sorted(set(routed)), expected)
    return peak + (kept.numel() * kept.element_size() if kept is not None else 0)


def _nets_of_a_dropped_all_reduce(passes):
    """The bytes left, by ``peak_allocated_bytes``, by a function that all-reduces a fresh tensor and drops it."""
    from ds_megatron.utils.memory import peak_allocated_bytes

    def reduce_and_drop():
        t = torch.ones(8)
        dist.all_reduce(t)
        del t

    return [peak_allocated_bytes(reduce_and_drop)[1] for _ in range(passes)]


def test_a_collectives_tensor_dropped_by_its_caller_is_counted_freed():
    # Unsettled, gloo's worker thread sometimes frees it where the profiler does not look (28-58 of 300 passes left
    # 32 bytes on two idle ranks); every memory test here would then count it alive.
    for nets in run_on_ranks(2, _nets_of_a_dropped_all_reduce, 200):
        assert set(nets) == {0}, sorted(set(nets))


@pytest.mark.parametrize("tp,extra,dtype_name", [
    (1, {}, "fp32"), (1, {}, "bf16"), (1, {"hidden_dropout": 0.1, "attention_dropout": 0.1}, "fp32"),
    (1, DROPOUT, "bf16"), (1, dict(DROPOUT, recompute_granularity="selective",
                                   recompute_modules=["core_attn", "mlp", "layernorm"]), "bf16"),
    (1, {"recompute_granularity": "full"}, "fp32"),
    (1, {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}, "fp32"),
    (1, {"loss_sequence_tiles": 4}, "fp32"),
    (2, {}, "fp32"), (2, {"sequence_parallel": True}, "fp32"),
    (1, SWIGLU, "fp32"), (1, MLA, "fp32"), (2, dict(MLA, sequence_parallel=True), "fp32"),
    (1, dict(MOE, gated_linear_unit=True, activation="silu", moe_shared_expert_intermediate_size=96), "fp32"),
    (2, MOE, "fp32"), (2, dict(MOE, sequence_parallel=True), "fp32"), (2, dict(MOE, sequence_parallel=True), "bf16"),
    (1, GPT_OSS, "fp32"), (1, {"mtp_num_layers": 2}, "fp32"),
    (2, {"mtp_num_layers": 2, "sequence_parallel": True}, "fp32"), (1, {"mtp_num_layers": 2}, "bf16"),
    (1, {"vocab_size": 8192, "loss_sequence_tiles": 2}, "fp32"),
    (1, {"vocab_size": 8192, "loss_sequence_tiles": 4}, "bf16"),
    (1, dict(DROPOUT, recompute_granularity="selective", recompute_modules=["core_attn"]), "fp32"),
    (1, dict(DROPOUT, recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"]),
     "fp32"),
    (1, {"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, "fp32"),
    (1, {"recompute_granularity": "selective", "recompute_modules": ["layernorm"]}, "fp32"),
    (1, {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp", "layernorm"]}, "fp32"),
    (1, {"mlp_sequence_tiles": 4}, "fp32"),
    (2, {"sequence_parallel": True, "recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
     "fp32"),
    # fp8: each linear's fp8 copies of its input and weight instead of its 16-bit input; in fc2's backward the
    # CPU torch._scaled_mm's fp32 copies of its operands (the peak)
    (1, FP8, "bf16"), (2, dict(FP8, sequence_parallel=True), "bf16"),
    (1, dict(FP8, fp8="hybrid", num_query_groups=2, recompute_granularity="selective", recompute_modules=["mlp"],
             **SWIGLU), "bf16"),
    (1, dict(FP8, recompute_granularity="full"), "bf16"),
    (1, dict(FP8, fp8_recipe="blockwise", hidden_size=128, ffn_hidden_size=512, seq_length=128), "bf16"),
    # each checkpoint's copies of the CPU generator and the tracker's two streams (15 KB): 16 tiles a layer were
    # planned at 0.82 without them; full recomputation with tiles, a recomputed layer's MLP tile by tile (0.94, and
    # 0.85 with fp8, when planned as the untiled rerun's)
    (1, {"mlp_sequence_tiles": 16}, "fp32"), (1, {"recompute_granularity": "full", "mlp_sequence_tiles": 4}, "fp32"),
    (1, dict(FP8, recompute_granularity="full", mlp_sequence_tiles=4), "bf16"),
    # recomputed MoE layers: the rerun's transients (moe_rerun_elements) beside the layer's set made again
    (1, dict(MOE, recompute_granularity="full"), "fp32"),
    (1, dict(MOE, recompute_granularity="full", recompute_method="block", recompute_num_layers=1), "fp32"),
    (1, dict(MOE, recompute_granularity="selective", recompute_modules=["moe"]), "fp32"),
    (1, dict(MOE, recompute_granularity="selective", recompute_modules=["core_attn", "moe", "layernorm"]), "fp32"),
    (1, dict(MOE, gated_linear_unit=True, activation="silu", moe_shared_expert_intermediate_size=96,
             moe_grouped_gemm=True, recompute_granularity="full"), "fp32"),
    (1, dict(MOE, moe_layer_freq=[0, 1], recompute_granularity="selective", recompute_modules=["mlp"]), "fp32"),
    # top-4 of narrow experts: the rerun's transients a fifth of the peak; at sequence 32 in bf16 the checkpoints'
    # generator states a seventh
    (1, dict(MOE, moe_router_topk=4, moe_ffn_hidden_size=16, recompute_granularity="full"), "fp32"),
    (1, dict(MOE, seq_length=32, recompute_granularity="selective",
             recompute_modules=["core_attn", "moe", "layernorm"]), "bf16"),
    (2, dict(MOE, sequence_parallel=True, moe_grouped_gemm=True, recompute_granularity="selective",
             recompute_modules=["moe", "layernorm"]), "fp32"),
    (2, dict(MOE, sequence_parallel=True, recompute_granularity="full", recompute_method="block",
             recompute_num_layers=1), "bf16")],
    ids=["fp32", "bf16", "dropout", "bf16-dropout", "bf16-selective-all-dropout", "recompute", "recompute-block", "loss-tiles", "tp2", "tp2-sp",
         "swiglu-ffn176", "mla", "tp2-sp-mla", "moe-swiglu-shared", "tp2-moe-etp2", "tp2-sp-moe-etp2",
         "bf16-tp2-sp-moe-etp2", "gpt-oss", "mtp2",
         "tp2-sp-mtp2", "bf16-mtp2",
         "vocab8192-loss-tiles2", "bf16-vocab8192-loss-tiles4", "selective-core-dropout", "selective-all-dropout",
         "selective-mlp", "selective-layernorm", "selective-core-mlp-layernorm", "mlp-tiles4",
         "tp2-sp-selective-core-mlp", "fp8", "fp8-tp2-sp", "fp8-hybrid-gqa-swiglu-selective-mlp", "fp8-recompute",
         "fp8-blockwise", "mlp-tiles16", "recompute-mlp-tiles4", "fp8-recompute-mlp-tiles4",
         "moe-recompute", "moe-recompute-block", "moe-selective-moe",
         "moe-selective-core-moe-layernorm", "moe-swiglu-shared-grouped-recompute", "dense-moe-selective-mlp",
         "moe-top4-narrow-recompute", "bf16-seq32-moe-selective-core-moe-layernorm",
         "tp2-sp-moe-grouped-selective-moe-layernorm", "bf16-tp2-sp-moe-recompute-block"])
def test_activation_plan_is_within_ten_percent_of_the_measured_peak(tp, extra, dtype_name):
    """Each layer by its own widths: a gated MLP whose ffn is not 4h (the old 4h-GELU count was 10% under),
    multi-latent attention (16% under when counted as standard attention), MoE layers by routed tokens, and
    the multi-token-prediction depths (unplanned before: 0.44 of the measured peak at two depths); the
    tiled loss's weight gradient summed over tiles beside each tile's (0.81 at vocab 8192 without it);
    selective recomputation and the MLP's tiles by what each keeps and reruns (planned as no recomputation
    before: 1.40 of the peak for core_attn + mlp + layernorm); bf16 attention dropout by what the math kernel keeps
    in fp32 (0.80 when counted as four s x s tensors in bf16); MoE under sequence parallelism by the ETP-gathered
    routed tokens (0.84 / 0.87 when divided by TP); recomputed MoE layers by their rerun's transients and, per
    layer, selective ``mlp`` for dense MLPs and ``moe`` for MoE layers (1.43 for ``moe`` planned as no
    recomputation before)."""
    cfg = GPTConfig(**{**ACTIVATION_MODEL, **extra})
    planned = activation_bytes(cfg, tp, 4, dtype_name, etp=tp)
    for measured in run_on_ranks(2, _measured_activations, tp, extra, dtype_name):
        print(f"planned / measured {planned / measured:.3f}")
        assert abs(planned / measured - 1) < 0.10, (planned, measured)


EP_MOE = dict(MOE, sequence_parallel=True)


RECOMPUTED_MOE = [dict(MOE, recompute_granularity="full"),
                  dict(MOE, recompute_granularity="selective", recompute_modules=["moe"]),
                  dict(EP_MOE, recompute_granularity="full")]


@pytest.mark.parametrize("tp,ep,extra,dtype_name,bound", [
    # bf16 within 10% as every bf16 case above: its CPU kernels (oneDNN's on some boxes) are not this box's everywhere
    (1, 2, MOE, "fp32", 0.03), (1, 2, MOE, "bf16", 0.10),
    (1, 2, dict(MOE, moe_token_dispatcher_type="allgather"), "fp32", 0.03), (2, 2, EP_MOE, "fp32", 0.03),
    (2, 1, EP_MOE, "fp32", 0.03), (1, 2, RECOMPUTED_MOE[0], "fp32", 0.10), (1, 2, RECOMPUTED_MOE[1], "fp32", 0.10),
    (2, 2, RECOMPUTED_MOE[2], "fp32", 0.10)],
    ids=["ep2", "bf16-ep2", "ep2-allgather", "tp2-sp-ep2-etp1", "tp2-sp-etp2", "ep2-recompute", "ep2-selective-moe",
         "tp2-sp-ep2-etp1-recompute"])
def test_activation_plan_at_expert_parallelism_is_near_the_measured_peak(tp, ep, extra, dtype_name, bound):
    """MoE layers at EP 2 on 2 ranks (ETP 1: with TP 2 + SP attention's TP group is the EP group; and ETP 2 = TP 2
    at EP 1), every token routed to experts that give each rank and each expert as many rows as the others (the
    plan's balanced routing; the rows each rank's experts received are checked).  Without recomputation the peak
    is at the start of backward, every tensor counted: within 3% (the output layer's backward without its input's
    gradient read 0.96 at TP 2 + SP; the scatter-add's kept rows counted as the ETP-gathered ones, with it, 1.06 at
    ETP 2); recomputed, within the 10% of the EP 1 cases, the rerun's EP terms held exactly by the test below."""
    cfg = GPTConfig(**{**ACTIVATION_MODEL, **extra})
    etp = 1 if ep > 1 else tp
    planned = activation_bytes(cfg, tp, 4, dtype_name, etp=etp, ep=ep)
    for measured in run_on_ranks(2, _measured_activations, tp, extra, dtype_name, ep=ep, etp=etp, balanced=True):
        print(f"planned / measured {planned / measured:.3f}")
        assert abs(planned / measured - 1) < bound, (planned, measured)


@pytest.mark.parametrize("extra", RECOMPUTED_MOE[:2], ids=["recompute", "selective-moe"])
def test_expert_parallelism_adds_to_a_recomputed_moe_layers_peak_what_the_plan_says(extra):
    """The same model and balanced routing at EP 2 and at EP 1: the peak, in the rerun of a recomputed MoE layer,
    grows by what the plan adds (``moe_rerun_elements``: the combined rows beside the rows back over EP), to within
    three generator states (the checkpoint's restore of the tracker's two streams, 10 KB on a CPU, made where the
    EP 2 rerun stops; the plan leaves it out).  Before: the rows back counted again beside the set that keeps them,
    and the scatter-add's sum, which the stopped rerun never makes: 55 KB over (23 KB at TP 2 + SP, not held
    here: under load one pass in six there still moves by 15 KB, see ``utils.memory``)."""
    from ds_megatron.planning.memory import CHECKPOINT_RNG_STATES
    from ds_megatron.planning.hardware import CPU_KERNELS
    cfg = GPTConfig(**{**ACTIVATION_MODEL, **extra})
    planned = [activation_bytes(cfg, 1, 4, "fp32", ep=ep) for ep in (1, 2)]
    measured = [run_on_ranks(2, _measured_activations, 1, extra, "fp32", ep=ep, balanced=True) for ep in (1, 2)]
    for at_ep1, at_ep2 in zip(*measured):
        print(f"EP 2 - EP 1: measured {at_ep2 - at_ep1}, planned {planned[1] - planned[0]}")
        tolerance = CHECKPOINT_RNG_STATES * CPU_KERNELS.rng_state_bytes
        assert abs((at_ep2 - at_ep1) - (planned[1] - planned[0])) <= tolerance, (measured, planned)


def _kept_after_forward(tp, extra):
    """What a bf16 GPT holds after its forward (the kept set and the head's tensors), over what was alive before."""
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    from ds_megatron.tensor_parallel import RNGStatesTracker, model_parallel_seed
    from ds_megatron.utils.memory import peak_allocated_bytes
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp))
    torch.manual_seed(0)
    config = GPTConfig(**{**ACTIVATION_MODEL, **extra})
    model = GPTModel(config, state, rng_tracker=model_parallel_seed(0, state.tp.rank, tracker=RNGStatesTracker()))
    model.to(torch.bfloat16)
    tokens = torch.randint(0, 512, (4, config.seq_length + 1), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    model(batch).backward()  # warm
    _, kept, loss = peak_allocated_bytes(lambda: model(batch))
    del loss
    state.destroy()
    return kept


@pytest.mark.parametrize("extra", [{}, dict(SWIGLU, num_query_groups=2, first_last_layers_bf16=True,
                                              num_layers=3, fp8="hybrid"), MLA,
                                   dict(MLA, fp8_recipe="blockwise", hidden_size=128, seq_length=128, q_lora_rank=128,
                                        kv_lora_rank=128, qk_head_dim=32, qk_pos_emb_head_dim=32, v_head_dim=32)],
                         ids=["gelu", "swiglu-gqa-middle-layer", "mla", "mla-blockwise"])
def test_fp8_layers_keep_their_fp8_copies_instead_of_the_16_bit_inputs_to_the_byte(extra):
    """Per layer and linear: the input's and the weight's fp8 copies and two scalar scales kept, the 16-bit inputs
    of QKV, fc1 (the norms' outputs) and fc2 (the activation's output) freed: the kept set changes by exactly the
    planned bytes (``fp8_layer_bytes``).  On one TP rank: with TP, gloo's threads keep a collective's buffers on
    their own schedule (see ``_measured_activations``), the 10% test above covers it."""
    tp = 1
    bf16_extra = {k: v for k, v in extra.items() if not k.startswith(("fp8", "first_last"))}
    planned = [activation_bytes(GPTConfig(**{**ACTIVATION_MODEL, **e}), tp, 4, "bf16", kept_only=True)
               for e in (bf16_extra, {**FP8, **extra})]
    bf16 = run_on_ranks(2, _kept_after_forward, tp, bf16_extra)
    fp8 = run_on_ranks(2, _kept_after_forward, tp, {**FP8, **extra})
    for a, b in zip(fp8, bf16):
        print(f"kept: fp8 - 16-bit {a - b}, planned {planned[1] - planned[0]}")
        assert a - b == planned[1] - planned[0] < 0, (a, b, planned)


def test_selective_recomputation_saves_what_the_plan_says():
    # With dropout on (attention's s x s tensors and the hidden masks): the measured saving of core_attn + mlp +
    # layernorm is the planned one within 10% of the peak without recomputation.
    selective = dict(DROPOUT, recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"])
    planned = [activation_bytes(GPTConfig(**{**ACTIVATION_MODEL, **extra}), 1, 4, "fp32")
               for extra in (DROPOUT, selective)]
    without = run_on_ranks(2, _measured_activations, 1, DROPOUT, "fp32")
    with_recompute = run_on_ranks(2, _measured_activations, 1, selective, "fp32")
    for a, b in zip(with_recompute, without):
        assert a < 0.7 * b, (a, b)
        assert abs((b - a) - (planned[0] - planned[1])) < 0.1 * b, (a, b, planned)
        print(f"selective core_attn+mlp+layernorm: {a / 2 ** 20:.2f} MiB against {b / 2 ** 20:.2f} MiB without "
              f"(planned {planned[1] / 2 ** 20:.2f} and {planned[0] / 2 ** 20:.2f})")


def test_activation_plan_falls_with_context_parallelism_as_measured():
    # Each CP rank holds seq_length / cp tokens: the plan halves, and so does the measured peak.
    cfg = GPTConfig(**ACTIVATION_MODEL)
    planned = activation_bytes(cfg, 1, 4, "fp32", cp=2)
    assert planned < 0.55 * activation_bytes(cfg, 1, 4, "fp32")
    for measured in run_on_ranks(2, _measured_activations, 1, {}, "fp32", 2):
        assert abs(planned / measured - 1) < 0.10, (planned, measured)


@pytest.mark.parametrize("comm_type,dtype_name,model,cp,inner", [
    ("p2p", "fp32", {}, 2, None), ("all_gather", "fp32", {}, 2, None), ("a2a", "bf16", {}, 2, None),
    ("p2p", "bf16", MLA, 2, None), ("a2a+p2p", "fp32", {}, 4, 2), ("p2p", "fp32", LEAN, 2, None),
    ("a2a", "fp32", LEAN, 2, None)],
    ids=["p2p", "all_gather", "a2a-bf16", "p2p-bf16-mla", "a2a+p2p-2x2", "p2p-lean", "a2a-lean"])
def test_context_parallel_cores_score_blocks_are_planned(comm_type, dtype_name, model, cp, inner):
    """At seq 512 the core's score blocks and (16-bit) fp32 working copies, and the all-gather's gathered K/V, are
    most of the peak: without them the plan read 0.90 (ring), 0.33 (all-gather) and 0.76 (Ulysses, bf16 0.83) of
    it at CP = 2, and 0.73 / 0.19 / 0.55 at seq 1024.  MLA's copies are at its own widths (q/k 24, v 16 here); the
    hierarchical ring's blocks are a quarter of its members' rows against their keys (CP 4 = 2 x 2).  ``LEAN``:
    selective core_attn (not under CP) + mlp + layernorm with MLP and loss tiles, whose peak is in a layer's
    attention backward (the top layer's MLP share freed by then)."""
    extra = {**model, "seq_length": 512, "cp_comm_type": comm_type}
    planned = activation_bytes(GPTConfig(**{**ACTIVATION_MODEL, **extra}), 1, 4, dtype_name, cp=cp,
                               hierarchical_inner=inner)
    for measured in run_on_ranks(cp, _measured_activations, 1, extra, dtype_name, cp, inner):
        print(f"planned / measured {planned / measured:.3f}")
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


def test_cuda_activations_are_korthikantis_count_with_flash_attention():
    """Korthikanti et al. 2022, eq. (2) per layer without sequence parallelism: sbh (10 + 24/t + 5as/(ht)) bytes
    in 16-bit with one-byte dropout masks: 10 = the two LayerNorms' inputs 4, QKV's and fc1's inputs 2 + 2 and the
    two hidden-dropout masks 1 + 1; 24/t = Q and K 4, V 2, the projection's input 2 (flash attention's output),
    fc1's output 8 and GELU's 8; 5as/(ht) = the scores' softmax 2, its dropout mask 1 and output 2, which flash
    attention does not keep (its RNG state only): on CUDA the kept set is sbh (10 + 24/t) exactly.  On a CPU the math
    kernel's s x s tensors and the masks in bf16 come on top."""
    from ds_megatron.planning.hardware import CPU_KERNELS, CUDA_KERNELS
    cfg = GPTConfig(**{**ACTIVATION_MODEL, **DROPOUT})
    s, b, h, a, layers = cfg.seq_length, 1, cfg.hidden_size, cfg.num_attention_heads, cfg.num_layers
    for t in (1, 2):
        def kept(kernels):
            return activation_bytes(cfg, t, b, "bf16", logits=False, embedding=False, kept_only=True, kernels=kernels)
        assert kept(CUDA_KERNELS) == layers * s * b * h * (10 + 24 / t)
        # CPU: three fp32 s x s tensors and fp32 q, k, v copies (the bf16 q, k, v freed) per layer, the masks in
        # bf16, and the core's output re-laid out by a copy (the math kernel writes [b, heads, s, d])
        cpu = layers * (3 * b * a // t * s * s * 4 + 3 * s * b * h / t * (4 - 2) + 2 * s * b * h * (2 - 1)
                        + 2 * s * b * h / t)
        assert kept(CPU_KERNELS) - kept(CUDA_KERNELS) == cpu


def test_cuda_fp8_backward_has_no_fp32_operand_copies():
    """fc2's weight-gradient GEMM on a CPU: torch._scaled_mm's fp32 copies of its operands ([T, h], [T, ffn]) and its
    fp32 output [h, ffn] on top of what CUDA holds (the output gradient's fp8 copy, the 16-bit output)."""
    from ds_megatron.planning.hardware import CPU_KERNELS, CUDA_KERNELS
    from ds_megatron.planning.memory import fp8_backward_bytes
    cfg = GPTConfig(**{**ACTIVATION_MODEL, **FP8})
    tokens, h, ffn = 256, cfg.hidden_size, cfg.ffn_hidden_size
    cpu, cuda = (fp8_backward_bytes(cfg, 0, 1, tokens, 2, kernels=k) for k in (CPU_KERNELS, CUDA_KERNELS))
    assert cuda == h * tokens + 2 * h * ffn
    assert cpu - cuda == 2 * 4 * (h + ffn) * tokens + 4 * h * ffn


def test_plan_with_a_gpu_profile_plans_its_kernels_and_the_cpu_profile_the_cpus(tmp_path, capsys):
    from ds_megatron.planning.hardware import CPU_KERNELS, CUDA_KERNELS, H100, hardware_from_dict, load_hardware
    from ds_megatron.planning.job_plan import plan_from_config
    from ds_megatron.planning.report import main
    from ds_megatron.errors import ConfigError
    assert load_hardware("h100").kernels is CUDA_KERNELS
    cpu_profile = dict(H100.to_json(), name="cpu", device="cpu")
    assert hardware_from_dict(cpu_profile).kernels is CPU_KERNELS
    with pytest.raises(ConfigError, match="device='tpu' is unknown"):
        hardware_from_dict(dict(cpu_profile, device="tpu"))
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "megatron": {"tensor_model_parallel_size": 2, "make_vocab_size_divisible_by": 128,
                        "model": {k: v for k, v in dict(ACTIVATION_MODEL, **DROPOUT).items()
                                  if k != "make_vocab_size_divisible_by"}}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))

    def plan(*hardware):
        assert main(["--config", str(path), "--world-size", "4", "--json", *hardware]) == 0
        return json.loads(capsys.readouterr().out)
    gpu, cpu = plan("--hardware", "h100"), plan()
    assert "activations as cuda kernels" in gpu["header"] and "activations as cpu kernels" in cpu["header"]
    for kernels, doc in ((CUDA_KERNELS, gpu), (CPU_KERNELS, cpu)):
        plans = plan_from_config(str(path), 4, kernels=kernels)[1]
        assert [r["activation_bytes"] for r in doc["roles"]] == [p.activation_bytes for p in plans]
    assert gpu["roles"][0]["activation_bytes"] < 0.6 * cpu["roles"][0]["activation_bytes"]  # no s x s tensors
