"""``megatron.fp8_param_gather``: the fp8 layers' weights as fp8 bytes in a uint8 buffer, cast from the distributed
optimizer's fp32 main params with a scale agreed over DP (and TP), all-gathered one byte a weight.

References: the float64 quantization of the gathered main params, written here; the same training with
fp8_param_gather off (the layer then quantizes its bf16 weight itself: the same bytes and scale, derived in
``ds_megatron/fp8/param.py``, so the losses must be bit-identical); the plan's formulas.
"""
from __future__ import annotations

import pytest
import torch

from harness import run_on_ranks

import ds_megatron
from ds_megatron.config import GPTConfig, split_config
from ds_megatron.errors import ConfigError
from ds_megatron.models.gpt import GPTModel
from ds_megatron.tensor_parallel import RNGStatesTracker, model_parallel_seed
from ds_megatron.utils.collectives import count_bytes

# With buckets of 4000 elements (``_config``) the two DP shards of each layer's second fp8 bucket (its projection
# and QKV weights) part inside the QKV weight: its scale needs both ranks' amaxes.
MODEL = dict(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=80, seq_length=16, vocab_size=64,
             hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8, fp8="e4m3")
B, STEPS = 2, 3
E4M3_MAX = 448.0


def _config(gather: bool, tp: int = 1):
    # No clipping: its coefficient divides by the gradient norm, summed over the DP shards, which the fp8 buffer
    # moves (the same terms in another order: the last bits differ).
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 9, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
            "megatron": {"use_distributed_optimizer": True, "fp8_param_gather": gather,
                         "tensor_model_parallel_size": tp, "overlap_grad_reduce": True, "overlap_param_gather": True,
                         "bucket_size": 4000}}


def _engine(gather: bool, tp: int):
    cfg = _config(gather, tp)
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**MODEL), state,
                     rng_tracker=model_parallel_seed(0, state.tp.rank, tracker=RNGStatesTracker()))
    engine, optimizer, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    return engine, optimizer, model, state


