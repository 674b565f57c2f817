"""Pipeline parallel training equals the same training without PP: losses and updated full weights, step by step.

Each case trains the same GPT (same seed, same global batch of 16 sequences
per step, Adam with clipping at CLIP = 0.5 so that the global norm matters; eps
1e-4 keeps Adam from turning the float noise of gradients that are zero in
exact arithmetic, such as the key bias's, into full-size steps) for 3
steps twice on the same ranks: once with PP > 1 through DeepSpeed's
``PipelineEngine`` (``engine.train_batch``), once with PP = 1 through the
plain loop (``engine(batch)`` / ``backward`` / ``step``) with the ranks spent
on data parallelism instead.  The per-step losses and the final weights,
gathered to full GPT tensors, must agree.  The global batch is cut into the
same 8 chunks of 2 sequences in both runs (only their assignment to ranks and
micro-batches differs), so the mean loss is the same number.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.models.gpt_chunks import GPTModelChunks
from ds_megatron.pipeline_parallel.schedule_table import get_order, rank_operations, zero_bubble_orders

MODEL = dict(num_layers=4, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, seq_length=8, vocab_size=60,
             hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=4)
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
# Gemma's pieces: windows of 3 in layers 0, 2, 3 (layer 1 global: with v = 2 rank 1 holds layers 1 and 3, so a window
# read from a chunk's own layer count would be wrong), its own softmax scale, both soft-caps, the local RoPE base,
# (1 + w) norms, four a layer, scaled embeddings, GeGLU with tanh GELU, QK norm, head_dim != hidden / heads.
GEMMA = dict(position_embedding_type="rope", normalization="RMSNorm", layernorm_zero_centered_gamma=True,
             post_sublayer_norms=True, apply_embedding_scaling=True, gated_linear_unit=True, activation="gelu_tanh",
             add_bias_linear=False, qk_layernorm=True, kv_channels=12, num_query_groups=1, softmax_scale=0.2,
             attn_logit_softcapping=2.0, final_logit_softcapping=3.0, window_size=[2, 0],
             window_attn_skip_freq=[1, 0, 1, 1], local_rotary_base=100.0)
# 3 steps: the second and third take Adam's moments and the clipped norm of a step the pipeline computed, and the
# third sees the first step's batch again (its loss must have fallen).
GLOBAL, MBS, STEPS = 16, 2, 3
# Below every case's largest norm in those 3 steps.
CLIP = 0.5


def _chunks(step):
    """The step's global batch as 8 chunks of MBS sequences: (tokens, labels, loss_mask)."""
    g = torch.Generator().manual_seed(100 + step % 2)  # two batches, seen in turn: the model can learn them
    tokens = torch.randint(0, MODEL["vocab_size"], (GLOBAL, MODEL["seq_length"] + 1), generator=g)
    mask = (torch.rand(GLOBAL, MODEL["seq_length"], generator=g) > 0.25).float()
    return [(tokens[i:i + MBS, :-1], tokens[i:i + MBS, 1:], mask[i:i + MBS]) for i in range(0, GLOBAL, MBS)]


def _my_chunks(step, dp, dp_rank):
    chunks = _chunks(step)
    per_rank = len(chunks) // dp
    return chunks[dp_rank * per_rank:(dp_rank + 1) * per_rank]


def step_loss(engine, state, step: int):
    """One optimizer step on this rank's micro-batches of ``step``: the pipeline's ``train_batch``, or each one's
    forward, backward and step; the loss averaged over the micro-batches and data parallelism."""
    chunks = _my_chunks(step, state.dp.size, state.dp.rank)
    if state.pp.size > 1:
        return engine.train_batch(iter([(t, (l, m)) for t, l, m in chunks]))
    total = 0.0
    for t, l, m in chunks:
        micro = engine(t, l, m)
        engine.backward(micro)
        engine.step()
        total = total + micro.detach().float() / len(chunks)
    dist.all_reduce(total, group=state.dp.group)
    return total / state.dp.size


