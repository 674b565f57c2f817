"""Bytes on the wire per training step, per rank, against the minimum of each layout.

Every data collective of the package goes through ``ds_megatron.utils.collectives``,
which counts them inside ``count_bytes()`` (payload, and bus bytes the nccl-tests
way).  One step (forward, backward, ``engine.step()``) of a small GPT on 2 gloo
ranks is counted after a warm-up step, and the records must be exactly the
layout's formula; what the formula adds to the textbook minimum is named next
to it and bounded:

* DP: one all-reduce of the gradient bytes; with the distributed optimizer one
  reduce-scatter of the fp32 gradients and one all-gather of the bf16 params,
  over buffers padded to 64-element param starts and 128-element bucket ends.
* TP: two all-reduces of b*s*h per layer forward and two backward; besides them the
  vocab-parallel embedding's forward all-reduce and the output layer's backward
  one (b*s*h each), the cross entropy's per-token scalars (3*b*s floats) and the
  optimizer's one float64 (inf flag and squared norm).
* TP with sequence parallelism: per layer the same bus bytes as TP as all-gathers
  and reduce-scatters; besides them the learned position embeddings are added to
  the full sequence and then scattered (megatron-core does the same; its backward
  all-gather is (n-1)/n*b*s*h above a reduce-scatter of the embeddings), and the
  sequence-parallel params' grads are summed over TP once.
* Expert parallelism: per MoE layer, forward and backward, the dispatch and the
  combine all-to-alls move tokens*topk rows of h (each rank sends its own tokens*topk
  in the dispatch, and what it received in the combine); besides them the routing
  probabilities (one float per row of the dispatch, 1/(2h) of the rows' bytes) and
  the all-gather of the per-expert counts.  The plan's MoE formula (balanced routing)
  is held to steps whose routers send every token to experts 0 and 2, one on each EP
  rank, so that each rank receives the rows it sends.  A recomputed MoE layer (full,
  block, selective ``moe``) reruns its forward up to un-permuting's scatter-add: its
  shared expert, router reductions, counts, dispatch and combine once more.

* Context parallelism (ring, ``cp_comm_type "p2p"``): per layer each rank sends cp-1
  K/V blocks (2*b*(s/cp)*kv_heads*d, in the model's dtype) forward, and backward
  the K/V again plus cp-1 dK/dV accumulators (float32 for bf16 models, the one
  excess, bounded at 2x the bf16 block).  The all-gather variant moves the same
  bus bytes once each way (it keeps the gathered K/V for backward).  Besides
  them: the loss's sum and token count over cp, and the gradients over dp-cp.

* Pipeline (DeepSpeed's 1F1B engine on our groups, and our runtime with v = 1, 2 and ZB-H1):
  per micro-batch each virtual stage but the last sends its output hidden states (b*s*h,
  b*s*h/tp with sequence parallelism) and each but the first their gradient, once; besides
  them the tied embedding's gradient summed over the first and last stage once per step,
  the optimizer's one float64 over the model-parallel group, and on our runtime the mean
  loss it reports (one float over dp and one over pp).  Not counted: DeepSpeed's own scalar
  loss broadcast over the stages (2 floats per step) and the tensor metadata it sends once,
  on the first step.
"""
import collections

import pytest
import torch

from harness import run_on_ranks

import ds_megatron
from ds_megatron.config.model import pad_vocab_size
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.models.gpt_chunks import GPTModelChunks
from ds_megatron.tensor_parallel import RNGStatesTracker, model_parallel_seed
from ds_megatron.utils.collectives import count_bytes

L, H, S, B, V = 2, 32, 16, 2, 64
MODEL = dict(num_layers=L, hidden_size=H, num_attention_heads=4, ffn_hidden_size=64, seq_length=S, vocab_size=V,
             hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)
MOE = dict(num_experts=4, moe_router_topk=2)
MLA = dict(position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8,
           qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, add_bias_linear=True)
F32, BF16, F64 = 4, 2, 8
N = 2  # ranks


def _force_routing(model, chosen):
    """Make every token of every router pick the experts ``chosen`` (a test-only weight setting): the logits'
    weight zero, the chosen experts' bias (the router's logits bias, else the expert bias) 10 above the others."""
    from ds_megatron.moe.router import TopKRouter
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert routers
    with torch.no_grad():
        for router in routers:
            router.weight.zero_()
            bias = router.bias if router.bias is not None else router.expert_bias
            bias.zero_()
            bias[list(chosen)] = 10.0