def _step(engine, state, step: int, started=None) -> float:
    g = torch.Generator().manual_seed(100 * step + state.dp.rank)
    tokens = torch.randint(0, MODEL["vocab_size"], (B, MODEL["seq_length"] + 1), generator=g)
    loss = engine({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    engine.backward(loss)
    if started is not None:  # which bucket groups' reductions backward started (overlap_grad_reduce)
        started.extend(group.grad_reduce_handles is not None for group in engine.megatron.ddp.bucket_groups)
    engine.step()
    return loss.item()


def _main_params(model, optimizer):
    """The fp32 main params, gathered, by param name."""
    name_of = {p: n for n, p in model.named_parameters()}
    _, with_main = optimizer.state_dict_params()  # the params of the saved main params, group by group
    return {name_of[p]: t for params, group in zip(with_main, optimizer.state_dict()["fp32_from_fp16_params"])
            for p, t in zip(params, group)}


def _train(gather: bool, tp: int = 1, checkpoint_dir=None):
    """STEPS steps; each step's loss and collectives, the fp8 weights' bytes and scales, the gathered main params,
    the param buffers' sizes; with ``checkpoint_dir`` (a path every rank shares) saved before the last step, and
    the last step's loss again from a fresh engine that loaded it."""
    engine, optimizer, model, state = _engine(gather, tp)
    losses, records, started = [], [], []
    saved_main = None
    for step in range(STEPS):
        if checkpoint_dir is not None and step == STEPS - 1:
            ds_megatron.save_dist_checkpoint(engine, checkpoint_dir)
            saved_main = _main_params(model, optimizer)
        with count_bytes() as counter:
            losses.append(_step(engine, state, step, started if step == STEPS - 1 else None))
        records.append([(r.op, r.group, r.payload_bytes, r.bus_bytes) for r in counter.records])
    names = [n for n, _ in model.named_parameters()]
    main = _main_params(model, optimizer)
    try:
        optimizer.reload_model_params()  # the fp8 bytes are no source of main params
        reload = "accepted"
    except ValueError as e:
        reload = str(e)
    optimizer.finish_param_sync()  # the last step's overlapped all-gather writes the bytes read next
    fp8 = {n: (p.detach().view(torch.uint8).clone(), p.fp8_scale_inv.clone())
           for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    buffers = [(str(b.param_dtype), b.numel, sum(p.numel() for p in b.params), b.param_data.numel()
                * b.param_data.element_size()) for b in engine.megatron.ddp.all_buffers]
    out = {"losses": losses, "records": records, "names": names, "main": main, "fp8": fp8, "started": started,
           "saved_main": saved_main, "reload": reload,
           "buffers": buffers, "layout": state.layout, "tp_rank": state.tp.rank,
           "groups": [sorted(str(b.param_data.dtype) for b in group.buckets)
                      for group in engine.megatron.ddp.bucket_groups]}
    engine.megatron.destroy()
    if checkpoint_dir is not None:
        engine, _, _, state = _engine(gather, tp)
        ds_megatron.load_dist_checkpoint(engine, checkpoint_dir)
        out["resumed_loss"] = _step(engine, state, STEPS - 1)
        engine.megatron.destroy()
    return out


def _train_both(checkpoint_dir: str, tp: int = 1):
    return _train(False, tp), _train(True, tp, checkpoint_dir)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fp8_param_gather"))


@pytest.fixture(scope="module")
def dp2(checkpoint_dir):
    return run_on_ranks(2, _train_both, checkpoint_dir)


def test_training_is_bit_identical_to_quantizing_the_bf16_weights_in_the_layer(dp2):
    """The fp8 bytes and scale are those the layer makes from its bf16 weight, so forward, backward and every
    step are the same arithmetic (without clipping: see ``_config``): the losses and the fp32 main params are equal
    to the bit."""
    for off, on in dp2:
        assert on["losses"] == off["losses"]
        assert on["main"].keys() == off["main"].keys()
        for name in on["main"]:
            assert torch.equal(on["main"][name], off["main"][name]), name
        assert len(set(off["losses"])) == STEPS  # it trained


def test_fp8_weight_gradients_start_their_buckets_reduction_in_backward_grouped_as_seed_004_says(dp2):
    """The fp8 weights' gradients come into main_grad inside the GEMM's backward (no .grad): the buffer's hook still
    marks them ready, so with overlap_grad_reduce every bucket group's reduce-scatter starts in backward.  One
    group per fp8 bucket, the bf16 buckets in the last one."""
    for _, on in dp2:
        assert len(on["started"]) > 2 and all(on["started"]), on["started"]
        groups = on["groups"]
        assert all(g == ["torch.uint8"] for g in groups[:-1]), groups
        assert groups[-1][-1] == "torch.uint8" and "torch.bfloat16" in groups[-1], groups


def test_a_resume_rebuilds_the_fp8_weights_from_the_main_params_bit_exactly(dp2):
    for _, on in dp2:
        assert on["resumed_loss"] == on["losses"][-1]
        assert "fp8_param_gather" in on["reload"] and "main params" in on["reload"], on["reload"]


def test_the_checkpoint_holds_each_fp8_weights_bf16_value_not_its_bytes(dp2, checkpoint_dir):
    """What export-fp32 (and a resume without fp8_param_gather) reads: the main params rounded to bf16."""
    from ds_megatron.checkpointing.export_fp32 import consolidate
    on = dp2[0][1]
    saved = consolidate(checkpoint_dir)
    for name in on["fp8"]:
        assert torch.equal(saved[name], on["saved_main"][name].to(torch.bfloat16).float()), name


def _reference_bytes(main: torch.Tensor):
    """float64: the main param rounded to bf16, the tensorwise scale from its amax (one fp32 division, as the
    recipe's), the product rounded to fp32, then to E4M3 (saturating); (bytes, scale_inv)."""
    w = main.to(torch.bfloat16).double()
    scale = torch.tensor(E4M3_MAX / w.abs().max().item(), dtype=torch.float32)  # fp32(448 / amax): one rounding
    product = (w * scale.double()).float()  # exact in float64, then rounded to fp32 as the fp32 multiply does
    q = product.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), (1.0 / scale.double()).float()


def test_every_ranks_fp8_weights_are_the_quantized_main_params_with_the_scale_agreed_over_dp(dp2):
    ranks = [on for _, on in dp2]
    names = set(ranks[0]["fp8"])
    # the transformer layers' QKV, projection, fc1, fc2 weights; nothing else
    assert names == {f"layers.{i}.{m}.weight" for i in range(MODEL["num_layers"]) for m in (
        "self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")}, names
    for name in names:
        q_ref, scale_inv_ref = _reference_bytes(ranks[0]["main"][name])
        for on in ranks:
            q, scale_inv = on["fp8"][name]
            assert torch.equal(q, q_ref.view(q.shape)), name
            assert scale_inv.item() == scale_inv_ref.item(), name


def test_the_all_gather_moves_one_byte_per_fp8_weight_as_the_plan_says(dp2):
    from ds_megatron.planning.comm_volume import plan_comm_volume
    from ds_megatron.planning.memory import fp8_weight_elements, plan_memory
    cfg = GPTConfig(**MODEL)
    for off, on in dp2:
        layout = on["layout"]
        fp8_weights = fp8_weight_elements(cfg, range(cfg.num_layers), 1)
        assert fp8_weights == sum(q.numel() for q, _ in on["fp8"].values())
        (fp8_dtype, fp8_numel, fp8_params, fp8_bytes), (bf16_dtype, bf16_numel, bf16_params, bf16_bytes) = \
            sorted(on["buffers"], key=lambda b: b[0] != "torch.uint8")
        assert (fp8_dtype, bf16_dtype) == ("torch.uint8", "torch.bfloat16") and fp8_params == fp8_weights
        gathers = [payload for op, group, payload, bus in on["records"][-1] if op == "all_gather"]
        # one all-gather per bucket: the uint8 buffer's move its numel in bytes, the bf16 one's two bytes an element
        assert sum(gathers) == fp8_numel + 2 * bf16_numel and len(gathers) > 2, gathers
        # the plan's formula: (n-1)/n of (fp8 weights x 1 + the rest x 2) bytes, padding apart
        planned, = plan_comm_volume(cfg, layout, "bf16", micro_batch=B, distributed_optimizer=True,
                                    fp8_param_gather=True)
        measured = {}
        for op, group, payload, bus in on["records"][-1]:
            kind = "optimizer" if (op, payload) == ("all_reduce", 8) else group
            measured[kind] = measured.get(kind, 0.0) + bus
        assert sorted(measured) == sorted(planned.bus_bytes)
        padding = (fp8_numel - fp8_params) * (1 + 4) + (bf16_numel - bf16_params) * (2 + 4)
        excess = measured["dp-cp"] - planned.bus_bytes["dp-cp"]
        assert 0 <= excess <= padding / 2 + 1e-9, (measured, planned.bus_bytes)
        for kind in planned.bus_bytes:
            if kind != "dp-cp":
                assert measured[kind] == planned.bus_bytes[kind], kind
        # the memory plan: one byte per fp8 weight, two for the rest, as the param buffers hold (padding apart)
        plan = plan_memory(cfg, layout, "bf16", "adamw", micro_batch=B, distributed_optimizer=True,
                           fp8_param_gather=True)[0]
        assert plan.model_param_bytes == fp8_params + 2 * bf16_params
        assert fp8_bytes + bf16_bytes == plan.model_param_bytes + (fp8_numel - fp8_params) + 2 * (
            bf16_numel - bf16_params)


def _refused(config) -> str:
    with pytest.raises(ConfigError) as err:
        split_config(config)[1].layout(2)
    assert "\n" not in str(err.value)
    return str(err.value)


def _job(fp8="e4m3", recipe="tensorwise", **megatron):
    model = dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, fp8=fp8, fp8_recipe=recipe)
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "megatron": {"fp8_param_gather": True, "model": model, **megatron}}


