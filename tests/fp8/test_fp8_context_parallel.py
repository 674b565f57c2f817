"""An fp8 GPT at context parallelism 2 equals the one-rank fp8 GPT (float64, tensorwise): each CP rank's linears see
its sequence chunks, and their amaxes are agreed over TP x CP, so every tensor gets the whole sequence's scale,
for every ``cp_comm_type``; blockwise (p2p) too, its token tiles within each rank's zigzag chunks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness import run_on_ranks

from ds_megatron.config.model import GPTConfig
from ds_megatron.fp8 import delayed_scaling_groups, update_delayed_scaling
from ds_megatron.fp8.recipe import E4M3_MAX, E5M2_MAX, ROLES
from ds_megatron.models.gpt import GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.tensor_parallel.layers import fp8_states

CFG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100, hidden_dropout=0.0,
           attention_dropout=0.0, make_vocab_size_divisible_by=4, fp8="hybrid")
COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# The fp8 GEMMs accumulate in fp32: a weight gradient summed over the CP ranks' 32-token halves differs from one
# GEMM over the 64 tokens by fp32 rounding, up to (64 + 2) 2^-24 = 3.9e-6 of the products' size; the loss (no sum
# over tokens inside a GEMM) is equal to float64 rounding.
GRAD_TOL = 1e-5


def _loss_and_grads(model, tokens, labels):
    loss = model(tokens, labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _cp2_equals_one_rank():
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), cp=2))
    state.build_hierarchical_context_parallel(1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (2, 32), generator=g)
    labels = torch.roll(tokens, -1, 1)
    torch.manual_seed(7)
    ref_loss, ref_grads = _loss_and_grads(GPTModel(GPTConfig(**CFG)).double(), tokens, labels)
    worst = {}
    for comm in COMM_TYPES:
        torch.manual_seed(7)
        model = GPTModel(GPTConfig(**CFG, cp_comm_type=comm), state).double()
        loss, grads = _loss_and_grads(model, tokens, labels)
        assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss), (comm, loss.item(), ref_loss.item())
        worst[comm] = 0.0
        for name, grad in grads.items():
            grad = grad.clone()
            dist.all_reduce(grad, group=state.cp.group)  # the dp-cp mean of the gradients is the one-rank one
            grad /= 2
            err = ((grad - ref_grads[name]).abs().max() / ref_grads[name].abs().max()).item()
            worst[comm] = max(worst[comm], err)
            assert err <= GRAD_TOL, f"{comm}: {name} gradient off by {err:.1e} of its largest entry"
    torch.manual_seed(7)
    bf16 = GPTModel(GPTConfig(**{**CFG, "fp8": None})).double()
    assert abs(_loss_and_grads(bf16, tokens, labels)[0] - ref_loss) > 1e-4 * ref_loss  # fp8 engaged
    # Blockwise: each zigzag chunk (seq / 4 = 128 tokens) holds whole 1x128 tiles of the weight gradient's tokens.
    blockwise = {**CFG, "num_layers": 1, "hidden_size": 128, "seq_length": 512, "fp8_recipe": "blockwise"}
    tokens = torch.randint(0, 100, (1, 512), generator=g)
    labels = torch.roll(tokens, -1, 1)
    torch.manual_seed(7)
    ref_loss, ref_grads = _loss_and_grads(GPTModel(GPTConfig(**blockwise)).double(), tokens, labels)
    torch.manual_seed(7)
    loss, grads = _loss_and_grads(GPTModel(GPTConfig(**blockwise), state).double(), tokens, labels)
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss), ("blockwise", loss.item(), ref_loss.item())
    for name, grad in grads.items():
        grad = grad.clone()
        dist.all_reduce(grad, group=state.cp.group)
        err = ((grad / 2 - ref_grads[name]).abs().max() / ref_grads[name].abs().max()).item()
        worst["blockwise"] = max(worst.get("blockwise", 0.0), err)
        assert err <= GRAD_TOL, f"blockwise: {name} gradient off by {err:.1e} of its largest entry"
    state.destroy()
    return worst if dist.get_rank() == 0 else None


def test_fp8_gpt_at_context_parallel_2_equals_one_rank_for_every_comm_type():
    print(run_on_ranks(2, _cp2_equals_one_rank)[0])


MLA = dict(position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16,
           qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)


def _cp2_mla_equals_one_rank():
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), cp=2))
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, 1)
    torch.manual_seed(7)
    ref_loss, ref_grads = _loss_and_grads(GPTModel(GPTConfig(**CFG, **MLA)).double(), tokens, labels)
    for comm in ("p2p",):  # the cores' exchanges are MLA's own test's; here the fp8 linears' chunks
        torch.manual_seed(7)
        model = GPTModel(GPTConfig(**CFG, **MLA, cp_comm_type=comm), state).double()
        loss, grads = _loss_and_grads(model, tokens, labels)
        assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss), (comm, loss.item(), ref_loss.item())
        for name, grad in grads.items():
            grad = grad.clone()
            dist.all_reduce(grad, group=state.cp.group)
            err = ((grad / 2 - ref_grads[name]).abs().max() / ref_grads[name].abs().max()).item()
            assert err <= GRAD_TOL, f"{comm}: {name} gradient off by {err:.1e} of its largest entry"
    state.destroy()


def test_fp8_mla_at_context_parallel_2_equals_one_rank():
    """Multi-latent attention, its down-projections in fp8 too: each CP rank's chunks scaled as the whole sequence
    (amaxes over TP x CP), the ring's core carrying K and the narrower V."""
    run_on_ranks(2, _cp2_mla_equals_one_rank)


