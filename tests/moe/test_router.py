"""TopKRouter against hand-computed cases: scores, tie-breaking, capacity dropping/padding, aux and z losses."""
import math

import pytest
import torch

from ds_megatron.config import ConfigError
from ds_megatron.moe.router import TopKRouter, get_capacity
from moe_helpers import MOE, moe_config


def _router(logits_weight, **kw):
    """A router whose logits equal the rows of ``logits_weight`` for one-hot inputs."""
    E = logits_weight.size(1)
    r = TopKRouter(logits_weight.size(0), E, kw.pop("topk", 1), **kw).double()
    with torch.no_grad():
        r.weight.copy_(logits_weight.t())
    return r


def _route(logits, **kw):
    r = _router(logits, **kw)
    return (*r(torch.eye(logits.size(0), dtype=torch.float64)), r)


def test_softmax_after_topk_and_ties_go_to_the_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    probs, rmap, _ = _route(logits, topk=2)
    assert rmap.tolist() == [[False, True, True, False], [True, True, False, False]]
    assert torch.allclose(probs, torch.tensor([[0, .5, .5, 0], [.5, .5, 0, 0]], dtype=torch.float64))


def test_pre_softmax_and_sigmoid_scores():
    logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64)
    probs, _, _ = _route(logits, topk=2, pre_softmax=True)
    full = torch.softmax(logits[0], -1)
    assert torch.allclose(probs[0], torch.tensor([0.0, full[1], full[2]], dtype=torch.float64))
    probs, _, _ = _route(logits, topk=2, score_function="sigmoid")
    s = torch.sigmoid(logits[0])
    assert torch.allclose(probs[0], torch.tensor([0.0, s[1], s[2]], dtype=torch.float64) / (s[1] + s[2]))


def test_aux_loss_equals_the_switch_formula():
    # 3 tokens, 2 experts, top-1: tokens 0,1 -> expert 0, token 2 -> expert 1.
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    _, rmap, r = _route(logits, topk=1, aux_loss_coeff=0.1)
    p = torch.softmax(logits, -1)
    # coeff * E * sum_e mean_prob_e * fraction_e, fraction over token-expert assignments (N * k)
    expected = 0.1 * 2 * ((p[:, 0].mean() * 2 / 3) + (p[:, 1].mean() * 1 / 3))
    assert float(r.aux_loss.detach()) == pytest.approx(float(expected), rel=1e-12)
    hand = 0.1 * 2 * ((0.8808 + 0.7311 + 0.2689) / 3 * 2 / 3 + (0.1192 + 0.2689 + 0.7311) / 3 / 3)
    assert float(r.aux_loss.detach()) == pytest.approx(hand, rel=1e-3)


def test_z_loss_equals_its_formula():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64)
    _, _, r = _route(logits, topk=1, z_loss_coeff=0.5)
    # logsumexp: log 2 and log 4
    assert float(r.aux_loss.detach()) == pytest.approx(0.5 * (math.log(2) ** 2 + math.log(4) ** 2) / 2, rel=1e-12)


def test_losses_are_off_in_eval_and_recorded_in_the_tracker():
    from ds_megatron.moe import MoEAuxLossTracker
    tracker = MoEAuxLossTracker()
    logits = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    r = _router(logits, topk=1, aux_loss_coeff=0.1, z_loss_coeff=0.01, aux_loss_tracker=tracker, layer_number=3)
    x = torch.eye(2, dtype=torch.float64)
    r(x)
    r(x)
    avg = tracker.averages()
    assert set(avg) == {"load_balancing_loss", "z_loss"} and set(tracker.per_layer()["z_loss"]) == {3}
    assert avg["load_balancing_loss"] + avg["z_loss"] == pytest.approx(float(r.aux_loss.detach()))
    r.eval()
    r(x)
    assert float(r.aux_loss.detach()) == 0.0


def test_capacity_drops_the_lowest_probability_tokens():
    # 4 tokens, 2 experts, top-1, capacity factor 1 -> capacity ceil(4/2) = 2 per expert.
    # Expert 0 gets tokens 0,1,2 (probs .9, .6, .8): token 1 (lowest) is dropped.
    p0 = torch.tensor([0.9, 0.6, 0.8, 0.1], dtype=torch.float64)
    logits = torch.stack([torch.log(p0), torch.log(1 - p0)], -1)
    # Softmax before top-1 (after it, every chosen weight would be 1).
    probs, rmap, _ = _route(logits, topk=1, capacity_factor=1.0, pre_softmax=True)
    assert get_capacity(4, 2, 1.0) == 2
    assert rmap.tolist() == [[True, False], [False, False], [True, False], [False, True]]
    probs = probs.detach()
    assert float(probs[1].abs().sum()) == 0 and float(probs[0, 0]) == pytest.approx(0.9)