@pytest.mark.parametrize("config,names", [
    (_job(), ("fp8_param_gather", "use_distributed_optimizer", "enable it")),
    (_job(fp8=None, use_distributed_optimizer=True), ("fp8_param_gather", "model.fp8 is null")),
    (_job(recipe="blockwise", use_distributed_optimizer=True), ("fp8_param_gather", "'blockwise'", "tensorwise")),
    (_job(use_distributed_optimizer=True, train={"ckpt_format": "deepspeed"}),
     ("fp8_param_gather", "ckpt_format \"deepspeed\"", "\"torch_dist\"")),
    (_job(use_distributed_optimizer=True, train={"export_hf_family": "llama"}),
     ("fp8_param_gather", "train.export_hf_family")),
])
def test_refused_at_start_in_one_line(config, names):
    message = _refused(config)
    for name in names:
        assert name in message, message


@pytest.mark.parametrize("megatron,model", [
    (dict(pipeline_model_parallel_size=2), {}),
    (dict(pipeline_model_parallel_size=2, pipeline_schedule="zero_bubble"), {}),
    (dict(context_parallel_size=2), dict(attention_dropout=0.0)),
    (dict(expert_model_parallel_size=2), dict(num_experts=4, moe_router_topk=2)),
])
def test_accepted_with_pipeline_context_and_expert_parallelism(megatron, model):
    """Built and held bit-identical to the job without fp8_param_gather by test_fp8_param_gather_parallel."""
    job = _job(use_distributed_optimizer=True, **megatron)
    job["gradient_accumulation_steps"] = 2
    job["megatron"]["model"].update(model)
    assert split_config(job)[1].layout(2).world_size == 2


def _build_without_fp8_layers() -> str:
    cfg = _config(True)
    state = ds_megatron.initialize_model_parallel(cfg)  # no model section: the model comes built
    model = GPTModel(GPTConfig(**dict(MODEL, fp8=None)), state)
    try:
        ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    except ValueError as e:
        return str(e)
    finally:
        state.destroy()
    return "accepted"


def test_a_built_model_without_fp8_layers_is_refused():
    for message in run_on_ranks(2, _build_without_fp8_layers):
        assert "fp8_param_gather" in message and "no fp8 linear layer" in message, message