def _config(pp, tp, dp, precision, distopt, sp, moe, ep, impl, clip=CLIP, pipeline=None):
    gas = GLOBAL // (MBS * dp)
    adam = {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-4}
    if impl == "deepspeed":
        adam["torch_adam"] = True  # DeepSpeed builds torch's AdamW (its fused Adam needs CUDA)
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "steps_per_print": 10 ** 6, "optimizer": {"type": "AdamW", "params": adam},
           "megatron": {"pipeline_model_parallel_size": pp, "tensor_model_parallel_size": tp,
                        "sequence_parallel": sp, "optimizer_impl": impl}}
    if moe:
        cfg["megatron"]["expert_model_parallel_size"] = ep
    cfg["megatron"].update(pipeline or {})
    if distopt:
        cfg["megatron"].update(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=400)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 1000}
    return cfg


def _full(param, tp):
    """The whole tensor of a TP-split parameter (gathered along its partition dim), in fp32."""
    p = param.detach().float()
    if not getattr(param, "tensor_model_parallel", False) or tp.size == 1 or getattr(param, "is_expert", False):
        return p
    parts = [torch.empty_like(p) for _ in range(tp.size)]
    dist.all_gather(parts, p.contiguous(), group=tp.group)
    return torch.cat(parts, dim=param.partition_dim)


def _gathered_weights(named_params, state):
    """{GPTModel name: full fp32 tensor} over the whole job (every stage, TP gathered), the same on every rank."""
    mine = {}
    for name, p in named_params:
        full = _full(p, state.tp)
        if name == "word_embeddings.weight":
            full = full[:MODEL["vocab_size"]]
        if getattr(p, "is_expert", False):
            name = f"{name}@ep{state.ep.rank}.etp{state.etp.rank}"  # expert shards keyed by their owner
        mine[name] = full
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {}
    for d in everyone:
        for name, t in d.items():
            if name in out:
                assert torch.equal(out[name], t), f"{name} differs between the ranks holding it"
            out[name] = t
    return out


def _train(pp, tp, precision="fp32", distopt=False, sp=False, moe=False, ep=1, impl="megatron", recompute=False,
           clip=CLIP, pipeline=None, layers=None, record_order=False, cp=1, steps=STEPS, mtp=None, untied=False,
           gemma=False):
    """``pipeline``: the schedule's keys of the "megatron" section (ours with ``pipeline_schedule``
    "interleaved_1f1b", the default with v > 1); ``layers``: num_layers instead of MODEL's; ``mtp``:
    mtp_num_layers (on the last stage, with copies of the word and position embeddings there); ``gemma``: GEMMA's
    architecture."""
    world = dist.get_world_size()
    dp = world // (pp * tp * cp)
    cfg = _config(pp, tp, dp, precision, distopt, sp, moe, ep, impl, clip,
                  dict(pipeline or {}, context_parallel_size=cp))
    state = ds_megatron.initialize_model_parallel(cfg)
    model_args = dict(MODEL, num_layers=layers or MODEL["num_layers"])
    config = GPTConfig(**model_args, **(MOE if moe else {}), **(GEMMA if gemma else {}), sequence_parallel=sp,
                       recompute_granularity="full" if recompute else None, mtp_num_layers=mtp,
                       untie_embeddings_and_output_weights=untied)
    torch.manual_seed(7)
    ours = pp > 1 and pipeline is not None
    orders = []
    if ours:
        pipe = pipeline or {}
        model = GPTModelChunks(config, state, num_model_chunks=pipe.get("virtual_pipeline_model_parallel_size", 1),
                               layers_per_stage=pipe.get("pipeline_num_layers_per_stage"),
                               first_stage_layers=pipe.get("decoder_first_pipeline_num_layers"),
                               last_stage_layers=pipe.get("decoder_last_pipeline_num_layers"))
    elif pp > 1:
        model = ds_megatron.GPTPipelineModule(config, state)
    else:
        model = GPTModel(config, state)
    engine, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    losses, norms, tied_equal = [], [], []
    for step in range(steps):
        loss = step_loss(engine, state, step)
        if pp > 1 and moe:  # the pipeline's loss is the LM (and MTP) loss; PP=1's adds every layer's routing losses
            loss = loss + _routing_losses(model, state)
        losses.append(float(loss))
        if ours and record_order:
            orders.append([(op.forward, op.chunk, op.microbatch, op.part)
                           for op in engine.megatron.pipeline_runtime.executed])
        norm = engine.get_global_grad_norm()
        norms.append(float("nan") if norm is None else float(norm))
        if pp > 1:
            tied_equal.append(_tied_copies_equal(model, state))
    named = model.named_gpt_parameters() if pp > 1 else model.named_parameters()
    weights = _gathered_weights(list(named), state)
    pp_rank = state.pp.rank
    engine.megatron.destroy()
    if record_order:
        return losses, norms, weights, tied_equal, orders, pp_rank
    return losses, norms, weights, tied_equal


