"""An fp8 GPT at context parallelism 2 equals the one-rank fp8 GPT (float64, tensorwise): each CP rank's linears see
its sequence chunks, and their amaxes are agreed over TP x CP, so every tensor gets the whole sequence's scale,
for every ``cp_comm_type``; blockwise (p2p) too, its token tiles within each rank's zigzag chunks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness import run_on_ranks

from ds_megatron.config.model import GPTConfig
from ds_megatron.models.gpt import GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState

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
