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
