"""Packed micro-batches: each document gets exactly what it gets alone, in every model path and layout.

The reference is independent of packing: each document run alone through the same model (a row of its own, no
position ids), float64.  A packed micro-batch (rows with different boundaries, both the position-ids and the
``cu_seqlens`` form) must give every document's logits, and the loss and gradients summed over the documents'
trained tokens, to 1e-10 relative.  A document's last token is not trained in either (its label in the packed row
is the next document's first token).  Routing losses and multi-token prediction are statistics over the
micro-batch, not per document: their reference is the same documents as rows of their own (equal lengths, no
padding), which the packed batch (with a padding tail) must equal.  Then every layout (TP 2 + SP, CP 2 of each
type, CP 4 hierarchical, EP 2, PP 2 with 1F1B and interleaved) must give the one-rank packed loss and gradients.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.checkpointing.global_shards import RankCoordinates, global_shards
from ds_megatron.convert.model_io import model_tensors
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelGroup, ParallelState
from ds_megatron.tensor_parallel import allreduce_tp_partial_grads
from ds_megatron.transformer.packed_seq_params import PackedSeqParams, document_zigzag

SEQ, VOCAB = 32, 64
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, seq_length=SEQ,
            vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)
LLAMA = dict(BASE, num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm",
             gated_linear_unit=True, activation="silu", add_bias_linear=False,
             untie_embeddings_and_output_weights=True)
MODELS = {
    "gpt2": BASE,  # learned absolute positions, LayerNorm, GELU, tied output
    "llama": LLAMA,  # RoPE, RMSNorm, SwiGLU, GQA
    "qwen3": dict(LLAMA, qk_layernorm=True, kv_channels=16),  # QK norm, head_dim other than hidden / heads
    "mixtral": dict(LLAMA, num_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2),
    "deepseek_v3": dict(BASE, position_embedding_type="rope", normalization="RMSNorm", gated_linear_unit=True,
                        activation="silu", add_bias_linear=False, multi_latent_attention=True, q_lora_rank=16,
                        kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, num_experts=4,
                        moe_ffn_hidden_size=24, moe_router_topk=2, moe_router_score_function="sigmoid",
                        moe_shared_expert_intermediate_size=24),
}
ROUTING_LOSSES = {"mixtral": dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001),
                  "deepseek_v3": dict(moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="seq_aux_loss",
                                      moe_z_loss_coeff=0.001, mtp_num_layers=1, mtp_loss_scaling_factor=0.3)}
ROWS = [[5, 11, 16], [32], [1, 30, 1]]  # document lengths of each row: different boundaries per row


def _documents(lengths, seed=3):
    """Each document as its own token sequence (length + 1 tokens: inputs and labels)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n + 1,), generator=g) for n in lengths]


def _packed(rows, seed=3):
    """(tokens, labels, position_ids) of rows packing the documents of ``rows`` (lengths), and the documents."""
    docs = [_documents(r, seed + i) for i, r in enumerate(rows)]
    tokens = torch.stack([torch.cat([d[:-1] for d in row]) for row in docs])
    labels = torch.stack([torch.cat([d[1:] for d in row]) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(len(d) - 1) for d in row]) for row in docs])
    return tokens, labels, positions, docs


def _model(name, state=None, **extra):
    torch.manual_seed(11)
    return GPTModel(GPTConfig(**MODELS[name], **extra), state).double()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("form", ["position_ids", "cu_seqlens"])