def test_capacity_position_policy_and_padding():
    p0 = torch.tensor([0.6, 0.9, 0.8, 0.1], dtype=torch.float64)
    logits = torch.stack([torch.log(p0), torch.log(1 - p0)], -1)
    _, rmap, _ = _route(logits, topk=1, capacity_factor=1.0, drop_policy="position")
    assert rmap[:, 0].tolist() == [True, True, False, False]  # the earliest two of tokens 0,1,2
    probs, rmap, _ = _route(logits, topk=1, capacity_factor=1.0, pad_to_capacity=True, pre_softmax=True)
    # Padded: every expert has exactly 2 slots; expert 1 keeps token 3 and is filled with token 0 at weight 0.
    assert rmap.sum(0).tolist() == [2, 2]
    assert rmap[:, 1].tolist() == [True, False, False, True] and probs[0, 1] == 0
    assert rmap[:, 0].tolist() == [False, True, True, False]


def test_bad_moe_model_configs_fail_with_the_field():
    with pytest.raises(ConfigError, match="moe_router_topk=5 is larger than model.num_experts=4"):
        moe_config(moe_router_topk=5)
    with pytest.raises(ConfigError, match="num_experts=4 is not divisible by megatron.expert_model_parallel_size=3"):
        moe_config().check_expert_parallel(3, 1)
    with pytest.raises(ConfigError, match="moe_token_dispatcher_type='flex' is unknown"):
        moe_config(moe_token_dispatcher_type="flex")
    with pytest.raises(ConfigError, match="moe_pad_expert_input_to_capacity is true but model.moe_capacity_factor"):
        moe_config(moe_pad_expert_input_to_capacity=True)


# -- DeepSeek-V3 routing: group-limited top-k, expert bias, scaling factor, seq aux loss, router dtype --------------

def _ranked(values, indices):
    """``indices`` ordered by value (highest first), ties to the lower index: the reference's order."""
    return sorted(indices, key=lambda i: (-values[i], i))


def _brute_group_topk(scores, k, groups, group_topk):
    """Per token, by loops: group score = sum of its best k // group_topk; best groups; top-k of their experts."""
    T, E = scores.shape
    per = E // groups
    chosen = []
    for t in range(T):
        row = scores[t].tolist()
        gscore = [sum(sorted(row[g * per:(g + 1) * per], reverse=True)[:k // group_topk]) for g in range(groups)]
        kept = _ranked(gscore, range(groups))[:group_topk]
        allowed = [e for g in kept for e in range(g * per, (g + 1) * per)]
        chosen.append(set(_ranked(row, allowed)[:k]))
    return chosen


@pytest.mark.parametrize("score_function, pre_softmax", [("sigmoid", False), ("softmax", True), ("softmax", False)])
def test_group_limited_topk_equals_explicit_loops(score_function, pre_softmax):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 8, generator=g, dtype=torch.float64)
    probs, rmap, _ = _route(logits, topk=4, num_groups=4, group_topk=2, score_function=score_function,
                            pre_softmax=pre_softmax)
    # Megatron groups the selection scores: sigmoid / softmax scores, or the logits (softmax after top-k).
    sel = torch.sigmoid(logits) if score_function == "sigmoid" else (
        torch.softmax(logits, -1) if pre_softmax else logits)
    want = _brute_group_topk(sel, 4, 4, 2)
    assert [set(torch.nonzero(r).flatten().tolist()) for r in rmap] == want
    # Group limiting changes the choice for some tokens here (the test is not the plain top-k).
    assert want != [set(_ranked(r.tolist(), range(8))[:4]) for r in sel]


def test_expert_bias_moves_the_choice_not_the_weights_and_the_scaling_factor():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.5, 1.0, 1.5]], dtype=torch.float64)
    r = _router(logits, topk=2, score_function="sigmoid", topk_scaling_factor=2.5, enable_expert_bias=True)
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([0.0, -1.0, 0.0, 1.0]))
    probs, rmap = r(torch.eye(2, dtype=torch.float64))
    s = torch.sigmoid(logits)
    # scores + bias: token 0 -> [.88, -.27, .5, .73] picks 0 and 3; token 1 -> [.5, -.38, .73, 1.82] picks 3 and 2.
    assert rmap.tolist() == [[True, False, False, True], [False, False, True, True]]
    for t, (a, b) in enumerate([(0, 3), (2, 3)]):
        want = 2.5 * torch.stack([s[t, a], s[t, b]]) / (s[t, a] + s[t, b])  # unbiased scores, renormalized, scaled
        assert torch.allclose(probs[t, [a, b]], want, rtol=1e-14)
    # Training forwards count the routed tokens; eval and no-grad forwards do not.
    assert r.local_tokens_per_expert.tolist() == [1, 0, 1, 2]
    r.eval()
    r(torch.eye(2, dtype=torch.float64))
    assert r.local_tokens_per_expert.tolist() == [1, 0, 1, 2]


