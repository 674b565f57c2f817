"""MoE GPT layers wrapped by hand in someone else's activation checkpoint, against the same model unwrapped, float64.

Existing DeepSpeed projects wrap each layer in ``deepspeed.checkpointing.checkpoint`` (reentrant: the forward runs
under no_grad, the rerun in backward is what gets backpropagated) or in torch's checkpoint (reentrant or not).
Whatever the wrapping, the loss, every gradient (the routers' from the routing losses included), the logged routing
losses (one record per layer and forward) and the expert-bias token counts must be the unwrapped model's.
"""
import functools

import deepspeed
import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint

from harness import run_on_ranks
from moe_helpers import moe_config
from ds_megatron.models import GPTModel
from ds_megatron.models.gpt_chunks import GPTModelChunks
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.tensor_parallel import RNGStatesTracker, model_parallel_seed

# hidden 32, seq 16; a shared expert; both routing losses; dropout replayed by the checkpoints' RNG handling.
KW = dict(hidden_size=32, seq_length=16, moe_shared_expert_ffn_hidden_size=16, moe_aux_loss_coeff=0.01,
          moe_z_loss_coeff=0.001, hidden_dropout=0.1)
BIAS = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_z_loss_coeff=0.0)
WRAPS = {
    "deepspeed": deepspeed.checkpointing.checkpoint,
    "torch-reentrant": functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True),
    "torch-non-reentrant": functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
}


def _wrap(checkpoint, forward, hidden, packed_seq_params=None):
    return checkpoint(forward, hidden, packed_seq_params)


def _step(state, wrap, **extra):
    """One float64 forward and backward; (loss, gradients, tracker records, logged losses, expert-bias counts)."""
    torch.manual_seed(21)
    cfg = moe_config(**{**KW, **extra})
    tracker = RNGStatesTracker()
    model = GPTModel(cfg, state, rng_tracker=tracker).double()
    model_parallel_seed(5, state.tp.rank, ep_rank=state.ep.rank, etp_rank=state.etp.rank, tracker=tracker)
    if wrap is not None:
        for layer in model.layers:
            layer.forward = functools.partial(_wrap, WRAPS[wrap], layer.forward)
    g = torch.Generator().manual_seed(100 + state.dp.rank)
    tokens, labels = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g) for _ in range(2))
    loss = model(tokens, labels)
    loss.backward()
    aux = model.moe_aux_loss_tracker
    # How many records made it (a mean hides a value recorded twice), and what the log shows.
    records = {key: count for key, (_, count) in aux._sums.items()}
    logged = {name: v.item() for name, v in aux.averages().items()}
    counts = [layer.mlp.router.local_tokens_per_expert.clone() for layer in model.layers
              if layer.mlp.router.local_tokens_per_expert is not None]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, records, logged, counts


def _check_wrappings(state, **extra):
    ref_loss, ref_grads, ref_records, ref_logged, ref_counts = _step(state, None, **extra)
    assert ref_logged and all(count == 1 for count in ref_records.values()), ref_records
    if extra.get("moe_router_enable_expert_bias"):
        assert ref_counts and all(c.sum() > 0 for c in ref_counts), ref_counts
    for wrap in WRAPS:
        loss, grads, records, logged, counts = _step(state, wrap, **extra)
        what = f"{wrap} {extra}"
        assert torch.equal(loss, ref_loss), what
        assert grads.keys() == ref_grads.keys(), what
        for name, grad in ref_grads.items():
            if wrap == "torch-non-reentrant":  # the forward's own graph, its saved tensors refilled: bit for bit
                assert torch.equal(grads[name], grad), (what, name)
            else:  # the reentrant rerun's routing losses join at the MoE layer's output: float64 rounding apart
                torch.testing.assert_close(grads[name], grad, rtol=1e-12, atol=1e-15, msg=f"{what} {name}")
        assert records == ref_records and logged == ref_logged, (what, records)
        assert len(counts) == len(ref_counts) and all(torch.equal(a, b) for a, b in zip(counts, ref_counts)), what


@pytest.mark.parametrize("routing", ["softmax", "sigmoid-expert-bias"])
def test_hand_checkpointed_moe_gpt_equals_the_unwrapped_one(routing):
    """One rank: softmax routing with both losses and a shared expert; sigmoid routing with the expert bias."""
    _check_wrappings(ParallelState.single(), **(BIAS if routing != "softmax" else {}))