def _step_records(megatron, precision, model_extra, micro_batches=1, chosen_experts=None, batch=B):
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": micro_batches,
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "megatron": dict(megatron), **precision}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**{**MODEL, **model_extra}), state,
                     rng_tracker=model_parallel_seed(0, state.tp.rank, tracker=RNGStatesTracker()))
    if chosen_experts is not None:
        _force_routing(model, chosen_experts)
    engine, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    g = torch.Generator().manual_seed(10 + state.dp.rank)
    for step in range(2):
        with count_bytes() as counter:
            for _ in range(micro_batches):  # DeepSpeed steps at the last one
                tokens = torch.randint(0, V, (batch, S + 1), generator=g)
                loss = engine({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
                engine.backward(loss)
                engine.step()
    info = {"params": sum(p.numel() for p in model.parameters()),
            "sequence_parallel_params": sum(p.numel() for p in model.parameters()
                                            if getattr(p, "sequence_parallel", False)),
            "dense_params": sum(p.numel() for p in model.parameters() if not getattr(p, "is_expert", False)),
            "buffer_numel": sum(b.numel for b in engine.megatron.ddp.all_buffers),
            "buffered_params": sum(len(b.params) for b in engine.megatron.ddp.all_buffers), "layout": state.layout}
    if engine.megatron.ddp_in_engine is not None:
        engine.megatron.ddp_in_engine.detach()
    state.destroy()
    return [(r.op, r.group, r.payload_bytes, r.shape, r.bus_bytes) for r in counter.records], info


def _calls(records):
    return collections.Counter((op, group, payload) for op, group, payload, _, _ in records)


def _bus(records, **where):
    return sum(bus for op, group, _, _, bus in records
               if all({"op": op, "group": group}[k] == v for k, v in where.items()))


def test_data_parallel_is_one_all_reduce_of_the_gradients():
    for records, info in run_on_ranks(N, _step_records, {}, {}, {}):
        assert _calls(records) == {("all_reduce", "dp-cp", info["params"] * F32): 1}, records
        assert _bus(records) == 2 * (N - 1) / N * info["params"] * F32


def test_distributed_optimizer_is_one_reduce_scatter_and_one_all_gather():
    for records, info in run_on_ranks(N, _step_records, {"use_distributed_optimizer": True},
                                      {"bf16": {"enabled": True}}, {}):
        numel = info["buffer_numel"]
        assert _calls(records) == {("reduce_scatter", "dp-cp", numel * F32): 1,  # fp32 grads
                                   ("all_gather", "dp-cp", numel * BF16): 1,  # bf16 params
                                   ("all_reduce", "world", F64): 1}, records  # inf flag + squared norm
        # Above the minimum only the buffer's padding: < 64 elements per param start, < 128 at the end.
        padding = numel - info["params"]
        assert 0 <= padding < 64 * info["buffered_params"] + 128, padding


def _tensor_parallel_expectation(seq_parallel_params):
    bsh = B * S * H * F32
    per_layer = 4 * L  # two all-reduces forward, two backward, per layer
    if not seq_parallel_params:
        return {("all_reduce", "tp", bsh): per_layer + 2,  # + embedding forward, output layer backward
                ("all_reduce", "tp", B * S * F32): 1,  # cross entropy: the max
                ("all_reduce", "tp", 2 * B * S * F32): 1,  # cross entropy: target logit and sum of exp
                ("all_reduce", "model-parallel", F64): 1}  # optimizer: inf flag + squared norm
    return {("all_gather", "tp", bsh): per_layer + 2,  # + the embeddings' scatter (backward), the output layer's input
            ("reduce_scatter", "tp", bsh): per_layer + 1,  # + the output layer's input gradient
            ("all_reduce", "tp", bsh): 1,  # embedding forward
            ("all_reduce", "tp", B * S * F32): 1,
            ("all_reduce", "tp", 2 * B * S * F32): 1,
            ("all_reduce", "tp", seq_parallel_params * F32): 1,  # sequence-parallel grads, once per step
            ("all_reduce", "model-parallel", F64): 1}


def test_tensor_parallel_is_two_all_reduces_per_layer_each_way():
    for records, info in run_on_ranks(N, _step_records, {"tensor_model_parallel_size": N}, {}, {}):
        assert _calls(records) == _tensor_parallel_expectation(0), records
        layers = _calls(records)[("all_reduce", "tp", B * S * H * F32)] - 2
        assert layers == 2 * L * 2  # the textbook count


def test_sequence_parallel_moves_the_bytes_of_tensor_parallel():
    tp = run_on_ranks(N, _step_records, {"tensor_model_parallel_size": N}, {}, {})
    sp = run_on_ranks(N, _step_records, {"tensor_model_parallel_size": N, "sequence_parallel": True}, {},
                      {"sequence_parallel": True})
    for (tp_records, _), (sp_records, info) in zip(tp, sp):
        assert info["sequence_parallel_params"] > 0
        assert _calls(sp_records) == _tensor_parallel_expectation(info["sequence_parallel_params"]), sp_records
        bsh = B * S * H * F32
        # Equal volume: every all-gather / reduce-scatter pair stands for one all-reduce; the only additions
        # are the embeddings' scatter (its backward all-gather) and the sequence-parallel grads' all-reduce.
        extra = (N - 1) / N * bsh + 2 * (N - 1) / N * info["sequence_parallel_params"] * F32
        assert _bus(sp_records) == pytest.approx(_bus(tp_records) + extra, rel=1e-12)


def test_expert_all_to_all_moves_tokens_times_topk_rows():
    results = run_on_ranks(N, _step_records, {"expert_model_parallel_size": N}, {}, MOE)
    rows, topk = B * S, MOE["moe_router_topk"]
    total_hidden = 0
    for records, info in results:
        hidden = [payload for op, _, payload, shape, _ in records if op == "all_to_all" and shape[-1:] == (H,)]
        probs = [payload for op, _, payload, shape, _ in records if op == "all_to_all" and len(shape) == 1]
        # Dispatch forward and combine backward send this rank's tokens*topk rows; the combine forward and
        # dispatch backward send back what the other ranks routed here (data-dependent, summed below).
        assert len(hidden) == 4 * L and len(probs) == 2 * L, records
        sent = rows * topk  # rows this rank routes (dropless), to itself included
        received = [probs[3] // F32, probs[2] // F32]  # per layer: rows routed here (dispatch backward)
        assert probs[:2] == [sent * F32] * 2
        # forward: dispatch 0, combine 0, dispatch 1, combine 1; backward in reverse, each the other's size
        assert hidden == [r * H * F32 for r in (sent, received[0], sent, received[1],
                                                sent, received[1], sent, received[0])], hidden
        total_hidden += sum(hidden)
        # Probabilities travel with the dispatch only (forward and backward): one float per row, so
        # 1/(2h) of the rows' bytes.
        assert 2 * H * sum(probs) == sum(hidden)
        counts = _calls(records)
        assert counts[("all_gather", "ep", N * MOE["num_experts"] * 8)] == L  # int64 per-expert counts
        assert counts[("all_reduce", "dp-cp", info["dense_params"] * F32)] == 1  # dense grads; experts: edp = 1
        assert counts[("all_reduce", "expert-model-parallel", F64)] == 1  # optimizer: flag + squared norm
        assert sum(counts.values()) == 4 * L + 2 * L + L + 2, records  # nothing else
    assert total_hidden == 4 * L * N * rows * topk * H * F32


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_context_parallel_moves_each_kv_block_once_per_hop(cp, precision, comm_type):
    heads, groups = MODEL["num_attention_heads"], 2  # grouped-query attention: only the KV heads travel
    bf16 = precision == "bf16"
    results = run_on_ranks(cp, _step_records, {"context_parallel_size": cp}, {"bf16": {"enabled": True}} if bf16
                           else {}, {"cp_comm_type": comm_type, "num_query_groups": groups})
    kv = 2 * B * (S // cp) * (H // heads * groups)  # K and V of this rank's s/cp tokens, elements
    kv_in, kv_acc = kv * (BF16 if bf16 else F32), kv * F32  # the model's dtype; dK/dV accumulated in fp32
    for records, info in results:
        common = {("all_reduce", "cp", 2 * F32): 1,  # the loss: masked sum and token count
                  ("all_reduce", "dp-cp", info["params"] * F32): 1}  # gradients
        if comm_type == "a2a":
            # Ulysses: q and the output (all 4 heads), k and v (2 KV heads; expanded to 4 when cp = 4 exceeds
            # them), forward, and their gradients backward, in the model's dtype; each all-to-all keeps 1/cp.
            elem = BF16 if bf16 else F32
            q_bytes = B * (S // cp) * H * elem
            kv_bytes = q_bytes if groups % cp else q_bytes // heads * groups
            calls = collections.Counter({("all_to_all", "cp", q_bytes): 4 * L})
            calls[("all_to_all", "cp", kv_bytes)] += 4 * L
            assert _calls(records) == {**calls, **common}, records
            moved = _bus(records, group="cp") - 2 * (cp - 1) / cp * 2 * F32
            assert moved == pytest.approx(L * (cp - 1) / cp * 4 * (q_bytes + kv_bytes), rel=1e-12)
            continue
        if comm_type == "p2p":
            ring = collections.Counter({("ring_exchange", "cp", kv_in): 2 * L * (cp - 1)})
            ring[("ring_exchange", "cp", kv_acc)] += L * (cp - 1)
            assert _calls(records) == {**ring, **common}, records
        else:
            assert _calls(records) == {("all_gather", "cp", cp * kv_in): L, ("reduce_scatter", "cp", cp * kv_acc): L,
                                       **common}, records
        moved = _bus(records, group="cp") - 2 * (cp - 1) / cp * 2 * F32
        passes = 2 if comm_type == "p2p" else 1  # the ring sends K/V again in backward instead of keeping them
        assert moved == pytest.approx(L * (cp - 1) * (passes * kv_in + kv_acc), rel=1e-12)


def _pipeline_step_records(megatron, micro_batches):
    megatron = dict(megatron)
    num_layers = megatron.pop("num_layers", L)
    extra = megatron.pop("model", {})
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": micro_batches,
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 9, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
           "megatron": {"pipeline_model_parallel_size": 2, **megatron}}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(0)
    config = GPTConfig(**dict(MODEL, num_layers=num_layers, **extra),
                       sequence_parallel=megatron.get("sequence_parallel", False))
    if "pipeline_schedule" in megatron:  # our runtime
        model = GPTModelChunks(config, state, num_model_chunks=megatron.get("virtual_pipeline_model_parallel_size", 1))
    else:
        model = ds_megatron.GPTPipelineModule(config, state)
    engine, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    g = torch.Generator().manual_seed(10 + state.dp.rank)
    for step in range(2):  # the first step also sends DeepSpeed's tensor metadata: count the second
        tokens = torch.randint(0, V, (micro_batches, B, S + 1), generator=g)
        with count_bytes() as counter:
            engine.train_batch(iter([(t[:, :-1], (t[:, 1:], torch.ones(B, S))) for t in tokens]))
    stage, layout = state.pp.rank, state.layout
    engine.megatron.destroy()
    return [(r.op, r.group, r.payload_bytes, r.shape, r.bus_bytes) for r in counter.records], stage, layout


def test_pipeline_sends_each_micro_batchs_hidden_states_and_their_gradient_once():
    m = 3
    embedding = pad_vocab_size(V, MODEL["make_vocab_size_divisible_by"], 1) * H * F32
    for records, stage, _ in run_on_ranks(2, _pipeline_step_records, {}, m):
        # stage 0: the activations forward; stage 1: their gradients backward
        assert _calls(records) == {("send", "pp", S * B * H * F32): m,
                                   ("all_reduce", "embedding", embedding): 1,  # tied word embedding's two copies
                                   ("all_reduce", "model-parallel", F64): 1}, (stage, records)


def test_pipeline_with_sequence_parallelism_sends_this_ranks_slice():
    m, tp = 2, 2
    for records, stage, _ in run_on_ranks(4, _pipeline_step_records,
                                       {"tensor_model_parallel_size": tp, "sequence_parallel": True}, m):
        sends = [(payload, shape) for op, group, payload, shape, _ in records if group == "pp"]
        assert sends == [(S // tp * B * H * F32, (S // tp, B, H))] * m, (stage, sends)


# ---------------------------------------------------------------- the plan's formula (ds_megatron.planning.comm_volume)

def _measured_by_kind(records):
    """Bus bytes by the plan's group kinds: the optimizer's one float64 is "optimizer" whatever its group."""
    out = collections.defaultdict(float)
    for op, group, payload, shape, bus in records:
        out["optimizer" if (op, payload, shape) == ("all_reduce", F64, ()) else group] += bus
    return dict(out)


def _check_plan(measured, planned, padded_params=0, bytes_per_padding=0.0):
    assert sorted(measured) == sorted(planned.bus_bytes), (measured, planned)
    for kind, nbytes in planned.bus_bytes.items():
        excess = measured[kind] - nbytes
        bound = padded_params * bytes_per_padding if kind in ("dp-cp", "edp") else 0.0
        assert -1e-9 <= excess <= bound + 1e-9, (kind, measured[kind], nbytes)


BF16_ON = {"bf16": {"enabled": True}}
PLAN_CASES = {  # name: (ranks, megatron section, precision section, model options[, micro-batches])
    "dp2": (2, {}, {}, {}),
    "dp2-distopt-bf16": (2, {"use_distributed_optimizer": True}, BF16_ON, {}),
    "tp2": (2, {"tensor_model_parallel_size": 2}, {}, {}),
    "tp2-sp-bf16": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, BF16_ON,
                    {"sequence_parallel": True}),
    "tp4-kv-copies-qknorm-recompute": (4, {"tensor_model_parallel_size": 4}, {},
                                       {"num_query_groups": 2, "qk_layernorm": True, "recompute_granularity": "full",
                                        "normalization": "RMSNorm", "position_embedding_type": "rope"}),
    # Two KV groups on four TP ranks, three micro-batches: the copies' gradients are summed once per step.
    "tp4-kv-copies-sp-bf16-3-micro-batches": (4, {"tensor_model_parallel_size": 4, "sequence_parallel": True}, BF16_ON,
                                              {"num_query_groups": 2, "sequence_parallel": True}, 3),
    "cp2-bf16-gqa": (2, {"context_parallel_size": 2}, BF16_ON, {"num_query_groups": 2}),
    "cp2-all-gather-recompute": (2, {"context_parallel_size": 2}, {},
                                 {"cp_comm_type": "all_gather", "recompute_granularity": "full"}),
    "cp4-a2a+p2p-2x2-bf16-gqa": (4, {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2]},
                                 BF16_ON, {"cp_comm_type": "a2a+p2p", "num_query_groups": 2}),
    "cp4-a2a+p2p-2x2-recompute": (4, {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2]},
                                  {}, {"cp_comm_type": "a2a+p2p", "num_query_groups": 1,
                                       "recompute_granularity": "full"}),
    "tp2-sp-selective-recompute": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, {},
                                   {"sequence_parallel": True, "recompute_granularity": "selective",
                                    "recompute_modules": ["core_attn", "mlp", "layernorm"]}),
    "tp2-sp-tiled-mlp-and-loss": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, {},
                                  {"sequence_parallel": True, "mlp_sequence_tiles": 4, "loss_sequence_tiles": 4}),
    "tp2-block-recompute-one-of-two": (2, {"tensor_model_parallel_size": 2}, {},
                                       {"recompute_granularity": "full", "recompute_method": "block",
                                        "recompute_num_layers": 1}),
    "cp2-a2a-bf16-gqa-recompute": (2, {"context_parallel_size": 2}, BF16_ON,
                                   {"cp_comm_type": "a2a", "num_query_groups": 2, "recompute_granularity": "full"}),
    # Multi-latent attention: its down-projections and latent norms are TP-partial sums (with or without SP);
    # under CP its K (qk + pos wide) and V (v wide) travel as they are.
    "tp2-mla": (2, {"tensor_model_parallel_size": 2}, {}, MLA),
    "tp2-sp-mla-bf16": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, BF16_ON,
                        dict(MLA, sequence_parallel=True)),
    "cp2-mla-bf16": (2, {"context_parallel_size": 2}, BF16_ON, MLA),
    # fp8 MLA: five linears a layer's attention, the replicated down-projections' weights never fp8 parameters
    # (their forward reduces both amaxes under fp8_param_gather, and no weight amax of theirs once per step).
    "tp2-mla-fp8-param-gather-recompute": (2, {"tensor_model_parallel_size": 2, "use_distributed_optimizer": True,
                                               "fp8_param_gather": True}, BF16_ON,
                                           dict(MLA, fp8="e4m3", recompute_granularity="full")),
    # Multi-token prediction: per depth the embedding, eh_proj, a layer and a head more.
    "tp2-mtp2": (2, {"tensor_model_parallel_size": 2}, {}, {"mtp_num_layers": 2}),
    "tp2-sp-mtp1": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, {},
                    {"mtp_num_layers": 1, "sequence_parallel": True}),
    # full recomputation by "block" (the first layer): the multi-token-prediction layer is recomputed whole too
    "tp2-sp-mtp1-block-recompute": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, {},
                                    {"mtp_num_layers": 1, "sequence_parallel": True, "recompute_granularity": "full",
                                     "recompute_method": "block", "recompute_num_layers": 1}),
    "tp2-cp2-sp-dp": (4, {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "sequence_parallel": True},
                      {}, {"sequence_parallel": True}),
    # fp8 tensorwise: each linear's amaxes over TP (input and weight forward, output gradient backward); with
    # fp8_param_gather the weights all-gathered one byte each, the input's amax alone forward, and once per step
    # the fp8 weights' amaxes over dp-cp and TP.
    "tp2-sp-fp8": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, BF16_ON,
                   {"sequence_parallel": True, "fp8": "e4m3"}),
    "tp2-dp2-fp8-param-gather": (4, {"tensor_model_parallel_size": 2, "use_distributed_optimizer": True,
                                     "fp8_param_gather": True}, BF16_ON, {"fp8": "e4m3"}),
    # fp8 tensorwise at CP 2: each linear's amaxes over TP x CP (here the CP ranks: their sequence chunks).
    "cp2-fp8-bf16": (2, {"context_parallel_size": 2}, BF16_ON, {"fp8": "e4m3"}),
    # fp8 with recomputation: each rerun forward's amaxes again (a layer recomputed whole: its four linears; a
    # recomputed MLP: fc1 and fc2), and the MLP's tiles quantize each tile on its own (forward, rerun, backward).
    "tp2-fp8-full-recompute-one-of-two": (2, {"tensor_model_parallel_size": 2}, BF16_ON,
                                          {"fp8": "e4m3", "recompute_granularity": "full", "recompute_method": "block",
                                           "recompute_num_layers": 1}),
    "tp2-sp-fp8-selective-mlp": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, BF16_ON,
                                 {"fp8": "hybrid", "sequence_parallel": True, "recompute_granularity": "selective",
                                  "recompute_modules": ["mlp"]}),
    "tp2-fp8-mlp-tiles": (2, {"tensor_model_parallel_size": 2}, BF16_ON, {"fp8": "e4m3", "mlp_sequence_tiles": 2}),
    # Full recomputation reruns a layer up to the last tensor its backward needs: with MLP tiles (each its own
    # checkpoint, in the recomputed layer too) the attention and every tile but the last, whose checkpoint keeps its
    # input before it runs (2 tiles; 3 over 16 rows: 6 + 5 of them); with hidden dropout (its mask saved after the
    # MLP) the whole layer, every tile, and an untiled MLP's output reduction.
    "tp2-sp-fp8-full-recompute-tiles2": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, BF16_ON,
                                         {"fp8": "e4m3", "sequence_parallel": True, "recompute_granularity": "full",
                                          "mlp_sequence_tiles": 2}),
    "tp2-fp8-full-recompute-tiles3": (2, {"tensor_model_parallel_size": 2}, BF16_ON,
                                      {"fp8": "e4m3", "recompute_granularity": "full", "mlp_sequence_tiles": 3}),
    "tp2-sp-fp8-full-recompute-tiles3-dropout": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True},
                                                 BF16_ON, {"fp8": "e4m3", "sequence_parallel": True,
                                                           "recompute_granularity": "full", "mlp_sequence_tiles": 3,
                                                           "hidden_dropout": 0.1}),
    "tp2-fp8-delayed-full-recompute-tiles2": (2, {"tensor_model_parallel_size": 2}, BF16_ON,
                                              {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 4,
                                               "recompute_granularity": "full", "mlp_sequence_tiles": 2}),
    "tp2-sp-full-recompute-dropout": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, {},
                                      {"sequence_parallel": True, "recompute_granularity": "full",
                                       "hidden_dropout": 0.1}),
    # fp8 delayed: no amax collective per micro-batch; once per step each fp8 linear's three amaxes over TP, then
    # dp-cp (two micro-batches: the history advances once).
    "tp2-dp2-fp8-delayed-2-micro-batches": (4, {"tensor_model_parallel_size": 2}, BF16_ON,
                                            {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 4},
                                            2),
}


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_the_plans_formula_is_what_a_step_moves(name):
    from ds_megatron.planning.comm_volume import plan_comm_volume
    ranks, megatron, precision, model, *micro_batches = PLAN_CASES[name]
    m = micro_batches[0] if micro_batches else 1
    dtype = "bf16" if precision else "fp32"
    distopt = megatron.get("use_distributed_optimizer", False)
    for records, info in run_on_ranks(ranks, _step_records, megatron, precision, model, m):
        planned, = plan_comm_volume(GPTConfig(**{**MODEL, **model}), info["layout"], dtype, micro_batch=B,
                                    micro_batches=m, distributed_optimizer=distopt,
                                    fp8_param_gather=megatron.get("fp8_param_gather", False),
                                    hierarchical_inner=(megatron.get("hierarchical_context_parallel_sizes")
                                                        or [None])[0])
        n = info["layout"].dp * info["layout"].cp
        padding = (n - 1) / n * (F32 + (BF16 if precision else F32)) if distopt else 0.0
        _check_plan(_measured_by_kind(records), planned, 64 * info["buffered_params"] + 128, padding)