def _seq_aux_reference(scores, rmap, S, B, k, coeff):
    """DeepSeek-V3's sequence-wise loss by loops over sequences b (token s * B + b)."""
    E = scores.size(1)
    total = 0.0
    for b in range(B):
        rows = [s * B + b for s in range(S)]
        for e in range(E):
            f = E / (k * S) * sum(float(rmap[t, e]) for t in rows)
            total = total + f * sum(scores[t, e] for t in rows) / S
    return coeff * total / B


def test_seq_aux_loss_equals_its_formula_value_and_gradient():
    S, B, h, E, k = 5, 3, 6, 4, 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(S, B, h, generator=g, dtype=torch.float64)
    r = TopKRouter(h, E, k, aux_loss_coeff=0.1, load_balancing_type="seq_aux_loss").double()
    r(x)
    loss = r.aux_losses["load_balancing_loss"]
    (grad,) = torch.autograd.grad(loss, r.weight)
    w = r.weight.detach().clone().requires_grad_(True)
    logits = x.reshape(-1, h) @ w.t()
    scores = torch.softmax(logits, -1)
    rmap = torch.zeros_like(scores, dtype=torch.bool).scatter(1, scores.topk(k, -1).indices, True)
    want = _seq_aux_reference(scores, rmap, S, B, k, 0.1)
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-13)
    assert torch.allclose(grad, torch.autograd.grad(want, w)[0], rtol=1e-12)
    # One sequence: the switch loss of that sequence.
    r1 = TopKRouter(h, E, k, aux_loss_coeff=0.1).double()
    r1.load_state_dict(r.state_dict())
    r1(x[:, :1])
    r.load_balancing_type = "seq_aux_loss"
    r(x[:, :1])
    assert float(r.aux_loss.detach()) == pytest.approx(float(r1.aux_loss.detach()), rel=1e-13)


def test_global_aux_loss_on_one_rank_is_the_aux_loss_and_none_has_no_loss():
    x = torch.randn(4, 2, 6, dtype=torch.float64)
    a = TopKRouter(6, 4, 2, aux_loss_coeff=0.1).double()
    b = TopKRouter(6, 4, 2, aux_loss_coeff=0.1, load_balancing_type="global_aux_loss").double()
    n = TopKRouter(6, 4, 2, load_balancing_type="none", z_loss_coeff=0.01).double()
    b.load_state_dict(a.state_dict())
    n.load_state_dict(a.state_dict())
    a(x), b(x), n(x)
    assert float(a.aux_loss.detach()) == float(b.aux_loss.detach()) > 0
    assert set(n.aux_losses) == {"z_loss"}


def test_router_dtype_computes_the_scores_in_it_and_returns_the_activation_dtype():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 8, generator=g).to(torch.bfloat16)
    r = TopKRouter(8, 4, 2, score_function="sigmoid", router_dtype="fp32", aux_loss_coeff=0.1)
    with torch.no_grad():
        r.weight.copy_(torch.randn(4, 8, generator=g))
    probs, rmap = r(x)
    logits = x.float() @ r.weight.float().t()  # fp32 logits of the bf16 activations
    s = torch.sigmoid(logits)
    top = s.topk(2, -1)
    want = torch.zeros_like(s).scatter(1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    assert probs.dtype == torch.bfloat16 and r.aux_loss.dtype == torch.bfloat16
    assert torch.equal(probs, want.to(torch.bfloat16))
    r64 = TopKRouter(8, 4, 2, score_function="sigmoid", router_dtype="fp64")
    r64.load_state_dict(r.state_dict())
    probs64, _ = r64(x.float())
    assert r64.gating(x.float()).dtype == torch.float64 and probs64.dtype == torch.float32
    s64 = torch.sigmoid(x.double() @ r.weight.double().t())
    top = s64.topk(2, -1)
    assert torch.equal(probs64, torch.zeros_like(s64).scatter(1, top.indices, top.values / top.values.sum(
        -1, keepdim=True)).float())


def test_expert_bias_stays_fp32_in_16_bit_models_and_is_a_buffer():
    from ds_megatron.models import GPTModel
    model = GPTModel(moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True))
    model.bfloat16()
    router = model.layers[0].mlp.router
    assert router.expert_bias.dtype == router.local_tokens_per_expert.dtype == torch.float32
    assert router.weight.dtype == torch.bfloat16
    assert all(p is not router.expert_bias for p in model.parameters())
    keys = model.state_dict().keys()
    assert "layers.0.mlp.router.expert_bias" in keys and not any("local_tokens" in k for k in keys)