def _routing_losses(model, state):
    """This step's routing losses as PP=1's loss contains them: summed over the stages' layers, averaged over DP."""
    tracker = model.moe_aux_loss_tracker
    routing = [v for name, v in tracker.averages().items() if name != "mtp_loss"]  # MTP's is in the loss already
    total = torch.stack(routing).sum() if routing else torch.zeros(())
    tracker.reset()
    dist.all_reduce(total, group=state.pp.group)
    dist.all_reduce(total, group=state.dp.group)
    return total / state.dp.size


def _tied_copies_equal(model, state):
    """The word embedding's two copies (first and last stage) hold the same weight."""
    if state.pp.rank not in (0, state.pp.size - 1):
        return True
    emb = state["embedding"]
    if isinstance(model, GPTModelChunks):
        w = model.chunks[0 if state.pp.rank == 0 else -1].word_embeddings.weight.detach().float().clone()
    else:
        w = model.tied_modules.word_embeddings.weight.detach().float().clone()
    other = w.clone()
    dist.broadcast(other, src=emb.ranks[0], group=emb.group)
    return torch.equal(w, other)


_REFERENCES = {}  # (world size, PP=1 case) -> its run, kept by the rank processes (the harness reuses them)


def _pp_and_reference(pp_case, ref_case):
    """The pipeline run, and the PP=1 run of the same model (computed once per world size and case: many pipeline
    cases share one reference, and every run starts from the same seed, so the result is the same)."""
    key = (dist.get_world_size(), repr(sorted(ref_case.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = _train(**ref_case)
    return _train(**pp_case), _REFERENCES[key]


ONE_CHUNK = {"pipeline_schedule": "interleaved_1f1b"}
V2 = {"virtual_pipeline_model_parallel_size": 2}
ZB = {"pipeline_schedule": "zero_bubble"}

# fp32 tolerance 1e-5 (losses, norms, weights), from the arithmetic rather than tuned: both runs sum in float32
# in different orders, and Adam's eps of 1e-4 (see the docstring) bounds how far an update can follow a change
# of its gradient (by lr / eps = 100 times it), so the float32 noise of the gradients (~1e-7 relative) stays
# ~1e-7 in the weights over the steps instead of being magnified into whole steps as with eps 1e-8.  Seen:
# <= 3e-7 in weights and 5e-7 in losses with torch's AVX2 and scalar kernels, 0.03 of the tolerance.
# bf16 / fp16: a few units in the last place of the params (2^-8, 2^-11).
CASES = {
    # name: (world, pipeline case, PP=1 case with the same TP, tolerance)
    "pp2": (2, dict(pp=2, tp=1), dict(pp=1, tp=1), 1e-5),
    "pp4": (4, dict(pp=4, tp=1), dict(pp=1, tp=1), 1e-5),
    "pp2-dp2": (4, dict(pp=2, tp=1), dict(pp=1, tp=1), 1e-5),
    "pp2-tp2": (4, dict(pp=2, tp=2), dict(pp=1, tp=2), 1e-5),
    "pp2-tp2-sp": (4, dict(pp=2, tp=2, sp=True), dict(pp=1, tp=2, sp=True), 1e-5),
    "pp2-dp2-distopt": (4, dict(pp=2, tp=1, distopt=True), dict(pp=1, tp=1, distopt=True), 1e-5),
    "pp2-dp2-bf16": (4, dict(pp=2, tp=1, precision="bf16"), dict(pp=1, tp=1, precision="bf16"), 2e-2),
    "pp2-dp2-fp16": (4, dict(pp=2, tp=1, precision="fp16"), dict(pp=1, tp=1, precision="fp16"), 5e-3),
    "pp2-tp2-dp2": (8, dict(pp=2, tp=2), dict(pp=1, tp=2), 1e-5),
    "pp2-moe-ep2-folded": (4, dict(pp=2, tp=1, moe=True, ep=2), dict(pp=1, tp=1, moe=True, ep=2), 1e-5),
    "pp2-tp2-recompute": (4, dict(pp=2, tp=2, recompute=True), dict(pp=1, tp=2), 1e-5),
    # Our runtime (pipeline_parallel.schedules): Megatron's interleaved 1F1B over v chunks per rank, plain 1F1B
    # with one chunk, uneven stages.
    "ours-pp2-v1": (2, dict(pp=2, tp=1, pipeline=ONE_CHUNK), dict(pp=1, tp=1), 1e-5),
    "ours-pp2-v2": (2, dict(pp=2, tp=1, pipeline=V2), dict(pp=1, tp=1), 1e-5),
    "ours-pp4-v2": (4, dict(pp=4, tp=1, pipeline=V2, layers=8), dict(pp=1, tp=1, layers=8), 1e-5),
    "ours-pp2-v2-tp2-sp": (4, dict(pp=2, tp=2, sp=True, pipeline=V2), dict(pp=1, tp=2, sp=True), 1e-5),
    "ours-pp2-v2-dp2-distopt-bf16": (4, dict(pp=2, tp=1, pipeline=V2, distopt=True, precision="bf16"),
                                     dict(pp=1, tp=1, distopt=True, precision="bf16"), 2e-2),
    "ours-pp2-v2-moe-ep2-folded": (4, dict(pp=2, tp=1, moe=True, ep=2, pipeline=V2),
                                   dict(pp=1, tp=1, moe=True, ep=2), 1e-5),
    "ours-pp2-zb": (2, dict(pp=2, tp=1, pipeline=ZB), dict(pp=1, tp=1), 1e-5),
    "ours-pp4-zb": (4, dict(pp=4, tp=1, pipeline=ZB), dict(pp=1, tp=1), 1e-5),
    "ours-pp2-zb-tp2-sp": (4, dict(pp=2, tp=2, sp=True, pipeline=ZB), dict(pp=1, tp=2, sp=True), 1e-5),
    "ours-pp2-zb-dp2-distopt-bf16": (4, dict(pp=2, tp=1, pipeline=ZB, distopt=True, precision="bf16"),
                                     dict(pp=1, tp=1, distopt=True, precision="bf16"), 2e-2),
    "ours-pp2-zb-moe-ep2": (4, dict(pp=2, tp=1, moe=True, ep=2, pipeline=ZB), dict(pp=1, tp=1, moe=True, ep=2), 1e-5),
    "ours-pp2-zb-recompute": (2, dict(pp=2, tp=1, pipeline=ZB, recompute=True), dict(pp=1, tp=1), 1e-5),
    "ours-pp2-v2-cp2": (4, dict(pp=2, tp=1, cp=2, pipeline=V2), dict(pp=1, tp=1, cp=2), 1e-5),
    # Multi-token prediction on the last stage (learned positions: their copy there too), tied and untied.
    "ours-pp2-mtp": (2, dict(pp=2, tp=1, mtp=2, pipeline=ONE_CHUNK), dict(pp=1, tp=1, mtp=2), 1e-5),
    "ours-pp2-v2-mtp-moe-ep2-untied-distopt": (4, dict(pp=2, tp=1, moe=True, ep=2, mtp=1, untied=True, pipeline=V2,
                                                   distopt=True),
                                               dict(pp=1, tp=1, moe=True, ep=2, mtp=1, untied=True, distopt=True),
                                               1e-5),
    "ours-pp2-zb-mtp-tp2-sp": (4, dict(pp=2, tp=2, sp=True, mtp=1, pipeline=ZB), dict(pp=1, tp=2, sp=True, mtp=1),
                               1e-5),
    "ours-pp2-v2-recompute": (2, dict(pp=2, tp=1, pipeline=V2, recompute=True), dict(pp=1, tp=1), 1e-5),
    # MoE layers recomputed whole: their routing losses reach the gradients once, through each stage's hook.
    "ours-pp2-v2-moe-recompute": (2, dict(pp=2, tp=1, moe=True, pipeline=V2, recompute=True),
                                  dict(pp=1, tp=1, moe=True), 1e-5),
    "ours-pp2-v2-gemma": (2, dict(pp=2, tp=1, pipeline=V2, gemma=True), dict(pp=1, tp=1, gemma=True), 1e-5),
    "ours-pp2-uneven": (2, dict(pp=2, tp=1, pipeline=dict(ONE_CHUNK, decoder_first_pipeline_num_layers=1)),
                        dict(pp=1, tp=1), 1e-5),
    "ours-pp2-v2-uneven": (2, dict(pp=2, tp=1, layers=6, pipeline=dict(V2, decoder_last_pipeline_num_layers=2)),
                           dict(pp=1, tp=1, layers=6), 1e-5),
    # DeepSpeed's own optimizer, reduction and tied-gradient all-reduce (optimizer_impl "deepspeed").
    # Without clipping: DeepSpeed's pipeline norm is refused at start (see test_pipeline_topology.py).
    "pp2-dp2-deepspeed-path": (4, dict(pp=2, tp=1, impl="deepspeed", clip=0.0),
                               dict(pp=1, tp=1, impl="deepspeed", clip=0.0), 1e-5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_training_equals_no_pipeline(case):
    world, pp_case, ref_case, tol = CASES[case]
    results = run_on_ranks(world, _pp_and_reference, pp_case, ref_case, timeout=300)
    (losses, norms, weights, tied_equal), (ref_losses, ref_norms, ref_weights, _) = results[0]
    for rank_result in results:
        assert rank_result[0][0] == losses, "every rank reports the same pipeline loss"
    assert all(all(r[0][3]) for r in results), "tied embedding copies diverged between first and last stage"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tol, atol=tol)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=max(tol, 1e-4), atol=tol,
                               equal_nan=True)
    if pp_case.get("impl") != "deepspeed":  # DeepSpeed's fp32 path does not report its norm
        assert max(norms) > CLIP, "clipping never engaged: the test would not see a wrong global norm"
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=tol, atol=tol, msg=name)
    assert losses[-1] < losses[0], "the model did not train"


def test_each_rank_runs_the_schedule_tables_order():
    """The order our runtime executed on each rank, every step, is Megatron's ``convert_schedule_table_to_order``
    for that rank (via ``get_order``), with micro-batches as the table assigns them."""
    results = run_on_ranks(4, _train, 4, 1, pipeline=V2, layers=8, record_order=True, steps=2, timeout=300)
    micro_batches = GLOBAL // MBS
    for _, _, _, _, orders, rank in results:
        expected = rank_operations(micro_batches, 2, pipeline_parallel_size=4, pipeline_parallel_rank=rank)
        signed = get_order(micro_batches, 2, pipeline_parallel_size=4, pipeline_parallel_rank=rank)
        assert len(orders) == 2
        for order in orders:
            assert [(c + 1) * (1 if fwd else -1) for fwd, c, _, _ in order] == signed
            assert order == [(op.forward, op.chunk, op.microbatch, op.part) for op in expected]


def test_each_rank_runs_the_zero_bubble_order():
    """With ``pipeline_schedule`` "zero_bubble" each rank executes ``zero_bubble_orders`` for its rank: F, B (input
    gradient) and W (weight gradients) as the table places them."""
    results = run_on_ranks(4, _train, 4, 1, pipeline=ZB, record_order=True, steps=2, timeout=300)
    micro_batches = GLOBAL // MBS
    orders = zero_bubble_orders(micro_batches, 4)
    for _, _, _, _, executed, rank in results:
        assert len(executed) == 2
        for order in executed:
            assert order == [(op.forward, op.chunk, op.microbatch, op.part) for op in orders[rank]]
