"""The real ``MoELayer`` inside ``GPTModel`` under partial capture (graph capture replaced by plain execution).

For each scope, a model whose layers replay their captured part through
``EagerCapturer`` gives the same loss (routing aux loss included) and the
same gradients as the eager model; route / preprocess are skipped at replay
and the all-to-all dispatcher syncs split sizes after the graph boundary.
"""
import copy

import pytest
import torch

from ds_megatron.config import CudaGraphConfig
from ds_megatron.cuda_graphs.backends import EagerCapturer
from ds_megatron.cuda_graphs.capture import CudaGraphHelper
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.moe.moe_layer import MoELayer

CFG = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, seq_length=8, vocab_size=50,
           hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8, num_experts=4,
           moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, moe_grouped_gemm=False)


def _loss_and_grads(model, step):
    g = torch.Generator().manual_seed(step)
    tokens, labels = torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)
    loss = model(tokens, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("scope", [["attn", "moe_router"], ["attn", "moe_router", "moe_preprocess"],
                                   ["moe_router", "moe_preprocess"]])
@pytest.mark.parametrize("extra", [{}, {"moe_shared_expert_ffn_hidden_size": 16}])
def test_real_moe_layer_partial_replay_equals_eager(scope, extra):
    torch.manual_seed(0)
    eager = GPTModel(GPTConfig(**CFG, **extra))
    graphed = copy.deepcopy(eager)
    helper = CudaGraphHelper(list(graphed.layers), CudaGraphConfig(impl="transformer_engine", scope=scope),
                             EagerCapturer())
    _loss_and_grads(graphed, 100)
    helper.create_cudagraphs()
    moes = [layer.mlp for layer in graphed.layers if isinstance(layer.mlp, MoELayer)]
    assert moes and all(r.part.moe_step for r in helper.runners)
    routed = []
    for moe in moes:
        original = moe.router.forward
        moe.router.forward = lambda x, original=original: (routed.append(1), original(x))[1]
    for step in range(3):
        ref_loss, ref_grads = _loss_and_grads(eager, step)
        loss, grads = _loss_and_grads(graphed, step)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    # The eager capturer computes route once (the graph's work); replay never routes again.
    assert len(routed) == 3 * len(moes)
    for moe, runner in zip(moes, helper.runners):
        # The routing losses are graph outputs, handed back to the layer at replay (they reach the loss).
        assert runner.part.layout.loss_names == ("z_loss", "load_balancing_loss")
        if "moe_preprocess" in scope:
            assert moe.token_dispatcher.cuda_sync_point == "before_ep_alltoall"
            assert set(runner.part.layout.state_names) <= set(moe.token_dispatcher.PREPROCESS_STATE)
            assert "tokens_per_expert" in runner.part.layout.state_names
