"""torch's fused AdamW (what the job and the "optimizer" section build) against the unfused one.

The fused CPU kernel computes the same update in one pass: the moments come out
bit-identical and each parameter differs only by the rounding of its last
multiply-add (a couple of units in the last place of the update and of the
param).  So a GPT trained with either gives the same losses to float precision.
"""
import pytest
import torch

from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.optimizer import get_param_groups, optimizer_from_section

SHAPES = [(257, 64), (64,), (64,), (192, 64), (192,), (64, 64), (256, 64), (256,), (64, 256)]


def _ulp(t):
    t = t.abs()
    return torch.nextafter(t, torch.full_like(t, float("inf"))) - t


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_each_fused_step_equals_the_unfused_step_to_the_last_rounding(weight_decay):
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) * 0.02 for s in SHAPES]
    plain = [p.clone().requires_grad_() for p in start]
    fused = [p.clone().requires_grad_() for p in start]
    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    ref, opt = torch.optim.AdamW(plain, **kw), torch.optim.AdamW(fused, fused=True, **kw)
    for step in range(60):
        lr = 3e-4 * min(1.0, (step + 1) / 20)  # warmup, as the job's schedule does
        for o in (ref, opt):
            for group in o.param_groups:
                group["lr"] = lr
        with torch.no_grad():  # every step from the same params: the difference of one step
            for a, b in zip(plain, fused):
                b.copy_(a)
        before = [a.detach().clone() for a in plain]
        for a, b in zip(plain, fused):
            grad = torch.randn(a.shape, generator=g) * 10.0 ** (step % 7 - 4)  # 1e-4 .. 1e2
            a.grad, b.grad = grad.clone(), grad.clone()
        ref.step()
        opt.step()
        for a, b, p0 in zip(plain, fused, before):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ref.state[a][key], opt.state[b][key]), (step, key)
            update = a.detach() - p0
            bound = 2 * _ulp(a.detach()) + 4 * _ulp(update)
            assert bool(((a.detach() - b.detach()).abs() <= bound).all()), step


def _losses(fused, steps=8):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=97,
                               hidden_dropout=0.0, attention_dropout=0.0))
    opt = torch.optim.AdamW(get_param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95), fused=fused)
    tokens = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(1))  # one batch, learned by heart
    losses = []
    for _ in range(steps):
        loss = model({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_gpt_trains_to_the_same_losses_with_either():
    plain, fused = _losses(False), _losses(True)
    assert plain[-1] < plain[0] - 0.5  # it does train
    assert fused == pytest.approx(plain, rel=1e-5)


def test_the_optimizer_section_builds_fused_adam_unless_told_otherwise():
    params = [torch.nn.Parameter(torch.zeros(3))]
    for kind in ("Adam", "AdamW"):
        assert optimizer_from_section({"type": kind, "params": {"lr": 1e-3}}, params).defaults["fused"] is True
    assert not optimizer_from_section({"type": "AdamW", "params": {"lr": 1e-3, "foreach": True}},
                                      params).defaults["fused"]
    assert not optimizer_from_section({"type": "AdamW", "params": {"lr": 1e-3, "fused": False}},
                                      params).defaults["fused"]
