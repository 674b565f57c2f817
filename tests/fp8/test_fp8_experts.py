"""The MoE experts' grouped GEMMs in fp8 against a float64 emulation written here, per expert: one scaling state per
expert weight, each expert's input and output gradient scaled over its own tokens (Transformer Engine's
GroupedLinear), blockwise tiles over the real tokens only.  Uneven groups (0, 1, 17, 40, 130 tokens) exercise the
zero-row padding to 16 (128 for blockwise), which must reach the GEMMs as zeros and be dropped after.  At EP 2 and
at ETP 2 the MoE layer equals the one-rank layer given the same tokens."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from moe_helpers import expert_grads, moe_config
from test_fp8_linear import MAX, assert_matches, fp8_dtype, ref_gemm, ref_quantize

from ds_megatron.fp8 import FP8LinearState, FP8Recipe, delayed_scaling_groups, update_delayed_scaling
from ds_megatron.fp8 import grouped
from ds_megatron.fp8.recipe import ROLES
from ds_megatron.moe import MoELayer
from ds_megatron.moe.experts import GroupedMLP, SequentialMLP
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelGroup, ParallelState
from ds_megatron.tensor_parallel import grad_of
from ds_megatron.tensor_parallel.layers import attach_fp8, fp8_states

K, N = 128, 256  # in and out features: multiples of 128 (blockwise)
COUNTS = [0, 1, 17, 40, 130]
CASES = list(itertools.product(("tensorwise", "delayed", "blockwise"), ("e4m3", "hybrid")))
ONE = ParallelGroup.single("etp")


def data(seed: int, scale: float = 1.0):
    """x, weight [L, N, K], dy: each expert's tokens and weight on a scale of its own, so a scale shared by the
    experts would quantize the small ones differently."""
    g = torch.Generator().manual_seed(seed)
    per_row = torch.cat([torch.full((c,), 2.0 ** e) for e, c in enumerate(COUNTS)]).unsqueeze(1)
    x = torch.randn(sum(COUNTS), K, generator=g) * per_row * scale
    w = torch.randn(len(COUNTS), N, K, generator=g) * 0.05 * (2.0 ** -torch.arange(len(COUNTS))).view(-1, 1, 1)
    dy = torch.randn(sum(COUNTS), N, generator=g) * 1e-3 / per_row * scale
    return x, w, dy


def ref_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blockwise 1x128 tiles along ``t``'s rows of any length: the last tile holds what is left (its amax over
    those elements only)."""
    pad = -t.size(1) % 128
    return ref_quantize(torch.nn.functional.pad(t, (0, pad)), dtype, tile=(1, 128))[:, :t.size(1)]


def reference(x, w, dy, recipe: str, fmt: str, scales):
    """Per expert (y, dx, dw), each with its fp32 bound; ``scales[e]`` per role for the delayed recipe."""
    e4, eg = fp8_dtype(fmt, "input"), fp8_dtype(fmt, "grad_output")
    out = []
    for e, (xe, dye) in enumerate(zip(torch.split(x.double(), COUNTS), torch.split(dy.double(), COUNTS))):
        we = w[e].double()
        if recipe == "blockwise":
            qx, qdy, qw = ref_rows(xe, e4), ref_rows(dye, eg), ref_quantize(we, e4, tile=(128, 128))
            qxt, qdyt = ref_rows(xe.t(), e4), ref_rows(dye.t(), eg)
        else:
            s = scales[e] if recipe == "delayed" else {}
            qx, qw, qdy = (ref_quantize(t, d, s.get(r)) if t.numel() else t for t, d, r in
                           ((xe, e4, "input"), (we, e4, "weight"), (dye, eg, "grad_output")))
            qxt, qdyt = qx.t(), qdy.t()
        out.append((ref_gemm(qx, qw), ref_gemm(qdy, qw.t()), ref_gemm(qdyt, qxt)))
    return out


