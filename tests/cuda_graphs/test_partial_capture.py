"""Partial capture control flow on CPU: the graph capture replaced by plain execution (``EagerCapturer``).

For dense and MoE layers and every scope: outputs and gradients of the
"replayed" layers equal the eager layers' (routing losses included), the MoE
layer's remaining steps run on the graph's outputs (route / preprocess are not
run again), the dispatcher's preprocess state is handed back and its host sync
moves after the graph for moe_preprocess, and the forward pre-hooks of
captured submodules run by hand before each replay.
"""
import copy

import pytest
import torch

from moe_toy import ToyMoE
from ds_megatron.config import ConfigError, CudaGraphConfig
from ds_megatron.cuda_graphs.backends import EagerCapturer
from ds_megatron.cuda_graphs.capture import CudaGraphHelper, layer_is_graphable
from ds_megatron.cuda_graphs.partial_capture import PREPROCESS, ROUTE, moe_front, moe_rest, prepare_moe_for_scope
from ds_megatron.models import GPTConfig
from ds_megatron.moe import BaseMoELayer
from ds_megatron.parallel_state import ParallelGroup
from ds_megatron.tensor_parallel import init_method_normal
from ds_megatron.transformer import ParallelMLP, ParallelTransformerLayer

H, S, B = 16, 6, 2


# Multi-latent attention (DeepSeek-V3's): query compression, the latent norms, decoupled RoPE with YaRN.
MLA = dict(multi_latent_attention=True, q_lora_rank=8, kv_lora_rank=6, qk_head_dim=4, qk_pos_emb_head_dim=2,
           v_head_dim=3, position_embedding_type="rope", normalization="RMSNorm", rope_scaling_type="yarn",
           rope_scaling_factor=4.0, original_max_position_embeddings=2, yarn_mscale=0.7, yarn_mscale_all_dim=1.0)


def _layers(n=2, moe=(), attention=None, **moe_kwargs):
    torch.manual_seed(0)
    cfg = GPTConfig(num_layers=n, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, seq_length=S,
                    hidden_dropout=0.0, attention_dropout=0.0, **(attention or {}))
    init = init_method_normal(0.2)
    tp = ParallelGroup.single("tp")
    layers = torch.nn.ModuleList(
        ParallelTransformerLayer(cfg, tp=tp, init_method=init, output_init_method=init,
                                 build_mlp=lambda: ParallelMLP(H, 32, tp=tp, init_method=init, output_init_method=init))
        for _ in range(n))
    for i in moe:
        layers[i].mlp = ToyMoE(H, **moe_kwargs)
    return layers