@pytest.mark.parametrize("kwargs, message", [
    (dict(moe_router_enable_expert_bias=True), "moe_router_enable_expert_bias needs model.moe_router_score_function"),
    (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0),
     "moe_router_bias_update_rate must be a number > 0"),
    (dict(moe_router_num_groups=2), "moe_router_num_groups and model.moe_router_group_topk go together"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "num_experts=4 is not divisible by model.moe_router_num"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=3), "moe_router_group_topk=3 is larger than"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=1), r"moe_router_topk=2 must be in \[moe_router_group_topk"),
    (dict(moe_router_topk=1, moe_router_num_groups=2, moe_router_group_topk=2), "moe_router_topk=1 must be in"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type='sinkhorn' is unknown"),
    (dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.1), "moe_aux_loss_coeff=0.1 with model.moe_r"),
    (dict(moe_router_dtype="bf16"), "moe_router_dtype='bf16' is unknown"),
    (dict(moe_router_topk_scaling_factor=0), "moe_router_topk_scaling_factor must be a number > 0"),
])
def test_bad_router_configs_fail_with_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message) as err:
        moe_config(**kwargs)
    assert "\n" not in str(err.value)


def test_expert_bias_refused_where_it_would_not_update_or_be_saved():
    from ds_megatron.config.megatron import split_config
    model = {**{k: v for k, v in MOE.items() if k != "make_vocab_size_divisible_by"},
             "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
    base = {"train_micro_batch_size_per_gpu": 1, "megatron": {"model": model}}
    _, mcfg = split_config(base)
    assert mcfg.train.ckpt_format == "torch_dist"  # the default, which keeps the buffer
    for extra, field in (({"optimizer_impl": "deepspeed"}, "optimizer_impl"),
                         ({"cuda_graph": {"impl": "transformer_engine", "scope": ["moe_router"]}}, "cuda_graph")):
        with pytest.raises(ConfigError, match="moe_router_enable_expert_bias") as err:
            split_config({**base, "megatron": {**base["megatron"], **extra}})
        assert field in str(err.value) and "\n" not in str(err.value)


# -- the expert bias update through the engine -----------------------------------------------------------------------

BIAS = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)


def _engine_cfg(tp=1, sp=False, gas=1, **extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 6, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, **extra,
            "megatron": {"tensor_model_parallel_size": tp, "sequence_parallel": sp}}


