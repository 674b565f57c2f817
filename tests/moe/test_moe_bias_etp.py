"""Biased experts (gpt-oss: ``moe_add_bias_linear``) under EP x ETP against the same layer on one rank, float64.

The single-rank layer's biases are random; each rank's layer gets its slices of them (fc1's bias with fc1's rows,
gate and up halves each split; fc2's bias over its hidden columns).  Outputs, input gradients and every expert
gradient, the biases' included (summed over expert data parallel), must match the single-rank layer's; ``plan``'s
count of each rank's expert parameters is what the rank holds.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from moe_helpers import expert_grads, moe_config
from ds_megatron.moe import MoELayer
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.planning.param_counts import layer_counts
from ds_megatron.tensor_parallel import grad_of

S, B, H = 8, 2, 16
GPT_OSS = dict(gated_linear_unit=True, activation="quick_gelu", activation_func_clamp_value=0.7,
               glu_linear_offset=1.0, moe_add_bias_linear=True, moe_router_pre_softmax=False)


def _biases(experts):
    """{(global expert, "fc1_bias" / "fc2_bias"): bias} of the local experts (views of the params)."""
    out = {}
    for local, e in enumerate(experts.local_expert_indices):
        weights = experts.expert_weights(local)
        out[(e, "fc1_bias")], out[(e, "fc2_bias")] = weights["linear_fc1.bias"], weights["linear_fc2.bias"]
    return out


def _bias_grads(experts):
    if hasattr(experts, "bias1"):
        return {(e, name): grad_of(experts.bias1 if name == "fc1_bias" else experts.bias2)[local]
                for local, e in enumerate(experts.local_expert_indices) for name in ("fc1_bias", "fc2_bias")}
    return {(e, name): grad_of(getattr(experts.local_experts[local], name.replace("_bias", "")
                                       .replace("fc", "linear_fc")).bias)
            for local, e in enumerate(experts.local_expert_indices) for name in ("fc1_bias", "fc2_bias")}


def _fc1_rows(full, f, rank):
    """This ETP rank's rows of a gated fc1 tensor (``[gate; up]``, each half split)."""
    return torch.cat([half[rank * f:(rank + 1) * f] for half in full.chunk(2)])


def _run(layer, x, w):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y * w).sum().backward()
    return y.detach(), x.grad


def _compare(tp, ep, etp, sp, dispatcher, grouped):
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, ep=ep, etp=etp))
    cfg = moe_config(sequence_parallel=sp, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped, **GPT_OSS)
    torch.manual_seed(5)
    layer = MoELayer(cfg, parallel_state=state).double()
    torch.manual_seed(5)
    ref = MoELayer(moe_config(moe_grouped_gemm=not grouped, **GPT_OSS)).double()  # the other implementation

    # plan's count of the rank's expert parameters, biases included, is what the layer holds
    assert layer_counts(cfg, 0, tp, ep, etp).expert == sum(p.numel() for p in layer.experts.parameters())
    f, hp = cfg.moe_ffn_hidden_size // etp, H // etp
    r = state.etp.rank
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        ref.router.bias.copy_(torch.randn(ref.router.bias.shape, generator=g, dtype=torch.float64))
        layer.router.bias.copy_(ref.router.bias)
        ref_biases, biases = _biases(ref.experts), _biases(layer.experts)
        for key in sorted(ref_biases):
            ref_biases[key].copy_(torch.randn(ref_biases[key].shape, generator=g, dtype=torch.float64))
        for (e, name), bias in biases.items():
            full = ref_biases[(e, name)]
            bias.copy_(_fc1_rows(full, f, r) if name == "fc1_bias" else full[r * hp:(r + 1) * hp])

    x = torch.randn(S, B * state.dp.size, H, generator=g, dtype=torch.float64)
    w = torch.randn(S, B * state.dp.size, H, generator=g, dtype=torch.float64)
    d, t = state.dp.rank, state.tp.rank
    seq = slice(t * S // tp, (t + 1) * S // tp) if sp else slice(0, S)
    y, dx = _run(layer, x[seq, d * B:(d + 1) * B], w[seq, d * B:(d + 1) * B])
    for rep in range(state.dp.size):
        ry, rdx = _run(ref, x[:, rep * B:(rep + 1) * B], w[:, rep * B:(rep + 1) * B])
        if rep == d:
            want_y, want_dx = ry, rdx
    assert torch.allclose(y, want_y[seq], rtol=1e-10, atol=1e-12), "outputs differ"
    assert torch.allclose(dx, want_dx[seq], rtol=1e-10, atol=1e-12), "input gradients differ"

    router_grad = layer.router.bias.grad.clone()
    if sp:
        dist.all_reduce(router_grad, group=state.tp.group)
    dist.all_reduce(router_grad, group=state.dp.group)
    assert torch.allclose(router_grad, ref.router.bias.grad, rtol=1e-9, atol=1e-12), "router bias gradient differs"

    grads = {**expert_grads(layer.experts), **_bias_grads(layer.experts)}
    ref_grads = {**expert_grads(ref.experts), **_bias_grads(ref.experts)}
    assert len(grads) == 4 * len(layer.experts.local_expert_indices)
    live = 0.0
    for (e, name), grad in grads.items():
        grad = grad.clone()
        dist.all_reduce(grad, group=state.edp.group)
        full = ref_grads[(e, name)]
        expected = {"fc1": lambda: _fc1_rows(full, f, r), "fc2": lambda: full[:, r * f:(r + 1) * f],
                    "fc1_bias": lambda: _fc1_rows(full, f, r), "fc2_bias": lambda: full[r * hp:(r + 1) * hp]}[name]()
        assert torch.allclose(grad, expected, rtol=1e-9, atol=1e-12), f"expert {e} {name} gradient differs"
        live = max(live, float(expected.abs().max())) if name == "fc2_bias" else live
    assert live > 1e-3  # the fc2 bias terms are live: some expert's gradient is not zero
    state.destroy()


@pytest.mark.parametrize("tp,ep,etp,sp,dispatcher,grouped", [
    (1, 2, 2, False, "alltoall", True),     # EP=2 x ETP=2, grouped experts
    (2, 2, 2, True, "allgather", False),    # ETP = TP, sequence parallel, sequential experts
])
def test_biased_experts_under_etp_match_single_rank(tp, ep, etp, sp, dispatcher, grouped):
    run_on_ranks(4, _compare, tp, ep, etp, sp, dispatcher, grouped)


def test_hidden_size_that_etp_does_not_divide_is_refused_in_one_line():
    from ds_megatron.config import ConfigError
    moe_config(hidden_size=20, **GPT_OSS).check_expert_parallel(1, 4)  # 20 columns: 5 a rank
    with pytest.raises(ConfigError, match=r"^model.hidden_size=20 is not divisible by "
                                          r"megatron.expert_tensor_parallel_size=8, which splits the experts' fc2 "):
        moe_config(hidden_size=20, **GPT_OSS).check_expert_parallel(1, 8)
