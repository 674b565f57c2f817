"""Every rank's tensors, placed by ``global_shards``, rebuild the one-rank model exactly.

Our models draw every weight from the seed alone, so a model built at any TP / PP / EP / ETP
after ``torch.manual_seed(s)`` holds the same full model as the one-rank ``GPTModel``.  Each
rank's shards are written into global tensors (shards placed twice, replicas, must agree)
and the result must equal the one-rank model's ``state_dict`` tensor for tensor, with
every element covered: the layout-independent checkpoint stores exactly these shards.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.checkpointing.global_shards import GlobalLayoutError, RankCoordinates, global_shards
from ds_megatron.convert.model_io import model_tensors
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState

GPT2 = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, seq_length=8, vocab_size=50,
            make_vocab_size_divisible_by=4, hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dict(GPT2, num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm",
             gated_linear_unit=True, activation="silu", add_bias_linear=False, add_qkv_bias=True,
             untie_embeddings_and_output_weights=True, qk_layernorm=True)
QWEN_MOE = dict(LLAMA, num_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2,
                moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True)
MIXTRAL_GPT2 = dict(GPT2, num_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2)
# gpt-oss's biased experts (random biases: they start at zero): fc1's split with its rows, fc2's by hidden columns
GPT_OSS_MOE = dict(QWEN_MOE, moe_add_bias_linear=True, moe_shared_expert_intermediate_size=None,
                   moe_shared_expert_gate=False)

CASES = {  # name: (model, tp, pp, ep, etp)
    "gpt2-tp4": (GPT2, 4, 1, 1, 1),
    "gpt2-tp2-pp2": (GPT2, 2, 2, 1, 1),
    "llama-tp2": (LLAMA, 2, 1, 1, 1),
    "llama-tp4-replicated-kv": (LLAMA, 4, 1, 1, 1),
    "llama-tp2-pp2": (LLAMA, 2, 2, 1, 1),
    "qwen-moe-tp2-ep2-etp2": (QWEN_MOE, 2, 1, 2, 2),
    "qwen-moe-tp1-ep4": (QWEN_MOE, 1, 1, 4, 1),
    "gpt2-moe-tp4-ep2-etp2": (MIXTRAL_GPT2, 4, 1, 2, 2),
    "gpt-oss-moe-tp1-ep2-etp2": (GPT_OSS_MOE, 1, 1, 2, 2),
    # dense layers among the MoE ones (moe_layer_freq's list form): stage 0 holds no expert
    "qwen-moe-dense-first-tp2-pp2-ep2": (dict(QWEN_MOE, num_layers=4, moe_layer_freq=[0, 0, 1, 1]), 2, 2, 2, 1),
}


def _randomize_expert_biases(model, config, etp, etp_rank):
    """Each expert's biases from a generator of its own (layer, expert), this ETP rank's slices of them: fc1's
    ``[gate; up]`` rows, each half split, and fc2's hidden columns."""
    f, h = config.moe_ffn_hidden_size // etp, config.hidden_size // etp
    for i, layer in enumerate(model.layers):
        experts = layer.mlp.experts
        for local, e in enumerate(experts.local_expert_indices):
            g = torch.Generator().manual_seed(100 * i + e)
            fc1, fc2 = torch.randn(2 * config.moe_ffn_hidden_size, generator=g), torch.randn(config.hidden_size,
                                                                                            generator=g)
            weights = experts.expert_weights(local)
            with torch.no_grad():
                weights["linear_fc1.bias"].copy_(torch.cat([half[etp_rank * f:(etp_rank + 1) * f]
                                                            for half in fc1.chunk(2)]))
                weights["linear_fc2.bias"].copy_(fc2[etp_rank * h:(etp_rank + 1) * h])


def _rank_shards(model_kwargs, tp, pp, ep, etp):
    world = dist.get_world_size()
    config = GPTConfig(**model_kwargs)
    if pp > 1:
        state = ds_megatron.initialize_model_parallel({
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
            "megatron": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                         "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}})
        torch.manual_seed(3)
        model = ds_megatron.GPTPipelineModule(config, state)
    else:
        state = ParallelState.build(ParallelLayout(world_size=world, tp=tp, ep=ep, etp=etp))
        torch.manual_seed(3)
        model = GPTModel(config, state)
    if config.moe_add_bias_linear:
        _randomize_expert_biases(model, config, etp, state.etp.rank)
    coords = RankCoordinates.of(state)
    split = {id(p): bool(getattr(p, "tensor_model_parallel", False)) for p in model.parameters()}
    mine = []
    for name, tensor in model_tensors(model).items():
        for s in global_shards(config, name, tuple(tensor.shape), split.get(id(tensor), False), coords):
            mine.append((s.name, s.global_shape, s.offsets, tensor.detach()[s.local_rows[0]:s.local_rows[1]].clone()))
    if pp > 1:
        model.destroy_process_groups()
    state.destroy()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    torch.manual_seed(3)
    reference = GPTModel(config, ParallelState.single())
    if config.moe_add_bias_linear:
        _randomize_expert_biases(reference, config, 1, 0)
    return everyone, reference.state_dict()


def _assemble(everyone):
    full, covered = {}, {}
    for shards in everyone:
        for name, shape, offsets, block in shards:
            t = full.setdefault(name, torch.full(shape, float("nan"), dtype=block.dtype))
            c = covered.setdefault(name, torch.zeros(shape, dtype=torch.bool))
            index = tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))
            seen = c[index]
            assert torch.equal(t[index][seen], block[seen]), f"{name}: two ranks place different values at {offsets}"
            t[index] = block
            c[index] = True
    return full, covered


@pytest.mark.parametrize("case", sorted(CASES))
def test_shards_rebuild_the_one_rank_model(case):
    model_kwargs, tp, pp, ep, etp = CASES[case]
    everyone, reference = run_on_ranks(4, _rank_shards, model_kwargs, tp, pp, ep, etp)[0]
    full, covered = _assemble(everyone)
    reference = {k: v for k, v in reference.items() if torch.is_floating_point(v)}
    assert sorted(full) == sorted(reference)
    for name, ref in reference.items():
        assert covered[name].all(), f"{name}: {int((~covered[name]).sum())} elements no rank holds"
        assert torch.equal(full[name], ref), f"{name} differs from the one-rank model"


def test_unknown_tensor_parallel_tensor_is_refused():
    with pytest.raises(GlobalLayoutError, match="mystery.weight"):
        global_shards(GPTConfig(**GPT2), "layers.0.mystery.weight", (4, 16), True, RankCoordinates(tp=2))