def _tokens(replica, micro):
    from moe_helpers import MOE as M
    g = torch.Generator().manual_seed(300 + 10 * replica + micro)
    tokens = torch.randint(0, M["vocab_size"], (2, M["seq_length"]), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _bias_step_on_ranks(tp, sp, gas):
    import ds_megatron
    from ds_megatron.models import GPTModel
    from ds_megatron.utils.collectives import count_bytes
    cfg = _engine_cfg(tp, sp, gas)
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(41)
    engine, *_ = ds_megatron.initialize(model=GPTModel(moe_config(sequence_parallel=sp, **BIAS), state),
                                        config=cfg, parallel_state=state)
    routers = [layer.mlp.router for layer in engine.module.layers]
    for micro in range(gas):
        engine.backward(engine(*_tokens(state.dp.rank, micro)))
        if micro < gas - 1:
            engine.step()  # not a boundary: DeepSpeed's loop calls it after every micro-batch
    counts = torch.stack([r.local_tokens_per_expert.clone() for r in routers])
    with count_bytes() as counter:
        engine.step()
    reduces = [r.group for r in counter.select("all_reduce") if r.shape == tuple(counts.shape)]
    out = (counts, torch.stack([r.expert_bias.clone() for r in routers]), reduces,
           all(float(r.local_tokens_per_expert.abs().sum()) == 0 for r in routers))
    engine.megatron.destroy()
    return out


def test_expert_bias_update_over_dp_and_tp_sp_equals_one_rank():
    """TP=2 + SP and DP=2 (4 ranks), two micro-batches: the counts each rank adds are its own tokens (their sum over
    the ranks is the one-rank count of the global batch), the bias moves once by the one-rank update, through two
    all-reduces (sequence group, then dp), and the counts restart at 0."""
    from ds_megatron.models import GPTModel
    from ds_megatron.moe import expert_bias_routers, update_expert_bias
    from harness import run_on_ranks
    out = run_on_ranks(4, _bias_step_on_ranks, 2, True, 2)
    torch.manual_seed(41)
    ref = GPTModel(moe_config(**BIAS))
    for replica in range(2):
        for micro in range(2):
            ref(*_tokens(replica, micro)).backward()
    routers = expert_bias_routers([ref])
    ref_counts = torch.stack([r.local_tokens_per_expert.clone() for r in routers])
    update_expert_bias(routers)
    ref_bias = torch.stack([r.expert_bias for r in routers])
    assert torch.equal(sum(o[0] for o in out), ref_counts)
    assert ref_bias.abs().sum() > 0
    for counts, bias, reduces, zeroed in out:
        assert torch.equal(bias, ref_bias) and bias.dtype == torch.float32
        assert reduces == ["tp-cp", "dp"] and zeroed


def _bias_after_steps_saved_as_torch_dist(save_dir, tp):
    import ds_megatron
    from ds_megatron.models import GPTModel
    cfg = _engine_cfg(tp=tp, sp=tp > 1)
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(41)
    engine, *_ = ds_megatron.initialize(model=GPTModel(moe_config(sequence_parallel=tp > 1, **BIAS), state),
                                        config=cfg, parallel_state=state)
    routers = [layer.mlp.router for layer in engine.module.layers]
    if save_dir.endswith("saved"):
        for step in range(3):
            engine.backward(engine(*_tokens(0, step)))
            engine.step()
        ds_megatron.save_dist_checkpoint(engine, save_dir)
    else:
        ds_megatron.load_dist_checkpoint(engine, save_dir.replace("loaded", "saved"))
    out = torch.stack([r.expert_bias.clone() for r in routers])
    engine.megatron.destroy()
    return out


def test_expert_bias_resumes_from_a_torch_dist_checkpoint_at_another_layout(tmp_path):
    from harness import run_on_ranks
    saved = run_on_ranks(2, _bias_after_steps_saved_as_torch_dist, str(tmp_path / "saved"), 2)
    loaded = run_on_ranks(1, _bias_after_steps_saved_as_torch_dist, str(tmp_path / "loaded"), 1)[0]
    assert saved[0].abs().sum() > 0 and torch.equal(saved[0], saved[1])
    assert torch.equal(loaded, saved[0]) and loaded.dtype == torch.float32


def _bf16_bias_and_checkpoint(save_dir):
    import ds_megatron
    from ds_megatron.models import GPTModel
    cfg = _engine_cfg(bf16={"enabled": True})
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(41)
    engine, optimizer, *_ = ds_megatron.initialize(model=GPTModel(moe_config(**BIAS), state), config=cfg,
                                                   parallel_state=state)
    router = engine.module.layers[0].mlp.router
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    assert all(p is not router.expert_bias for g in optimizer.param_groups for p in g["params"])
    for step in range(3):
        engine.backward(engine(*_tokens(0, step)))
        engine.step()
    bias = router.expert_bias.clone()
    # 3 steps of +-0.01 in fp32 (bf16 would round 0.01 to 0.010009765625).
    steps = torch.tensor([-0.03, -0.01, 0.01, 0.03], dtype=torch.float32)
    assert bias.dtype == torch.float32 and all(bool((steps - v).abs().min() < 1e-9) for v in bias), bias
    ds_megatron.save_checkpoint(engine, save_dir, tag="bias")
    with torch.no_grad():
        router.expert_bias.fill_(5.0)
    ds_megatron.load_checkpoint(engine, save_dir, tag="bias")
    restored = router.expert_bias.clone()
    engine.megatron.destroy()
    return bias, restored


def test_expert_bias_is_fp32_under_bf16_outside_the_optimizer_and_checkpointed(tmp_path):
    from harness import run_on_ranks
    bias, restored = run_on_ranks(1, _bf16_bias_and_checkpoint, str(tmp_path))[0]
    assert torch.equal(bias, restored) and restored.dtype == torch.float32