V2 = {"pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_model_parallel_size": 2, "num_layers": 4}


@pytest.mark.parametrize("megatron,m", [
    ({}, 3), ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, 3),
    # Our runtime: v = 2 sends from every virtual stage (rank 1's first chunk to rank 0's second), ZB-H1 the
    # same messages as 1F1B.
    (V2, 4), (dict(V2, tensor_model_parallel_size=2, sequence_parallel=True), 2),
    ({"pipeline_schedule": "zero_bubble"}, 3),
    # Multi-token prediction on the last stage, untied: the word and position embeddings' copies summed there.
    ({"pipeline_schedule": "interleaved_1f1b", "model": {"mtp_num_layers": 1,
                                                         "untie_embeddings_and_output_weights": True}}, 2),
    # MoE on the last stage only (the first stage's layer dense: no expert partition there), EP 2 = DP 2; every
    # token to all four experts, so the routing is balanced whatever the router learns; the expert bias over dp
    ({"pipeline_schedule": "1f1b", "expert_model_parallel_size": 2,
      "model": dict(MOE, moe_router_topk=4, moe_layer_freq=[0, 1], moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_aux_loss_coeff=1e-2)}, 2)],
    ids=["pp2", "tp2-sp-pp2", "pp2-v2", "tp2-sp-pp2-v2", "pp2-zb", "pp2-mtp-untied", "pp2-ep2-moe-last-stage"])