@pytest.mark.parametrize("name", list(MODELS))
def test_each_document_gets_its_own_logits_loss_and_gradients(name, form):
    model = _model(name)
    rows = ROWS if form == "position_ids" else [[5, 11, 12]]  # cu_seqlens: micro-batch 1, a padding tail of 4
    tokens, labels, positions, docs = _packed(rows)
    if form == "position_ids":
        documents = {"position_ids": positions}
    else:
        tokens = torch.cat((tokens, torch.full((1, 4), 7)), dim=1)
        labels = torch.cat((labels, torch.full((1, 4), 9)), dim=1)
        documents = {"cu_seqlens": torch.tensor([0, 5, 16, 28], dtype=torch.int32)}
    logits = model(tokens, **documents)
    loss = model({"tokens": tokens, "labels": labels, **documents})
    loss.backward()
    packed_grads = _grads(model)
    model.zero_grad()
    total, count = 0.0, 0
    for r, row in enumerate(docs):
        start = 0
        for d in row:
            n = len(d) - 1
            alone = model(d[:-1][None])
            assert torch.allclose(logits[r, start:start + n], alone[0], rtol=1e-10, atol=1e-12), (r, start)
            mask = torch.ones(1, n, dtype=torch.float64)
            if start + n < tokens.size(1):  # a document's last label is the next one's first token: not trained
                mask[0, -1] = 0
            if mask.sum() > 0:
                part = model(d[:-1][None], d[1:][None], mask) * mask.sum()
                part.backward()
                total, count = total + float(part.detach()), count + int(mask.sum())
            start += n
    assert abs(float(loss.detach()) - total / count) <= 1e-10 * abs(total / count)
    for n, g in _grads(model).items():
        assert torch.allclose(packed_grads[n], g / count, rtol=1e-10, atol=1e-13), n


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="full"),
                                       dict(recompute_granularity="selective",
                                            recompute_modules=["core_attn", "mlp", "moe"])],
                         ids=["full", "selective-core_attn-mlp-moe"])
@pytest.mark.parametrize("name", ["llama", "mla", "mixtral", "deepseek_v3"])
def test_recomputation_keeps_the_documents_apart(name, recompute):
    """Recomputed layers (whole, or the attention core, the MLP and the MoE layer) rerun with the same documents:
    the packed loss and gradients of the model without recomputation (MoE: its routing losses over real tokens,
    each document a sequence, DeepSeek-V3's MTP depth too)."""
    tokens, labels, positions, _ = _packed(ROWS)
    batch = {"tokens": tokens, "labels": labels, "position_ids": positions}
    dense = {k: v for k, v in MODELS["deepseek_v3"].items() if not k.startswith(("num_experts", "moe_"))}
    results = []
    for extra in ({}, recompute):
        torch.manual_seed(11)
        model = (GPTModel(GPTConfig(**dense, **extra)).double() if name == "mla"
                 else _model(name, **ROUTING_LOSSES.get(name, {}), **extra))
        model(batch).backward()
        results.append(_grads(model))
    for n, g in results[0].items():
        assert torch.allclose(results[1][n], g, rtol=1e-12, atol=1e-15), n


@pytest.mark.parametrize("name", list(ROUTING_LOSSES))
def test_routing_and_mtp_losses_count_real_tokens_and_each_document_as_a_sequence(name):
    """Six documents of 8 tokens as six rows, and packed four and two to a row with a 16-token padding tail (given
    by ``padding_mask``): the same load-balancing (sequence-wise for DeepSeek-V3: per document), z and MTP losses,
    the same total and gradients."""
    model = _model(name, **ROUTING_LOSSES[name])
    docs = _documents([8] * 6, seed=5)
    rows = torch.stack([d[:-1] for d in docs]), torch.stack([d[1:] for d in docs])
    mask = torch.ones(6, 8, dtype=torch.float64)
    mask[:, -1] = 0  # as in the packed rows
    reference = model(rows[0], rows[1], mask)
    reference.backward()
    expected = _grads(model)
    model.zero_grad()
    tokens = torch.full((2, SEQ), 3)
    labels = torch.full((2, SEQ), 5)
    tokens[0], labels[0] = rows[0][:4].reshape(-1), rows[1][:4].reshape(-1)
    tokens[1, :16], labels[1, :16] = rows[0][4:].reshape(-1), rows[1][4:].reshape(-1)
    positions = torch.arange(8).repeat(4).expand(2, SEQ).clone()
    padding = torch.zeros(2, SEQ, dtype=torch.bool)
    padding[1, 16:] = True
    row_end = torch.ones(2, SEQ, dtype=torch.float64)
    row_end[0, -1] = 0  # a row's last label lies beyond the row: the data masks the end of a document there
    loss = model({"tokens": tokens, "labels": labels, "loss_mask": row_end, "position_ids": positions,
                  "padding_mask": padding})
    loss.backward()
    assert abs(float(loss.detach()) - float(reference.detach())) <= 1e-10 * abs(float(reference.detach()))
    for n, g in _grads(model).items():
        assert torch.allclose(g, expected[n], rtol=1e-10, atol=1e-13), n