def run(states, x, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped.fp8_grouped_linear(x, w, COUNTS, states)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe,fmt", CASES)
def test_grouped_fp8_gemms_equal_float64_emulation_per_expert(recipe, fmt):
    fp8 = FP8Recipe(fmt, recipe)
    states = [FP8LinearState(fp8, ONE, K, N) for _ in COUNTS]
    history = []  # the delayed recipe's amaxes of earlier steps, per expert and role
    for step in range(2 if recipe == "delayed" else 1):
        x, w, dy = data(step, scale=(1.0, 4.0)[step])
        scales = None
        if recipe == "delayed":
            scales = [{r: (torch.tensor(MAX[fp8_dtype(fmt, r)]) / history[-1][e][r] if history and
                           history[-1][e][r] > 0 else torch.tensor(1.0)).float() for r in ("input", "weight",
                                                                                           "grad_output")}
                      for e in range(len(COUNTS))]
            assert all(torch.equal(s.scale[r], scales[e][r]) for e, s in enumerate(states) for r in scales[e])
            history.append([{"input": xe.abs().max() if xe.numel() else 0.0, "weight": w[e].abs().max(),
                             "grad_output": dye.abs().max() if dye.numel() else 0.0}
                            for e, (xe, dye) in enumerate(zip(torch.split(x, COUNTS), torch.split(dy, COUNTS)))])
        y, dx, dw = run(states, x, w, dy)
        refs = reference(x, w, dy, recipe, fmt, scales)
        for e, (ys, dxs, (ry, rdx, rdw)) in enumerate(zip(torch.split(y, COUNTS), torch.split(dx, COUNTS), refs)):
            assert_matches(ys, ry, f"expert {e} output")
            assert_matches(dxs, rdx, f"expert {e} input gradient")
            assert_matches(dw[e], rdw, f"expert {e} weight gradient")
        if step == 0:  # fp8 engaged: far from the 16-bit GEMMs
            xb, wb, dyb = x.bfloat16().double(), w.bfloat16().double(), dy.bfloat16().double()
            parts = [(xe @ wb[e].t(), dye @ wb[e], dye.t() @ xe) for e, (xe, dye) in
                     enumerate(zip(torch.split(xb, COUNTS), torch.split(dyb, COUNTS)))]
            for e in (2, 3, 4):
                for got, base in zip((torch.split(y, COUNTS)[e], torch.split(dx, COUNTS)[e], dw[e]), parts[e]):
                    rel = ((got.double() - base).norm() / base.norm()).item()
                    assert rel > 1e-2, f"expert {e}: fp8 within {rel:.1e} of bf16 (fp8 off?)"
        update_delayed_scaling(states, {"dense": [ONE]})


@pytest.mark.parametrize("recipe", ("tensorwise", "blockwise"))
def test_padding_rows_reach_the_gemms_as_zeros_and_are_dropped(recipe, monkeypatch):
    """Every GEMM sees each expert's tokens padded to the alignment (16; 128 blockwise), the padded rows of x and
    dy zero; the output has the real rows only."""
    align = 128 if recipe == "blockwise" else 16
    padded = [-(-c // align) * align for c in COUNTS]
    calls = []

    def spy(a, a_scale_inv, b, b_scale_inv, out_dtype):
        calls.append((a, b))
        return real(a, a_scale_inv, b, b_scale_inv, out_dtype)
    real = grouped.scaled_gemm
    monkeypatch.setattr(grouped, "scaled_gemm", spy)
    x, w, dy = data(0)
    y, _, _ = run([FP8LinearState(FP8Recipe("e4m3", recipe), ONE, K, N) for _ in COUNTS], x, w, dy)
    assert y.shape == (sum(COUNTS), N)
    experts = [e for e, c in enumerate(COUNTS) if c]
    forward, backward = calls[:len(experts)], calls[len(experts):]
    assert len(backward) == 2 * len(experts)
    for e, (a, _) in zip(experts, forward):  # x [padded tokens, K]
        assert a.size(0) == padded[e] and not a[COUNTS[e]:].float().any(), f"expert {e}: x's padding"
    # every expert's data-gradient GEMM, then every expert's weight-gradient GEMM (the W pass ZB-H1 may defer)
    for e, (dgrad, wgrad) in zip(experts, zip(backward[:len(experts)], backward[len(experts):])):
        assert dgrad[0].size(0) == padded[e] and not dgrad[0][COUNTS[e]:].float().any(), f"expert {e}: dy's padding"
        for t in wgrad:  # dy^T and x^T [features, padded tokens]: the tokens are the reduction dimension
            assert t.size(1) == padded[e] and not t[:, COUNTS[e]:].float().any(), f"expert {e}: wgrad padding"


@pytest.mark.parametrize("cls", (GroupedMLP, SequentialMLP))
def test_experts_run_fc1_and_fc2_through_their_own_states(cls):
    """Both expert classes: one state per expert and projection (in ``fp8_states``), fc1 then the activation and
    the routing weight then fc2, each a grouped fp8 GEMM; far from the 16-bit experts."""
    torch.manual_seed(3)
    experts = cls(len(COUNTS), K, N, ep=ParallelGroup.single("ep"), etp=ONE)
    x, _, _ = data(1)
    probs = torch.rand(x.size(0), generator=torch.Generator().manual_seed(2))
    w = {k: torch.stack([experts.expert_weights(e)[f"linear_{k}.weight"] for e in range(len(COUNTS))]).detach()
         for k in ("fc1", "fc2")}

    def forward_backward():
        xi = x.clone().requires_grad_()
        y = experts(xi, COUNTS, probs)
        y.square().sum().backward()
        return y.detach(), xi.grad, expert_grads(experts)
    base = forward_backward()
    experts.zero_grad()
    fp8 = FP8Recipe("hybrid", "tensorwise")
    assert attach_fp8(experts, fp8) == 1
    states = fp8_states(experts)
    assert len(states) == 2 * len(COUNTS) and len({id(s) for s in states}) == len(states)
    got = forward_backward()

    ref_states = [FP8LinearState(fp8, ONE, K, N) for _ in COUNTS], [FP8LinearState(fp8, ONE, N, K) for _ in COUNTS]
    xi, w1, w2 = x.clone().requires_grad_(), w["fc1"].clone().requires_grad_(), w["fc2"].clone().requires_grad_()
    hidden = experts.activation_func(grouped.fp8_grouped_linear(xi, w1, COUNTS, ref_states[0])) * probs[:, None]
    y = grouped.fp8_grouped_linear(hidden, w2, COUNTS, ref_states[1])
    y.square().sum().backward()
    assert torch.equal(got[0], y.detach()) and torch.equal(got[1], xi.grad)
    for e in range(len(COUNTS)):
        assert torch.equal(got[2][(e, "fc1")], w1.grad[e]) and torch.equal(got[2][(e, "fc2")], w2.grad[e]), e
    rel = ((got[0] - base[0]).norm() / base[0].norm()).item()
    assert rel > 1e-2, f"fp8 experts within {rel:.1e} of the 16-bit ones"


def _bias_grad(experts, local: int, name: str) -> torch.Tensor:
    """Local expert ``local``'s ``name`` ("fc1", "fc2") bias gradient, either experts class."""
    if isinstance(experts, GroupedMLP):
        return grad_of(experts.bias1 if name == "fc1" else experts.bias2)[local]
    return grad_of(getattr(experts.local_experts[local], f"linear_{name}").bias)


def _moe_ranks_equal_one_rank(ep: int, etp: int, grouped_gemm: bool, bias: bool = False):
    """MoELayer (tensorwise hybrid) at EP x ETP over 2 ranks (each rank its own micro-batch) against the one-rank
    layer on both micro-batches at once: every expert then sees the same tokens.  ``bias``: random expert biases
    (gpt-oss), each rank given its ETP slices (fc1's rows, fc2's hidden columns), their gradients compared too."""
    S, B = 8, 2
    world = dist.get_world_size()
    state = ParallelState.build(ParallelLayout(world_size=world, ep=ep, etp=etp))
    cfg = moe_config(moe_grouped_gemm=grouped_gemm, hidden_size=32, moe_ffn_hidden_size=64, moe_aux_loss_coeff=0.0,
                     moe_add_bias_linear=bias)
    fp8 = FP8Recipe("hybrid", "tensorwise")
    torch.manual_seed(5)
    layer = MoELayer(cfg, parallel_state=state)
    torch.manual_seed(5)
    ref = MoELayer(cfg)
    attach_fp8(layer, fp8)
    attach_fp8(ref, fp8)
    g = torch.Generator().manual_seed(11)
    f, hp, r = cfg.moe_ffn_hidden_size // etp, 32 // etp, state.etp.rank
    with torch.no_grad():
        for e in range(cfg.num_experts):
            for name in ("linear_fc1.bias", "linear_fc2.bias") if bias else ():
                full = ref.experts.expert_weights(e)[name]
                full.copy_(torch.randn(full.shape, generator=g))
                if e in layer.experts.local_expert_indices:
                    mine = layer.experts.expert_weights(layer.experts.local_expert_indices.index(e))[name]
                    mine.copy_(full[r * f:(r + 1) * f] if "fc1" in name else full[r * hp:(r + 1) * hp])
    x, w = torch.randn(world * S, B, 32, generator=g), torch.randn(world * S, B, 32, generator=g)
    mine = slice(dist.get_rank() * S, (dist.get_rank() + 1) * S)  # micro-batches stacked along the sequence

    def run_layer(m, xs, ws):
        xs = xs.clone().requires_grad_()
        (m(xs) * ws).sum().backward()
        return xs.grad
    dx, rdx = run_layer(layer, x[mine], w[mine]), run_layer(ref, x, w)
    assert torch.allclose(dx, rdx[mine], rtol=1e-5, atol=1e-6 * rdx.abs().max()), "input gradients differ"
    f = cfg.moe_ffn_hidden_size // etp
    cols = slice(state.etp.rank * f, (state.etp.rank + 1) * f)
    ref_grads = expert_grads(ref.experts)
    for (e, name), grad in expert_grads(layer.experts).items():
        expected = ref_grads[(e, name)][cols] if name == "fc1" else ref_grads[(e, name)][:, cols]
        assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-6 * expected.abs().max()), (e, name)
    for local, e in enumerate(layer.experts.local_expert_indices):
        for name in ("fc1", "fc2") if bias else ():
            grad, whole = _bias_grad(layer.experts, local, name), _bias_grad(ref.experts, e, name)
            expected = whole[r * f:(r + 1) * f] if name == "fc1" else whole[r * hp:(r + 1) * hp]
            assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-6 * whole.abs().max()), (e, name, "bias")
    state.destroy()


def _ep2_and_etp2():
    _moe_ranks_equal_one_rank(2, 1, True)
    _moe_ranks_equal_one_rank(1, 2, False)
    _moe_ranks_equal_one_rank(1, 2, True, bias=True)  # gpt-oss's expert biases split over ETP, fp8 GEMMs


def test_expert_and_expert_tensor_parallel_equal_one_rank():
    run_on_ranks(2, _ep2_and_etp2)


def _delayed_scales_agree_over_the_expert_holders(ep: int, etp: int):
    """MoELayer (SequentialMLP, delayed hybrid, history 2 "max") at EP x ETP over 2 ranks, each rank its own tokens,
    2 steps with an evaluation forward under no_grad between them.  Hooks on each expert's fc1 / fc2 take the amax
    of every training pass's input, weight and output gradient; each rank's recorded step amaxes must be those, and
    after the step's update every expert state's scale must be fp8_max / (the history's max of the MAX over every
    rank holding that global expert: its ETP and expert-DP ranks, never EP's, which hold other experts)."""
    world, me = dist.get_world_size(), dist.get_rank()
    state = ParallelState.build(ParallelLayout(world_size=world, ep=ep, etp=etp))
    cfg = moe_config(moe_grouped_gemm=False, hidden_size=32, moe_ffn_hidden_size=64, moe_aux_loss_coeff=0.0)
    fp8 = FP8Recipe("hybrid", "delayed", amax_history_len=2, amax_compute_algo="max")
    torch.manual_seed(5)
    layer = MoELayer(cfg, parallel_state=state)
    attach_fp8(layer, fp8)
    experts = layer.experts
    seen = {}  # (global expert, projection) -> {role: this step's amax over the training passes, from the hooks}

    def fold(key, role, t):
        amax = t.detach().abs().amax().float() if t.numel() else torch.zeros(())
        roles = seen.setdefault(key, {})
        roles[role] = torch.maximum(roles.get(role, torch.zeros(())), amax)

    def hook(key):
        def forward(module, inputs, out):
            if torch.is_grad_enabled():  # an evaluation forward records nothing
                fold(key, "input", inputs[0])
                fold(key, "weight", module.weight)
                out.register_hook(lambda g: fold(key, "grad_output", g))
        return forward
    by_key = {}
    for local, e in enumerate(experts.local_expert_indices):
        for proj, st in experts.expert_fp8_states(local).items():
            getattr(experts.local_experts[local], proj).register_forward_hook(hook((e, proj)))
            by_key[(e, proj)] = st
    history = {}
    g = torch.Generator().manual_seed(21 + me)
    for step in range(2):
        seen.clear()
        x = (torch.randn(8, 2, 32, generator=g) * (1 + me + 3 * step)).requires_grad_()
        (layer(x) * torch.randn(8, 2, 32, generator=g)).sum().backward()
        with torch.no_grad():
            layer(x * 100)  # would dominate every amax if it were recorded
        for key, st in by_key.items():
            for r in ROLES:
                assert torch.equal(st.step_amax[r], seen[key][r]), (step, key, r, "recorded amax")
        everyone = [None] * world
        dist.all_gather_object(everyone, {k: {r: float(v) for r, v in roles.items()} for k, roles in seen.items()})
        update_delayed_scaling(fp8_states(layer), delayed_scaling_groups(state))
        agreed = {}
        for d in everyone:  # the MAX over the ranks holding the same global expert
            for key, roles in d.items():
                agreed[key] = {r: max(v, agreed.get(key, {}).get(r, 0.0)) for r, v in roles.items()}
        for key, st in by_key.items():
            for r in ROLES:
                history[(key, r)] = [agreed[key][r]] + history.get((key, r), [])[:1]
                want = torch.tensor(fp8.fp8_max(r)) / torch.tensor(max(history[(key, r)]))
                assert torch.equal(st.scale[r], want), (ep, etp, step, key, r, float(st.scale[r]), float(want))
        scales = [None] * world
        dist.all_gather_object(scales, {k: [float(st.scale[r]) for r in ROLES] for k, st in by_key.items()})
        for d in scales:  # identical on every rank holding the expert
            assert all(d[k] == [float(by_key[k].scale[r]) for r in ROLES] for k in d if k in by_key)
    state.destroy()


def _delayed_layouts():
    for ep, etp in ((2, 1), (1, 1), (1, 2)):  # experts split over EP; over expert-DP; over ETP
        _delayed_scales_agree_over_the_expert_holders(ep, etp)


def test_delayed_expert_scales_agree_over_etp_and_expert_dp_never_ep():
    run_on_ranks(2, _delayed_layouts, timeout=120)


@pytest.mark.parametrize("recipe", ("delayed", "blockwise"))
@pytest.mark.parametrize("cls", (GroupedMLP, SequentialMLP))
def test_deferred_expert_weight_gradients_equal_the_immediate_ones_bit_for_bit(cls, recipe):
    """ZB-H1's W for fp8 experts: given a WeightGradStore that defers, backward leaves the expert weights without
    gradients and the W pass (``run``) then gives exactly the gradients of the undeferred backward (from the fp8
    copies B made); the input gradient is the same either way."""
    from ds_megatron.tensor_parallel.layers import attach_weight_grad_store
    from ds_megatron.tensor_parallel.weight_grad_store import WeightGradStore
    torch.manual_seed(3)
    experts = cls(len(COUNTS), K, N, ep=ParallelGroup.single("ep"), etp=ONE)
    attach_fp8(experts, FP8Recipe("hybrid", recipe))
    for st in fp8_states(experts) if recipe == "delayed" else ():  # scales of an earlier step, not 1
        st.scale = {r: torch.tensor(2.0 ** (3 + i)) for i, r in enumerate(ROLES)}
    x, _, _ = data(1)
    probs = torch.rand(x.size(0), generator=torch.Generator().manual_seed(2))
    dy = torch.randn(x.size(0), K, generator=torch.Generator().manual_seed(4))
    params = [p for p in experts.parameters()]

    def backward(xi):
        experts(xi, COUNTS, probs).backward(dy)
    xi = x.clone().requires_grad_()
    backward(xi)
    want = [p.grad.clone() for p in params], xi.grad
    experts.zero_grad(set_to_none=True)
    store = WeightGradStore()
    assert attach_weight_grad_store(experts, store) > 0
    xi = x.clone().requires_grad_()
    with store.deferring("mb0"):
        backward(xi)
    assert all(p.grad is None for p in params) and store.pending == ["mb0"]
    assert torch.equal(xi.grad, want[1])
    store.run("mb0")
    for p, w in zip(params, want[0]):
        assert torch.equal(p.grad, w)


@pytest.mark.parametrize("cls", (GroupedMLP, SequentialMLP))
def test_biased_experts_add_their_16_bit_biases_after_the_fp8_gemms(cls):
    """gpt-oss's biased experts in bf16 with fp8 GEMMs: fc1's bias added to the fp8 GEMM's bf16 output, fc2's scaled
    by the routing weight, both bf16 (the fp8 GEMMs, tested above against float64, given the same inputs give the
    same outputs and weight and input gradients bit for bit); the biases' gradients are float64 sums of the
    gradients reaching each expert's GEMM outputs (fc2's weighted by the routing weight)."""
    torch.manual_seed(3)
    experts = cls(len(COUNTS), K, N, ep=ParallelGroup.single("ep"), etp=ONE, bias=True).to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for e in range(len(COUNTS)):
            for name, bias in experts.expert_weights(e).items():
                if name.endswith(".bias"):
                    bias.copy_(torch.randn(bias.shape, generator=g))
    x = data(1)[0].bfloat16()
    probs = torch.rand(x.size(0), generator=g).bfloat16()
    fp8 = FP8Recipe("hybrid", "tensorwise")
    attach_fp8(experts, fp8)
    assert all(b.dtype == torch.bfloat16 for n, b in experts.named_parameters() if "bias" in n)
    xi = x.clone().requires_grad_()
    y = experts(xi, COUNTS, probs)
    y.float().square().sum().backward()

    weights = [experts.expert_weights(e) for e in range(len(COUNTS))]
    w1, w2 = (torch.stack([w[f"linear_{k}.weight"] for w in weights]).detach().requires_grad_() for k in ("fc1", "fc2"))
    b1, b2 = (torch.stack([w[f"linear_{k}.bias"] for w in weights]).detach() for k in ("fc1", "fc2"))
    rows = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))
    rx = x.clone().requires_grad_()
    fc1 = grouped.fp8_grouped_linear(rx, w1, COUNTS, [FP8LinearState(fp8, ONE, K, N) for _ in COUNTS]) + b1[rows]
    fc2 = grouped.fp8_grouped_linear(experts.activation_func(fc1) * probs[:, None], w2, COUNTS,
                                     [FP8LinearState(fp8, ONE, N, K) for _ in COUNTS])
    fc1.retain_grad()
    fc2.retain_grad()
    ry = fc2 + probs[:, None] * b2[rows]
    ry.float().square().sum().backward()
    assert torch.equal(y, ry.detach()) and torch.equal(xi.grad, rx.grad)
    got = expert_grads(experts)
    for e in range(len(COUNTS)):
        assert torch.equal(got[(e, "fc1")], w1.grad[e]) and torch.equal(got[(e, "fc2")], w2.grad[e]), e
    for e, (d1, d2, p) in enumerate(zip(*(torch.split(t.double(), COUNTS) for t in (fc1.grad, fc2.grad, probs)))):
        for name, terms in (("fc1", d1), ("fc2", p[:, None] * d2)):
            # a sum of n bf16 terms accumulated in bf16 is within (n + 1) u sum |terms| (u = 2^-8) of the exact sum
            bound = (COUNTS[e] + 1) * 2.0 ** -8 * terms.abs().sum(0)
            grad = _bias_grad(experts, e, name)
            assert grad.dtype == torch.bfloat16 and bool(((grad.double() - terms.sum(0)).abs() <= bound).all()), \
                (e, name)
    assert _bias_grad(experts, 4, "fc2").abs().max() > 0
