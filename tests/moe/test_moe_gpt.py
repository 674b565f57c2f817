"""A whole MoE GPT (routing losses on) with EP/ETP/folded layouts against the same model on one rank, float64."""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from moe_helpers import MOE, moe_config
from ds_megatron.models import GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState

KW = dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, moe_shared_expert_ffn_hidden_size=16, moe_layer_freq=1)


def _batch(replica):
    g = torch.Generator().manual_seed(100 + replica)
    tokens = torch.randint(0, MOE["vocab_size"], (2, MOE["seq_length"]), generator=g)
    labels = torch.randint(0, MOE["vocab_size"], (2, MOE["seq_length"]), generator=g)
    return tokens, labels


def _gpt_loss(tp, ep, etp, sp):
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, ep=ep, etp=etp))
    torch.manual_seed(21)
    model = GPTModel(moe_config(sequence_parallel=sp, **KW), state).double()
    torch.manual_seed(21)
    ref = GPTModel(moe_config(**KW)).double()
    tokens, labels = _batch(state.dp.rank)
    loss, ref_loss = model(tokens, labels), ref(tokens, labels)
    loss.backward()
    assert float(model.moe_aux_loss()) > 0
    assert torch.allclose(loss, ref_loss, rtol=1e-11), (float(loss), float(ref_loss))
    # The routing losses are whole-sequence values, identical on the TP ranks of a replica.
    def logged(m):  # the tracker keeps device tensors; the log reads them as floats
        return {k: float(v) for k, v in m.moe_aux_loss_tracker.averages().items()}
    assert logged(model) == pytest.approx(logged(ref), rel=1e-9)
    state.destroy()
    return float(loss)


@pytest.mark.parametrize("tp,ep,etp,sp", [(2, 4, 1, False), (2, 4, 1, True), (1, 2, 2, False), (2, 2, 2, True)])
def test_moe_gpt_loss_matches_single_rank(tp, ep, etp, sp):
    losses = run_on_ranks(4, _gpt_loss, tp, ep, etp, sp)
    dp = 4 // tp
    assert len(set(losses)) == dp  # one value per data-parallel replica, shared by its TP ranks


def _routing_loss_grads(tp, cp, sp, balancing):
    """One float64 forward/backward of a layout with CP; the gradients reduced as the buffers do (sequence-parallel
    ones summed over TP, all averaged over dp-cp) against the one-rank model's over the same samples."""
    from ds_megatron.utils.collectives import all_reduce
    kw = dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_router_load_balancing_type=balancing,
              moe_layer_freq=1)
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, cp=cp))
    torch.manual_seed(21)
    model = GPTModel(moe_config(sequence_parallel=sp, **kw), state).double()
    torch.manual_seed(21)
    ref = GPTModel(moe_config(**kw)).double()
    dp = state.dp.size
    tokens, labels = _batch(state.dp.rank)
    loss = model(tokens, labels)
    loss.backward()
    if balancing == "global_aux_loss":  # the one-rank model reads the global micro-batch at once
        batches = [_batch(r) for r in range(dp)]
        ref_loss = ref(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        ref_loss.backward()
        for mine, theirs in zip(model.layers, ref.layers):  # the z-loss stays per replica: compare the global one
            assert float(mine.mlp.aux_losses["load_balancing_loss"]) == pytest.approx(
                float(theirs.mlp.aux_losses["load_balancing_loss"]), rel=1e-11)
    else:
        losses = [ref(*_batch(r)) for r in range(dp)]
        sum(losses).div(dp).backward()
        ref_loss = losses[state.dp.rank]
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-11)  # the whole sequence's loss on every rank
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        if "router" not in name and "norm" not in name:
            continue
        g = p.grad.clone()
        if getattr(p, "sequence_parallel", False):
            all_reduce(g, state.tp)
        all_reduce(g, state.dp_cp)
        g /= state.dp_cp.size
        assert torch.allclose(g, ref_params[name].grad, rtol=1e-9, atol=1e-13), name
        checked += "router" in name
    assert checked == MOE["num_layers"]
    state.destroy()


@pytest.mark.parametrize("tp,cp,sp,balancing", [(1, 2, False, "aux_loss"), (2, 2, True, "seq_aux_loss"),
                                                (1, 2, False, "global_aux_loss"), (2, 2, True, "aux_loss")])
def test_routing_losses_with_context_parallelism_match_single_rank(tp, cp, sp, balancing):
    run_on_ranks(4, _routing_loss_grads, tp, cp, sp, balancing)
