"""TopKRouter against hand-computed cases: scores, tie-breaking, capacity dropping/padding, aux and z losses."""
import math

import pytest
import torch

from ds_megatron.config import ConfigError
from ds_megatron.moe.router import TopKRouter, get_capacity
from moe_helpers import moe_config


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