def test_the_plans_formula_holds_for_each_pipeline_stage(megatron, m):
    from ds_megatron.planning.comm_volume import plan_comm_volume
    ranks = 2 * megatron.get("tensor_model_parallel_size", 1) * megatron.get("expert_model_parallel_size", 1)
    model = {"sequence_parallel": megatron.get("sequence_parallel", False), "num_layers": megatron.get("num_layers", L),
             **megatron.get("model", {})}
    v = megatron.get("virtual_pipeline_model_parallel_size", 1)
    for records, stage, layout in run_on_ranks(ranks, _pipeline_step_records, megatron, m):
        planned = plan_comm_volume(GPTConfig(**dict(MODEL, **model)), layout, micro_batch=B, micro_batches=m,
                                   num_model_chunks=v, deepspeed_engine="pipeline_schedule" not in megatron)
        assert [p.stage for p in planned] == [0, 1]
        _check_plan(_measured_by_kind(records), planned[stage])
        sends = [payload for op, group, payload, _, _ in records if op == "send"]
        hidden = S * B * H * F32 // megatron.get("tensor_model_parallel_size", 1)  # this rank's slice with SP
        assert sends == [hidden] * (m * (2 * v - 1)), (stage, sends)


# MoE, for balanced routing: every token picks experts 0 and 2 (one on each EP rank), so each rank's experts receive
# the T * topk rows it sends.  Dense first layer, shared expert, the router's reductions (z-loss, each balancing
# loss, the expert bias) and the experts' gradients over edp.
DEEPSEEK = dict(MOE, moe_layer_freq=[0, 1], moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_shared_expert_intermediate_size=32, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
MOE_PLAN_CASES = {  # name: (ranks, megatron section, precision section, model options[, micro-batch size])
    # EP 2 (= dp 2): the global balancing loss and the expert bias's counts over dp
    "ep2-global-aux-expert-bias": (2, {"expert_model_parallel_size": 2}, {},
                                   dict(DEEPSEEK, moe_router_load_balancing_type="global_aux_loss")),
    # EP 2 x TP 2 with SP (ETP 2): the ETP gathers, the router's reductions over tp-cp (sequence-wise loss), the
    # router's logits bias (gpt-oss), a gated shared expert, bf16 rows
    "ep2-tp2-sp-etp2-seq-aux-bf16": (4, {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2,
                                         "sequence_parallel": True}, BF16_ON,
                                     dict(MOE, sequence_parallel=True, moe_add_bias_linear=True,
                                          moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2,
                                          moe_z_loss_coeff=1e-3, moe_router_dtype="fp32",
                                          moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)),
    # EP 2 x TP 2 without SP, ETP 1 (EDP 2), distributed optimizer: each TP rank dispatches its half of the tokens,
    # the experts' gradients reduce-scattered and their params all-gathered over edp
    "ep2-tp2-etp1-edp2-distopt-bf16": (4, {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2,
                                           "expert_tensor_parallel_size": 1, "use_distributed_optimizer": True},
                                       BF16_ON, DEEPSEEK),
    # DeepSeek-V3's shape: MLA, the sequence-wise loss and a multi-token-prediction layer (MoE, as the last
    # decoder layer), on EP 2 x TP 2 with SP: the expert bias's counts of both MoE layers summed once; three
    # sequences a micro-batch (the sequence-wise loss's counts are [b, E])
    "ep2-tp2-sp-mla-mtp1-seq-aux-b3": (4, {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2,
                                           "sequence_parallel": True}, {},
                                       dict(DEEPSEEK, **MLA, sequence_parallel=True, mtp_num_layers=1,
                                            moe_router_load_balancing_type="seq_aux_loss"), 3),
    # the allgather dispatcher moves the same bytes whatever the routing: not forced
    "ep2-allgather": (2, {"expert_model_parallel_size": 2}, {},
                      dict(MOE, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=1e-2)),
    # Recomputed MoE layers rerun their forward to the un-permuting scatter-add (torch's checkpoint stops at its
    # saved indices): the shared expert, the router's reductions, the counts, the dispatch and the combine again.
    # Whole layers under SP (ETP 2, the gated shared expert's gather and reduce-scatter, the sequence-wise loss)
    "ep2-tp2-sp-etp2-full-recompute-bf16": (4, {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2,
                                                "sequence_parallel": True}, BF16_ON,
                                            dict(MOE, sequence_parallel=True, moe_add_bias_linear=True,
                                                 moe_router_load_balancing_type="seq_aux_loss",
                                                 moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                                                 moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
                                                 recompute_granularity="full")),
    # without SP under hidden dropout (its mask saved after the MLP): the whole layer, the output's TP gather too
    "ep2-tp2-etp1-full-recompute-dropout": (4, {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2,
                                                "expert_tensor_parallel_size": 1}, {},
                                            dict(DEEPSEEK, hidden_dropout=0.1, recompute_granularity="full")),
    # selective: "moe" the MoE layer (no shared expert), "mlp" the dense first layer's MLP alone
    "ep2-tp2-sp-selective-mlp-moe": (4, {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2,
                                         "sequence_parallel": True}, {},
                                     dict(MOE, moe_layer_freq=[0, 1], sequence_parallel=True, moe_aux_loss_coeff=1e-2,
                                          moe_add_bias_linear=True, recompute_granularity="selective",
                                          recompute_modules=["core_attn", "mlp", "moe", "layernorm"])),
    # block 1: the MoE first layer rerun (the global loss's counts over dp again), the dense second not
    "ep2-global-aux-block-recompute-moe-first": (2, {"expert_model_parallel_size": 2}, {},
                                                 dict(DEEPSEEK, moe_layer_freq=[1, 0],
                                                      moe_router_load_balancing_type="global_aux_loss",
                                                      recompute_granularity="full", recompute_method="block",
                                                      recompute_num_layers=1)),
    # the allgather dispatcher's rerun gathers again, and stops before the output's reduce-scatter
    "ep2-allgather-selective-moe": (2, {"expert_model_parallel_size": 2}, {},
                                    dict(MOE, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=1e-2,
                                         recompute_granularity="selective", recompute_modules=["moe"])),
}


@pytest.mark.parametrize("name", list(MOE_PLAN_CASES))
def test_the_plans_formula_is_what_a_moe_step_moves(name):
    from ds_megatron.planning.comm_volume import plan_comm_volume
    ranks, megatron, precision, model, *batch = MOE_PLAN_CASES[name]
    b = batch[0] if batch else B
    distopt = megatron.get("use_distributed_optimizer", False)
    chosen = None if model.get("moe_token_dispatcher_type") == "allgather" else (0, 2)
    for records, info in run_on_ranks(ranks, _step_records, megatron, precision, model, 1, chosen, b):
        planned, = plan_comm_volume(GPTConfig(**{**MODEL, **model}), info["layout"], "bf16" if precision else "fp32",
                                    micro_batch=b, distributed_optimizer=distopt)
        padding = (F32 + BF16) / 2 if distopt else 0.0  # dp = edp = 2 here
        _check_plan(_measured_by_kind(records), planned, 64 * info["buffered_params"] + 128, padding)


def test_the_moe_plan_refuses_what_it_cannot_count():
    from ds_megatron.errors import ConfigError
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.planning.comm_volume import plan_comm_volume
    layout = ParallelLayout(world_size=2, ep=2)
    for extra, field in [({"moe_capacity_factor": 1.0}, "model.moe_capacity_factor=1.0"),
                         ({"fp8": "e4m3"}, "model.fp8='e4m3'")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            plan_comm_volume(GPTConfig(**MODEL, **MOE, **extra), layout)
    assert plan_comm_volume(GPTConfig(**MODEL, **MOE), layout)[0].bus_bytes["ep"] > 0