def _delayed_scales_at_cp2():
    """The delayed recipe at CP 2: the step's update (MAX over ``delayed_scaling_groups``, which
    ``finalize_model_grads`` and DeepSpeed's path use) gives every rank the scales of the amaxes over the whole
    sequence: the inputs' and weights' equal the one-rank model's; the output gradients' come from the larger of the
    two halves' (each CP rank's loss is its half's mean, so its dY is twice the one-rank run's, and at the first
    step's scale of 1 the fp8 copies of 2 dY and dY underflow differently: only the agreement is exact there)."""
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), cp=2))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (2, 32), generator=g)
    labels = torch.roll(tokens, -1, 1)
    delayed = {**CFG, "fp8_recipe": "delayed", "fp8_amax_history_len": 2}
    scales = []
    for layout_state, groups in ((None, {"dense": []}), (state, delayed_scaling_groups(state))):
        torch.manual_seed(7)
        model = GPTModel(GPTConfig(**delayed), layout_state).double()
        _loss_and_grads(model, tokens, labels)
        states = fp8_states(model)
        local = torch.stack([s.step_amax[r] for s in states for r in ROLES])
        update_delayed_scaling(states, groups)
        scales.append(torch.stack([s.scale[r] for s in states for r in ROLES]))
    agreed, smaller = local.clone(), local.clone()
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    dist.all_reduce(smaller, op=dist.ReduceOp.MIN)
    state.destroy()
    assert scales[1].numel() == 2 * 4 * len(ROLES) and (agreed != smaller).any()  # the halves' amaxes differ
    fp8_max = torch.tensor([E5M2_MAX if r == "grad_output" else E4M3_MAX for _ in range(8) for r in ROLES])
    want = fp8_max / agreed  # fp8 "hybrid": E5M2 output gradients
    assert torch.equal(scales[1], want), [(a.item(), b.item()) for a, b in zip(scales[1], want) if a != b]
    forward = torch.tensor([r != "grad_output" for _ in range(2 * 4) for r in ROLES])
    assert torch.equal(scales[1][forward], scales[0][forward])


def test_delayed_scales_at_context_parallel_2_agree_over_cp():
    run_on_ranks(2, _delayed_scales_at_cp2)
