"""Partial capture control flow on CPU: the graph capture replaced by plain execution (``EagerCapturer``).

For dense and MoE layers and every scope: outputs and gradients of the
"replayed" layers equal the eager layers', the MoE layer skips route /
preprocess at replay (tensor store), the dispatcher's attrs are restored
and its host sync moves after the graph for moe_preprocess, and the forward
pre-hooks of captured submodules run by hand before each replay.
"""
import copy

import pytest
import torch

from moe_toy import ToyMoE
from ds_megatron.config import ConfigError, CudaGraphConfig
from ds_megatron.cuda_graphs.backends import EagerCapturer
from ds_megatron.cuda_graphs.capture import CudaGraphHelper, layer_is_graphable
from ds_megatron.cuda_graphs.partial_capture import (MoECudaGraphPartialCaptureSignal, MoECudaGraphTensorStore,
                                                     captured_region, is_graph_capturing)
from ds_megatron.models import GPTConfig
from ds_megatron.tensor_parallel import init_method_normal
from ds_megatron.transformer import ParallelTransformerLayer

H, S, B = 16, 6, 2


def _layers(n=2, moe=(), **moe_kwargs):
    torch.manual_seed(0)
    cfg = GPTConfig(num_layers=n, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, seq_length=S,
                    hidden_dropout=0.0, attention_dropout=0.0)
    init = init_method_normal(0.2)
    layers = torch.nn.ModuleList(ParallelTransformerLayer(cfg, tp_group=None, tp_size=1, init_method=init,
                                                          output_init_method=init) for _ in range(n))
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
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    grads = {n: p.grad.clone() for n, p in layers.named_parameters() if p.grad is not None}
    for p in layers.parameters():
        p.grad = None
    return out.detach(), x.grad.clone(), grads


def _compare(scope, moe=(), num_microbatches=1, **moe_kwargs):
    eager = _layers(moe=moe, **moe_kwargs)
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


@pytest.mark.parametrize("scope", [["attn", "moe_router"], ["moe_router"], ["attn", "moe_router", "moe_preprocess"],
                                   ["moe_router", "moe_preprocess"]])
@pytest.mark.parametrize("shared_expert", [False, True])
def test_moe_partial_replay_equals_eager_and_skips_captured_steps(scope, shared_expert):
    helper, graphed = _compare(scope, moe=(1,), shared_expert=shared_expert)
    moe = graphed[1].mlp
    runner = helper.runners[-1]
    assert runner.layer is graphed[1]
    before = dict(moe.calls)
    helper.set_current_microbatch(0)
    _step(graphed, 5)
    after = moe.calls
    # The eager capturer still computes the captured part once per replay (that is the graph's work) ...
    assert after["route"] - before["route"] == 1
    # ... but the replay path after it resumes at dispatch: rest runs once, preprocess only if not captured.
    assert after["rest"] - before["rest"] == 1
    captured_preprocess = "moe_preprocess" in scope
    assert after["preprocess"] - before["preprocess"] == 1
    assert moe.cudagraph_tensor_store.is_empty()  # cleared after each replay
    layout = runner.part.layout
    assert layout.return_step == ("preprocess" if captured_preprocess else "route")
    assert layout.has_shared_expert_output == shared_expert
    if captured_preprocess:
        # Filtered at capture: the missing nested attr is dropped, the tensors are kept.
        assert layout.attr_names == ("routing_map", "tokens_per_expert", "reversed_local_input_permutation_mapping")
        assert moe.token_dispatcher.cuda_sync_point == "before_ep_alltoall"
        assert moe.token_dispatcher.sync_points_seen[-1] == "before_ep_alltoall"
    else:
        assert layout.attr_names == ()
        assert moe.token_dispatcher.cuda_sync_point == "before_permutation_1"
    if scope == ["moe_router"] or scope == ["moe_router", "moe_preprocess"]:
        assert not runner.part.captures_attention and not layer_is_graphable(graphed[0], scope)
        assert len(helper.runners) == 1  # the dense layer has nothing in this scope