def _expert_parallel():
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), ep=2))
    try:
        _check_wrappings(state)
        _check_wrappings(state, moe_grouped_gemm=True, **BIAS)
    finally:
        state.destroy()


def test_hand_checkpointed_moe_gpt_equals_the_unwrapped_one_at_ep2():
    """Two gloo ranks, EP 2: the reruns' all-to-alls in backward; every wrapping, both routings."""
    run_on_ranks(2, _expert_parallel)


class _Checkpointed(torch.nn.Module):
    """A layer called through a checkpoint whole (its forward hooks inside), as ``checkpoint(layer, hidden)``."""

    def __init__(self, layer, checkpoint):
        super().__init__()
        self.layer, self.checkpoint = layer, checkpoint

    def forward(self, hidden, packed_seq_params=None):
        return self.checkpoint(self.layer, hidden, packed_seq_params)


def _pipeline_step(state, wrap, style, **extra):
    """PP 2, one layer per stage, run by hand (the stage's MoE layer gets its routing losses' gradient from the
    stage's scale, not from a loss term): (loss, gradients, tracker records, expert-bias counts) of this rank."""
    torch.manual_seed(21)
    cfg = moe_config(**{**KW, **extra})
    tracker = RNGStatesTracker()
    model = GPTModelChunks(cfg, state, rng_tracker=tracker).double()
    model_parallel_seed(5, state.tp.rank, tracker=tracker)
    model.set_aux_loss_gradient_scale(lambda: 1.0)
    chunk = model.chunks[0]
    for i, layer in enumerate(chunk.layers):
        if wrap is not None and style == "forward":
            layer.forward = functools.partial(_wrap, WRAPS[wrap], layer.forward)
        elif wrap is not None:
            chunk.layers[i] = _Checkpointed(layer, WRAPS[wrap])
    g = torch.Generator().manual_seed(100)
    tokens, labels = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g) for _ in range(2))
    loss = torch.zeros((), dtype=torch.float64)
    if state.pp.rank == 0:
        hidden = chunk(tokens)
        dist.send(hidden.detach(), 1)
        grad = torch.empty_like(hidden)
        dist.recv(grad, 1)
        hidden.backward(grad)
    else:
        hidden = torch.empty(cfg.seq_length, 2, cfg.hidden_size, dtype=torch.float64)
        dist.recv(hidden, 0)
        hidden.requires_grad_()
        loss = chunk(hidden, labels)
        loss.backward()
        dist.send(hidden.grad, 0)
    records = {key: count for key, (_, count) in model.moe_aux_loss_tracker._sums.items()}
    routers = [m for m in model.modules() if hasattr(m, "local_tokens_per_expert")]
    counts = [r.local_tokens_per_expert.clone() for r in routers if r.local_tokens_per_expert is not None]
    return loss.detach(), [p.grad.clone() for p in model.parameters()], records, counts


def _pipeline(extra):
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), pp=2))
    try:
        ref_loss, ref_grads, ref_records, ref_counts = _pipeline_step(state, None, None, **extra)
        assert ref_records and set(ref_records.values()) == {1}, ref_records
        for wrap in WRAPS:
            for style in ("forward", "module"):
                loss, grads, records, counts = _pipeline_step(state, wrap, style, **extra)
                what = f"{wrap} {style} {extra}"
                assert torch.equal(loss, ref_loss), what
                for grad, ref in zip(grads, ref_grads, strict=True):
                    torch.testing.assert_close(grad, ref, rtol=1e-12, atol=1e-15, msg=what)
                assert records == ref_records, (what, records)
                assert all(torch.equal(a, b) for a, b in zip(counts, ref_counts, strict=True)), what
    finally:
        state.destroy()


@pytest.mark.parametrize("routing", ["softmax", "sigmoid-expert-bias"])
def test_hand_checkpointed_pipeline_stages_equal_the_unwrapped_ones(routing):
    """Two gloo ranks, PP 2 (GPTModelChunks): each wrapping around the layer's forward and around the layer whole
    (its routing-loss hook inside the checkpoint)."""
    run_on_ranks(2, _pipeline, BIAS if routing != "softmax" else {})
