"""The optimizer wrappers on one process: the update, the skip, clipping, zeros and checkpoints."""
import copy

import pytest
import torch

from ds_megatron.optimizer import (ConstantGradScaler, DynamicGradScaler, Float16OptimizerWithFloat16Params,
                                   FP32Optimizer, get_param_groups)


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    return m.to(dtype)


def _backward(model, scale=1.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 8, generator=g).to(next(model.parameters()).dtype)
    (model(x).float().pow(2).mean() * scale).backward()


def _scaler():
    return DynamicGradScaler(2.0 ** 8, 1.0, 2.0, 0.5, growth_interval=4, hysteresis=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float16_step_is_adamw_on_fp32_main_params(dtype):
    model = _model(dtype)
    ref_params = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW([{"params": ref_params[:2] + ref_params[4:]}, {"params": ref_params[2:4]}], lr=1e-2)
    inner = torch.optim.AdamW([{"params": list(model.parameters())[:2] + list(model.parameters())[4:]},
                               {"params": list(model.parameters())[2:4]}], lr=1e-2)
    opt = Float16OptimizerWithFloat16Params(inner, clip_grad=0.0, grad_scaler=_scaler())
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is inner.param_groups
    assert all(p.dtype == torch.float32 for p in opt.get_parameters())
    for step in range(3):
        _backward(model, scale=float(opt.get_loss_scale()), seed=step)
        for r, p in zip(ref_params, model.parameters()):
            r.grad = p.grad.float() * (1.0 / float(opt.get_loss_scale()))
        ok, norm, _ = opt.step()
        ref.step()
        assert ok and norm > 0 and not opt.overflow
        for r, p in zip(ref_params, model.parameters()):
            assert torch.equal(p.main_param, r.detach()), "main params differ from AdamW on fp32"
            assert torch.equal(p.detach(), r.detach().to(dtype)), "model params are not the rounded main params"
        opt.zero_grad()
    assert all(p.main_param.grad is None for p in model.parameters()), "main grads kept after the step"


def test_overflow_skips_and_leaves_everything_bit_identical():
    model = _model(torch.float16)
    opt = Float16OptimizerWithFloat16Params(torch.optim.Adam(model.parameters(), lr=1e-2), grad_scaler=_scaler())
    _backward(model, scale=256.0)
    assert opt.step()[0]
    before = (copy.deepcopy(opt.optimizer.state_dict()), [p.detach().clone() for p in model.parameters()],
              [p.main_param.clone() for p in model.parameters()])
    for hit in range(2):  # hysteresis 2: the first overflow keeps the scale, the second halves it
        opt.zero_grad()
        _backward(model, scale=256.0)
        next(model.parameters()).grad[0, 0] = float("nan") if hit else float("inf")
        assert opt.step() == (False, None, None) and opt.overflow and opt._global_grad_norm is None
        assert float(opt.get_loss_scale()) == (256.0 if hit == 0 else 128.0)
        state = opt.optimizer.state_dict()
        for k, v in before[0]["state"].items():
            for name, t in v.items():
                assert torch.equal(state["state"][k][name], t), (k, name)
        assert all(torch.equal(a, p) for a, p in zip(before[1], model.parameters()))
        assert all(torch.equal(a, p.main_param) for a, p in zip(before[2], model.parameters()))
    opt.zero_grad()
    _backward(model, scale=128.0)
    assert opt.step()[0] and not opt.overflow  # training goes on


def test_fp32_optimizer_clips_like_torch_and_counts_zeros():
    model, ref_model = _model(), _model()
    opt = FP32Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), clip_grad=0.05, log_num_zeros_in_grad=True)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    _backward(model)
    _backward(ref_model)
    model[0].weight.grad[0] = 0.0
    ref_model[0].weight.grad[0] = 0.0
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
    ok, norm, zeros = opt.step()
    ref.step()
    # The same per-tensor norms (one process, the same grads), combined in float64 here and in float32 by torch.
    assert ok and norm == pytest.approx(float(ref_norm), rel=1e-6)
    assert zeros == 8 + sum(int((p.grad == 0).sum()) for p in list(model.parameters())[1:])
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    model[0].weight.grad[1, 1] = float("inf")
    snapshot = [p.detach().clone() for p in model.parameters()]
    assert opt.step()[0] is False  # fp32 also skips a non-finite step
    assert all(torch.equal(a, p) for a, p in zip(snapshot, model.parameters()))


def test_state_dict_round_trip_restores_main_params_and_scaler():
    model = _model(torch.bfloat16)
    opt = Float16OptimizerWithFloat16Params(torch.optim.AdamW(model.parameters(), lr=1e-2), clip_grad=1.0,
                                            grad_scaler=ConstantGradScaler(4.0))
    for s in range(2):
        _backward(model, 4.0, seed=s)
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    other = _model(torch.bfloat16, seed=5)
    opt2 = Float16OptimizerWithFloat16Params(torch.optim.AdamW(other.parameters(), lr=1e-2), clip_grad=1.0,
                                             grad_scaler=ConstantGradScaler(1.0))
    opt2.load_state_dict(saved)
    assert float(opt2.get_loss_scale()) == 4.0
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a.main_param, b.main_param) and torch.equal(a.detach(), b.detach())
    for m in (model, other):
        _backward(m, 4.0, seed=9)
    opt.step()
    opt2.step()
    assert all(torch.equal(a.main_param, b.main_param) for a, b in zip(model.parameters(), other.parameters()))


def test_fp16_without_a_scaler_and_wrong_dtypes_are_refused():
    with pytest.raises(ValueError, match="fp16 params need a grad scaler"):
        Float16OptimizerWithFloat16Params(torch.optim.SGD(_model(torch.float16).parameters(), lr=1))
    with pytest.raises(TypeError, match="FP32Optimizer wraps float32 params only"):
        FP32Optimizer(torch.optim.SGD(_model(torch.bfloat16).parameters(), lr=1))


def test_param_groups_exclude_biases_and_norm_weights_from_decay():
    model = _model()
    decay, no_decay = get_param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [tuple(p.shape) for p in decay["params"]] == [(16, 8), (4, 16)]
    assert [tuple(p.shape) for p in no_decay["params"]] == [(16,), (16,), (16,), (4,)]