def test_context_parallel_cut_keeps_each_documents_zigzag_and_equal_shares():
    # One document: Megatron's zigzag exactly.
    assert document_zigzag([16], 2) == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    for lengths, cp in (([5, 11, 16], 2), ([1, 30, 1], 2), ([3, 7, 9, 13], 4), ([32], 4)):
        held = document_zigzag(lengths, cp)
        assert sorted(sum(held, [])) == list(range(sum(lengths)))
        assert {len(h) for h in held} == {sum(lengths) // cp}
        start = 0
        for n in lengths:  # each document: rank r holds chunks r and 2cp-1-r, near-equal (within one token)
            per_rank = [[i for i in h if start <= i < start + n] for h in held]
            assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 2
            assert all(len(p) >= 2 * (n // (2 * cp)) for p in per_rank)
            start += n


@pytest.mark.parametrize("bad, message", [
    ({"position_ids": torch.tensor([[1, 2, 3, 4]])}, "restart at 0"),
    ({"position_ids": torch.tensor([[0, 1, 3, 4]])}, "grow by 1"),
    ({"cu_seqlens": torch.tensor([0, 3, 2], dtype=torch.int32)}, "rise strictly"),
    ({"cu_seqlens": torch.tensor([0, 2, 4], dtype=torch.int32), "position_ids": torch.tensor([[0, 1, 2, 3]])},
     "describe different documents"),
])
def test_malformed_documents_are_refused_naming_the_key(bad, message):
    with pytest.raises(ValueError, match=message):
        PackedSeqParams.from_batch(torch.zeros(1, 4, dtype=torch.long), ParallelGroup.single("cp"), **bad)
    with pytest.raises(ValueError, match="micro-batch has 2"):
        PackedSeqParams.from_batch(torch.zeros(2, 4, dtype=torch.long), ParallelGroup.single("cp"),
                                   cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))


def test_one_document_per_row_needs_no_packing():
    tokens = torch.zeros(2, 8, dtype=torch.long)
    assert PackedSeqParams.from_batch(tokens, ParallelGroup.single("cp"), position_ids=torch.arange(8).repeat(2, 1)) \
        is None


# ---------------------------------------------------------------- every layout gives the one-rank result

def _multi_rank_batch():
    """Rows with different boundaries, a padding tail, routing losses on: the hardest case for every layout."""
    tokens, labels, positions, _ = _packed([[5, 11, 16], [3, 13, 8, 8]], seed=21)
    padding = torch.zeros_like(tokens, dtype=torch.bool)
    padding[1, 24:] = True
    return {"tokens": tokens, "labels": labels, "position_ids": positions, "padding_mask": padding}


def _full_gradients(model, state, config):
    """{one-rank parameter name: gradient} put together from every rank (copies must agree)."""
    allreduce_tp_partial_grads(model, state.tp)
    if state.cp.size > 1:  # each CP rank's gradient is cp x its share: the job averages over dp-cp
        for p in model.parameters():
            dist.all_reduce(p.grad, group=state.cp.group)
            p.grad /= state.cp.size
    split = {id(p): bool(getattr(p, "tensor_model_parallel", False)) for p in model.parameters()}
    mine = []
    for name, t in model_tensors(model).items():
        for s in global_shards(config, name, tuple(t.shape), split.get(id(t), False), RankCoordinates.of(state)):
            mine.append((s.name, s.global_shape, s.offsets, t.grad[s.local_rows[0]:s.local_rows[1]].clone()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full = {}
    for shards in everyone:
        for name, shape, offsets, block in shards:
            t = full.setdefault(name, torch.full(shape, float("nan"), dtype=block.dtype))
            region = t[tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))]
            if not torch.isnan(region).all():
                assert torch.allclose(region, block, rtol=1e-10, atol=1e-13), f"copies of {name} differ"
            region.copy_(block)
    return full


def _layout_loss_and_gradients(name, layout, cp_comm_type="p2p", hierarchical=None, form="position_ids"):
    world = dist.get_world_size()
    config = GPTConfig(**MODELS[name], **ROUTING_LOSSES.get(name, {}), sequence_parallel=layout.get("sp", False),
                       cp_comm_type=cp_comm_type)
    parallel = ParallelLayout(world_size=world, tp=layout.get("tp", 1), cp=layout.get("cp", 1),
                              ep=layout.get("ep", 1))
    state = ParallelState.build(parallel)
    if hierarchical:
        state.build_hierarchical_context_parallel(hierarchical)
    torch.manual_seed(11)
    model = GPTModel(config, state).double()
    batch = _multi_rank_batch()
    if form == "cu_seqlens":  # megatron-core's THD form: the first row, its last 8 tokens padding
        batch = {"tokens": batch["tokens"][:1], "labels": batch["labels"][:1],
                 "cu_seqlens": torch.tensor([0, 5, 16, 24], dtype=torch.int32)}
    loss = model(batch)
    loss.backward()
    grads = _full_gradients(model, state, config)
    state.destroy()
    return float(loss), grads


LAYOUTS = {  # name: (model, world, layout, cp_comm_type, the hierarchical a2a size)
    "tp2-sp": ("qwen3", 2, {"tp": 2, "sp": True}, "p2p", None),
    "tp2-sp-mla-mtp": ("deepseek_v3", 2, {"tp": 2, "sp": True}, "p2p", None),
    "cp2-p2p": ("deepseek_v3", 2, {"cp": 2}, "p2p", None),
    "tp2-sp-cp2-p2p": ("mixtral", 4, {"tp": 2, "sp": True, "cp": 2}, "p2p", None),
    "cp2-all_gather": ("llama", 2, {"cp": 2}, "all_gather", None),
    "cp2-a2a": ("gpt2", 2, {"cp": 2}, "a2a", None),
    "cp4-a2a+p2p": ("qwen3", 4, {"cp": 4}, "a2a+p2p", 2),
    "ep2": ("mixtral", 2, {"ep": 2}, "p2p", None),
    "tp2-sp-cp2-p2p-cu_seqlens": ("deepseek_v3", 4, {"tp": 2, "sp": True, "cp": 2}, "p2p", None),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_every_layout_gives_the_one_rank_packed_loss_and_gradients(case):
    name, world, layout, comm, hierarchical = LAYOUTS[case]
    form = "cu_seqlens" if case.endswith("cu_seqlens") else "position_ids"
    (ref_loss, ref_grads), = run_on_ranks(1, _layout_loss_and_gradients, name, {}, "p2p", None, form)
    for loss, grads in run_on_ranks(world, _layout_loss_and_gradients, name, layout, comm, hierarchical, form):
        assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss)
        for key, g in ref_grads.items():
            scale = 2.0 if "experts" in key and layout.get("ep") else 1.0  # both EP ranks route the same batch
            assert torch.allclose(grads[key], scale * g, rtol=1e-9, atol=1e-12), key


def _pipeline_loss_and_gradients(chunks_per_rank, schedule_name="interleaved_1f1b"):
    """Our pipeline runtime's schedule over this rank's chunks (PP 2, or one rank without PP): the packed
    micro-batches (one row each) and their documents reach every chunk, the middle ones included."""
    from ds_megatron.models.gpt_chunks import GPTModelChunks
    from ds_megatron.pipeline_parallel.p2p_communication import PipelineChannels
    from ds_megatron.pipeline_parallel.schedules import PipelineSchedule
    config = GPTConfig(**dict(MODELS["deepseek_v3"], num_layers=4), **ROUTING_LOSSES["deepseek_v3"])
    batch = _multi_rank_batch()
    micro_batches = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(2)]
    pp = dist.get_world_size()
    state = ParallelState.build(ParallelLayout(world_size=pp, pp=pp))
    torch.manual_seed(11)
    if pp == 1:
        model = GPTModel(config, state).double()
        value = 0.0
        for mb in micro_batches:  # the schedule's mean over the micro-batches
            loss = model(mb) / 2
            loss.backward()
            value += float(loss.detach() - model.moe_aux_loss().detach() / 2)  # its losses exclude routing's
        return value, {n: p.grad for n, p in model.named_parameters()}
    model = GPTModelChunks(config, state, num_model_chunks=chunks_per_rank).double()
    model.set_aux_loss_gradient_scale(lambda: torch.tensor(0.5, dtype=torch.float64))
    channels = PipelineChannels(state)
    store = None
    if schedule_name == "zero_bubble":  # W deferred: the weight gradients computed after the step's B
        from ds_megatron.tensor_parallel.layers import attach_weight_grad_store
        from ds_megatron.tensor_parallel.weight_grad_store import WeightGradStore
        store = WeightGradStore()
        attach_weight_grad_store(model, store)
    schedule = PipelineSchedule(model.chunks, state.pp, channels, (SEQ, 1, config.hidden_size), torch.float64,
                                torch.device("cpu"), schedule=schedule_name, weight_grad_store=store,
                                prepare_documents=model.packed_seq_params)
    losses = schedule.run(iter(micro_batches), 2)
    mine = {}
    for name, p in model.named_gpt_parameters():  # the tied / MTP embedding copies: summed over the stages
        mine[name] = mine.get(name, 0) + p.grad
    everyone = [None] * pp
    dist.all_gather_object(everyone, (sum(float(x) for x in losses) / 2, mine))
    grads = {}
    for _, part in everyone:
        for name, g in part.items():
            grads[name] = grads[name] + g if name in grads else g
    channels.destroy()
    state.destroy()
    return everyone[-1][0], grads


@pytest.mark.parametrize("chunks_per_rank,schedule", [(1, "interleaved_1f1b"), (2, "interleaved_1f1b"),
                                                      (1, "zero_bubble")], ids=["1f1b", "interleaved", "zb-h1"])
def test_pipeline_schedules_give_the_one_rank_packed_loss_and_gradients(chunks_per_rank, schedule):
    (ref_loss, ref_grads), = run_on_ranks(1, _pipeline_loss_and_gradients, 1)
    for loss, grads in run_on_ranks(2, _pipeline_loss_and_gradients, chunks_per_rank, schedule):
        assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss)
        assert sorted(grads) == sorted(ref_grads)
        for key, g in ref_grads.items():
            assert torch.allclose(grads[key], g, rtol=1e-9, atol=1e-12), key


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_varlen_kernel_on_a_gpu_equals_one_call_per_document():
    """bf16 on a GPU runs every document in one launch of torch's variable-length flash kernel: the same outputs and
    input gradients as one SDPA call per document, in float32, to bf16 rounding."""
    from ds_megatron.transformer.packed_seq_params import document_attention
    _, _, positions, _ = _packed(ROWS)
    packed = PackedSeqParams.from_batch(positions.cuda(), ParallelGroup.single("cp"), position_ids=positions.cuda())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, SEQ, 16, generator=g).cuda() for _ in range(3))
    inputs = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = document_attention(*inputs, packed)
    out.float().square().sum().backward()
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.cat([torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(t[r:r + 1, :, a:z] for t in reference), is_causal=True) for row, a, z in packed.spans if row == r], dim=2)
        for r in range(3)])
    expected.square().sum().backward()
    assert torch.allclose(out.float(), expected, rtol=2e-2, atol=2e-2)
    for got, want in zip(inputs, reference):
        assert torch.allclose(got.grad.float(), want.grad, rtol=5e-2, atol=5e-2)