def test_moe_preprocess_with_residual_returned():
    _compare(["attn", "moe_router", "moe_preprocess"], moe=(0, 1), preprocess_returns_residual=True)


class _CountingRoute(torch.nn.Module):
    pass


def test_replay_skips_route_and_preprocess_when_graph_outputs_are_stored():
    """Replay path alone: a filled store makes route/preprocess return stored tensors without computing."""
    moe = ToyMoE(H)
    x = torch.randn(S * B, H)
    with captured_region(["moe_router", "moe_preprocess"]):
        assert is_graph_capturing()
        outputs = moe(x)
    assert not is_graph_capturing()
    assert isinstance(outputs, list) and moe.calls["rest"] == 0
    moe.calls.clear()
    moe.cudagraph_tensor_store.set("preprocess", False, hidden_states=outputs[0], probs=outputs[1], residual=x)
    hidden, probs = moe.preprocess(x, None, None)
    assert hidden is outputs[0] and probs is outputs[1]
    assert moe.route(x)[0] is outputs[1]
    assert moe.calls["route"] == moe.calls["preprocess"] == 0


def test_signal_outside_capture_is_never_raised():
    moe = ToyMoE(H)
    out = moe(torch.randn(S, B, H))
    assert isinstance(out, torch.Tensor) and moe.calls["rest"] == 1


def test_tensor_store_rejects_unknown_fields():
    store = MoECudaGraphTensorStore()
    assert store.is_empty()
    with pytest.raises(TypeError, match="unknown fields"):
        store.set("route", logits=torch.zeros(1))


def test_signal_carries_route_outputs():
    moe = ToyMoE(H)
    with captured_region(["moe_router"]):
        with pytest.raises(MoECudaGraphPartialCaptureSignal) as info:
            moe.route(torch.randn(S * B, H))
    assert info.value.return_step == "route" and set(info.value.kwargs) == {"probs", "routing_map"}


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
    """ToyMoE's attributes and steps without subclassing PartialCaptureMoE."""

    def __init__(self):
        super().__init__()
        toy = ToyMoE(H)
        self.cudagraph_tensor_store, self.token_dispatcher = toy.cudagraph_tensor_store, toy.token_dispatcher
        self.route, self.preprocess, self.shared_experts_compute = toy.route, toy.preprocess, toy.shared_experts_compute


def test_graphable_layers_and_moe_are_declared_not_guessed():
    """Graphability comes from an explicit base class, the same on every Python version.

    A structural ``runtime_checkable`` Protocol with an ``mlp`` data member matched every layer on
    Python 3.11 and none on 3.12 (``isinstance`` there looks attributes up statically and an
    ``nn.Module`` submodule lives in ``_modules``), so no scope captured anything on 3.12.
    """
    from ds_megatron.cuda_graphs.capture import is_moe_layer
    from ds_megatron.cuda_graphs.partial_capture import PartialCaptureMoE
    from ds_megatron.transformer import GraphableLayer
    for interface in (GraphableLayer, PartialCaptureMoE):
        assert not getattr(interface, "_is_protocol", False), f"{interface.__name__} must not be a Protocol"
    assert not layer_is_graphable(_LookAlikeLayer(), ["attn"])
    assert not layer_is_graphable(_LookAlikeLayer(), [])
    layers = _layers(n=2, moe=(1,))
    assert isinstance(layers[0], GraphableLayer) and layer_is_graphable(layers[0], ["attn"])
    assert layer_is_graphable(layers[1], ["moe_router"]) and not layer_is_graphable(layers[0], ["moe_router"])
    assert is_moe_layer(layers[1])
    layers[1].mlp = _LookAlikeMoE()
    assert not is_moe_layer(layers[1]) and not layer_is_graphable(layers[1], ["moe_router"])