def _run(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _step(layers, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=g, requires_grad=True)
    out = _run(layers, x)
    routing_losses = sum(sum(layer.mlp.aux_losses.values(), 0.0) for layer in layers
                         if isinstance(layer.mlp, BaseMoELayer))
    ((out * torch.randn(out.shape, generator=g)).sum() + routing_losses).backward()
    grads = {n: p.grad.clone() for n, p in layers.named_parameters() if p.grad is not None}
    for p in layers.parameters():
        p.grad = None
    return out.detach(), x.grad.clone(), grads


def _compare(scope, moe=(), num_microbatches=1, attention=None, **moe_kwargs):
    eager = _layers(moe=moe, attention=attention, **moe_kwargs)
    graphed = copy.deepcopy(eager)
    helper = CudaGraphHelper(list(graphed), CudaGraphConfig(impl="transformer_engine", scope=scope), EagerCapturer(),
                             num_microbatches=num_microbatches)
    _step(graphed, 99)  # the eager warm-up step records input shapes
    helper.create_cudagraphs()
    assert helper.captured
    for mb in range(2 * num_microbatches):
        helper.set_current_microbatch(mb % num_microbatches)
        ref, got = _step(eager, mb), _step(graphed, mb)
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
        assert got[2].keys() == ref[2].keys()
        for name in ref[2]:
            torch.testing.assert_close(got[2][name], ref[2][name], rtol=1e-6, atol=1e-7, msg=name)
    return helper, graphed


@pytest.mark.parametrize("scope", [[], ["attn"]])
def test_dense_layers_replay_equals_eager(scope):
    helper, _ = _compare(scope, num_microbatches=2)
    assert len(helper.runners) == 2 and all(len(r.cuda_graphs) == 1 for r in helper.runners)  # no PP: one per layer


@pytest.mark.parametrize("scope", [[], ["attn"]])
def test_multi_latent_attention_layers_replay_equals_eager(scope):
    helper, graphed = _compare(scope, num_microbatches=2, attention=MLA)
    assert type(graphed[0].self_attention).__name__ == "MLASelfAttention"
    assert len(helper.runners) == 2 and all(len(r.cuda_graphs) == 1 for r in helper.runners)


@pytest.mark.parametrize("scope", [["attn", "moe_router"], ["moe_router"], ["attn", "moe_router", "moe_preprocess"],
                                   ["moe_router", "moe_preprocess"]])
@pytest.mark.parametrize("shared_expert", [False, True])
def test_moe_partial_replay_equals_eager_and_skips_captured_steps(scope, shared_expert):
    helper, graphed = _compare(scope, moe=(1,), shared_expert=shared_expert, z_loss=0.01)
    moe = graphed[1].mlp
    runner = helper.runners[-1]
    assert runner.layer is graphed[1]
    before = dict(moe.calls)
    helper.set_current_microbatch(0)
    _step(graphed, 5)
    after = moe.calls
    # The eager capturer still computes the captured part once per replay (that is the graph's work) ...
    assert after["route"] - before["route"] == 1
    # ... and the replay hands its routing losses back, then resumes: rest runs once, preprocess only if not captured.
    assert after["restore_route"] - before["restore_route"] == 1
    assert after["rest"] - before["rest"] == 1
    captured_preprocess = "moe_preprocess" in scope
    assert after["preprocess"] - before["preprocess"] == 1
    layout = runner.part.layout
    assert layout.return_step == ("preprocess" if captured_preprocess else "route")
    assert layout.has_shared_expert_output == shared_expert
    assert layout.loss_names == ("z_loss",)
    if captured_preprocess:
        assert layout.state_names == ("routing_map", "tokens_per_expert", "reversed_local_input_permutation_mapping")
        assert moe.token_dispatcher.cuda_sync_point == "before_ep_alltoall"
        assert moe.token_dispatcher.sync_points_seen[-1] == "before_ep_alltoall"
    else:
        assert layout.state_names == ()
        assert moe.token_dispatcher.cuda_sync_point == "before_permutation_1"
    if scope == ["moe_router"] or scope == ["moe_router", "moe_preprocess"]:
        assert not runner.part.captures_attention and not layer_is_graphable(graphed[0], scope)
        assert len(helper.runners) == 1  # the dense layer has nothing in this scope


@pytest.mark.parametrize("step", [ROUTE, PREPROCESS])
def test_front_then_rest_equals_the_layer_and_skips_the_front_steps(step):
    """The two halves on their own: ``moe_rest`` on ``moe_front``'s outputs gives the layer's output without
    computing the front again (route, and preprocess when it was in the front)."""
    torch.manual_seed(0)
    moe = ToyMoE(H, shared_expert=True, z_loss=0.1)
    prepare_moe_for_scope(moe, ["moe_router", "moe_preprocess"] if step == PREPROCESS else ["moe_router"])
    x = torch.randn(S, B, H)
    ref = moe(x)
    outputs, layout = moe_front(moe, x, step)
    assert layout.num_outputs == len(outputs) and layout.return_step == step
    moe.calls.clear()
    got = moe_rest(moe, outputs, layout)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert moe.calls["route"] == 0 and moe.calls["rest"] == 1
    assert moe.calls["preprocess"] == (0 if step == PREPROCESS else 1)
    assert set(moe.aux_losses) == {"z_loss"}  # handed back, as route would have set them


def test_the_moe_layer_alone_runs_its_steps_in_order():
    moe = ToyMoE(H)
    out = moe(torch.randn(S, B, H))
    assert isinstance(out, torch.Tensor) and out.shape == (S, B, H) and moe.calls["rest"] == 1


def test_a_layout_that_no_longer_fits_asks_for_recapture():
    moe = ToyMoE(H)
    outputs, layout = moe_front(moe, torch.randn(S * B, H), ROUTE)
    assert [t.shape for t in outputs[:3]] == [(S * B, H), (S * B, 4), (S * B, 4)]  # hidden, probs, routing map
    with pytest.raises(RuntimeError, match="recapture"):
        moe_rest(moe, outputs[:-1], layout)


def test_manual_hooks_run_before_each_replay_and_stay_out_of_capture():
    layers = _layers(n=1, moe=(0,))
    calls = []
    layers[0].self_attention.register_forward_pre_hook(lambda m, a: calls.append("attn"))
    layers[0].mlp.router.register_forward_pre_hook(lambda m, a: calls.append("router"))
    layers[0].mlp.experts[0].register_forward_pre_hook(lambda m, a: calls.append("expert"))
    helper = CudaGraphHelper(list(layers), CudaGraphConfig(impl="transformer_engine",
                                                           scope=["attn", "moe_router"]), EagerCapturer())
    _step(layers, 0)
    assert sorted(set(calls)) == ["attn", "expert", "router"]
    helper.create_cudagraphs()
    hooked = {type(args[0]).__name__ for _, args in helper.runners[0].cuda_graph_manual_hooks}
    assert hooked == {"ParallelAttention", "Linear"}  # attention and the router: what the graph stands in for
    # Hooks are back on their modules after capture (eager paths still need them).
    assert len(layers[0].self_attention._forward_pre_hooks) == 1
    calls.clear()
    helper.runners[0].cuda_graph_manual_hooks = [
        (lambda *a, h=h: (calls.append("manual"), h(*a)), args) for h, args in helper.runners[0].cuda_graph_manual_hooks]
    _step(layers, 1)
    # Manual hooks ran (2); the eager capturer also calls the modules (a real graph would not).
    assert calls.count("manual") == 2 and "expert" in calls


def test_shape_change_runs_eagerly_and_marks_stale():
    layers = _layers(n=1)
    helper = CudaGraphHelper(list(layers), CudaGraphConfig(impl="transformer_engine", scope=["attn"]), EagerCapturer())
    _step(layers, 0)
    helper.create_cudagraphs()
    out = layers[0](torch.randn(S + 1, B, H))
    assert out.shape == (S + 1, B, H) and helper.stale
    helper.reset()
    assert not helper.captured and not helper.stale
    helper.remove()
    assert "forward" not in layers[0].__dict__


def test_capture_before_any_eager_step_is_refused():
    layers = _layers(n=1)
    helper = CudaGraphHelper(list(layers), CudaGraphConfig(impl="transformer_engine"), EagerCapturer())
    with pytest.raises(RuntimeError, match="warmup_steps"):
        helper.create_cudagraphs()


def test_moe_scope_without_moe_layers_is_a_config_error():
    with pytest.raises(ConfigError, match="moe_router"):
        CudaGraphHelper(list(_layers(n=1)), CudaGraphConfig(impl="transformer_engine", scope=["attn", "moe_router"]),
                        EagerCapturer())


def test_dropout_under_the_rng_tracker_is_refused():
    layers = _layers(n=1)
    layers[0].self_attention.attention_dropout = 0.1
    layers[0].self_attention.rng_tracker = object()
    with pytest.raises(ConfigError, match="attention_dropout"):
        CudaGraphHelper(list(layers), CudaGraphConfig(impl="transformer_engine", scope=["attn"]), EagerCapturer())


def test_pipeline_plan_assigns_one_graph_per_microbatch():
    layers = _layers(n=4)
    helper = CudaGraphHelper(list(layers), CudaGraphConfig(impl="transformer_engine", scope=["attn"]), EagerCapturer(),
                             num_microbatches=8, num_layers_per_chunk=[2, 2], pipeline_parallel_size=4,
                             pipeline_parallel_rank=0)
    _step(layers, 0)
    helper.create_cudagraphs()
    assert [len(r.cuda_graphs) for r in helper.runners] == [8, 8, 8, 8]
    assert helper.plan.num_graphs == 2 * 4 * 8
    assert all(g is r.part for r in helper.runners for g in r.cuda_graphs)  # the eager capturer's "graphs"
    args = helper._sample_args()
    assert len(args) == 4 * 8 and len({id(a[0]) for a in args}) == helper.plan.num_static_input_buffers == 2 * 11


class _LookAlikeLayer(torch.nn.Module):
    """Has a layer's split methods (old and new spellings) and an ``mlp`` submodule, but declares nothing."""

    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Linear(H, H)

    def forward_attention(self, hidden):
        return hidden

    _forward_attention = forward_attention

    def pre_mlp(self, hidden):
        return hidden

    _pre_mlp = pre_mlp

    def post_mlp(self, hidden, mlp_output):
        return hidden + mlp_output

    _post_mlp = post_mlp


class _LookAlikeMoE(torch.nn.Module):
    """ToyMoE's attributes and steps without subclassing BaseMoELayer."""

    def __init__(self):
        super().__init__()
        toy = ToyMoE(H)
        self.token_dispatcher = toy.token_dispatcher
        for name in ("route", "restore_route", "preprocess", "dispatch", "routed_experts_compute", "combine",
                     "shared_experts_compute"):
            setattr(self, name, getattr(toy, name))


def test_graphable_layers_and_moe_are_declared_not_guessed():
    """Graphability comes from an explicit base class, the same on every Python version.

    A structural ``runtime_checkable`` Protocol with an ``mlp`` data member matched every layer on
    Python 3.11 and none on 3.12 (``isinstance`` there looks attributes up statically and an
    ``nn.Module`` submodule lives in ``_modules``), so no scope captured anything on 3.12.
    """
    from ds_megatron.cuda_graphs.capture import is_moe_layer
    from ds_megatron.transformer import GraphableLayer
    for interface in (GraphableLayer, BaseMoELayer):
        assert not getattr(interface, "_is_protocol", False), f"{interface.__name__} must not be a Protocol"
    assert not layer_is_graphable(_LookAlikeLayer(), ["attn"])
    assert not layer_is_graphable(_LookAlikeLayer(), [])
    layers = _layers(n=2, moe=(1,))
    assert isinstance(layers[0], GraphableLayer) and layer_is_graphable(layers[0], ["attn"])
    assert layer_is_graphable(layers[1], ["moe_router"]) and not layer_is_graphable(layers[0], ["moe_router"])
    assert is_moe_layer(layers[1])
    layers[1].mlp = _LookAlikeMoE()
    assert not is_moe_layer(layers[1]) and not layer_is_graphable(layers[1], ["moe_router"])
