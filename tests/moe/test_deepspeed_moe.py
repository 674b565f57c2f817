"""DeepSpeed's own ``deepspeed.moe.layer.MoE`` under our optimizer path, against DeepSpeed's own engine path.

4 ranks, ep_size 2: each rank holds one of two experts, and each expert has two replicas
(expert data parallel 2).  Both experts start as copies of one module (DeepSpeed deep-copies
the expert it is given), so experts averaged over ranks that hold *different* experts stay
equal forever: the bug this test reproduces.  The reference is the same model and data under
``"megatron": {"optimizer_impl": "deepspeed"}`` in fp32, where DeepSpeed itself reduces the
experts over its expert-data-parallel group.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.config import ConfigError

HIDDEN, STEPS = 8, 6


class _DeepSpeedMoEModel(torch.nn.Module):
    def __init__(self, ep_size=2, num_experts=2):
        super().__init__()
        from deepspeed.moe.layer import MoE
        torch.manual_seed(7)
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 16), torch.nn.ReLU(), torch.nn.Linear(16, HIDDEN))
        self.moe = MoE(HIDDEN, expert=expert, num_experts=num_experts, ep_size=ep_size, k=1, drop_tokens=False,
                       use_rts=False)
        self.out = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, y):
        h, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return torch.nn.functional.mse_loss(self.out(h).float(), y) + 0.01 * l_aux


def _batch(step):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(2, 6, HIDDEN, generator=g)
    return x, torch.roll(x, 1, dims=-1) * 2


def _config(extra_megatron, precision=None):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "steps_per_print": 10 ** 6,
           "megatron": dict(extra_megatron)}
    cfg.update(precision or {})
    return cfg


def _expert_weights(engine):
    """{global expert id: flat fp32 weights} of this rank's experts (fp32 main params where kept)."""
    experts = engine.module.moe.deepspeed_moe.experts
    first = dist.get_rank(group=engine.module.moe.deepspeed_moe.ep_group)
    out = {}
    for local, expert in enumerate(experts.deepspeed_experts):
        params = [getattr(p, "main_param", p) for p in expert.parameters()]
        out[first * len(experts.deepspeed_experts) + local] = torch.cat([p.detach().float().flatten() for p in params])
    return out


def _reference_norm(engine):
    """The global grad norm from the reference's reduced grads: dense params once, experts summed over EP."""
    from deepspeed.utils import groups
    dense = sum(p.grad.double().pow(2).sum() for p in engine.module.parameters()
                if getattr(p, "allreduce", True) and p.grad is not None)
    experts = torch.stack([sum(p.grad.double().pow(2).sum() for p in engine.module.parameters()
                               if not getattr(p, "allreduce", True) and p.grad is not None)])
    dist.all_reduce(experts, group=groups._get_expert_parallel_group(engine.module.moe.expert_group_name))
    return float((dense + experts[0]).sqrt())


def _train(extra_megatron, precision=None):
    cfg = _config(extra_megatron, precision)
    model = _DeepSpeedMoEModel()
    engine, *_ = ds_megatron.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                        config=cfg)
    reference = extra_megatron.get("optimizer_impl") == "deepspeed"
    norms = []
    for step in range(STEPS):
        loss = engine(*_batch(step))
        engine.backward(loss)
        if reference:
            norms.append(_reference_norm(engine))  # DeepSpeed reduced in backward: the grads are final
        engine.step()
        if not reference:
            norms.append(engine.get_global_grad_norm())
    weights = _expert_weights(engine)
    engine.megatron.state.destroy()
    return weights, norms


@pytest.mark.parametrize("name,extra,precision,tol", [
    ("fp32", {}, None, 1e-5),
    ("bf16", {}, {"bf16": {"enabled": True}}, 1e-2),
    ("fp16", {}, {"fp16": {"enabled": True, "initial_scale_power": 8}}, 2e-3),
    ("distributed optimizer, fp32", {"use_distributed_optimizer": True}, None, 1e-5),
    ("distributed optimizer, bf16", {"use_distributed_optimizer": True}, {"bf16": {"enabled": True}}, 1e-2),
])
def test_deepspeed_moe_experts_reduced_over_their_own_expert_data_parallel_group(name, extra, precision, tol):
    ref = run_on_ranks(4, _train, {"optimizer_impl": "deepspeed"})
    ours = run_on_ranks(4, _train, extra, precision)
    for rank in range(4):
        (ref_w, ref_norms), (w, norms) = ref[rank], ours[rank]
        assert sorted(w) == sorted(ref_w) == [rank % 2]  # DeepSpeed's EP groups: [0, 1], [2, 3]
        for e in ref_w:
            err = (w[e] - ref_w[e]).abs().max().item()
            assert err <= tol * max(1.0, ref_w[e].abs().max().item()), (name, rank, e, err)
        assert norms == pytest.approx(ref_norms, rel=max(tol, 1e-5)), (name, norms, ref_norms)
    # The two experts started equal and part as the reference's do (averaged together they would stay equal).
    def parting(out):
        (a,), (b,) = out[0][0].values(), out[1][0].values()
        return (a - b).abs().max().item()
    assert parting(ref) > 0.1
    assert parting(ours) == pytest.approx(parting(ref), abs=tol), name


def _refused(extra, ep_size=2):
    model = _DeepSpeedMoEModel(ep_size=ep_size)
    try:
        ds_megatron.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                               config=_config(extra))
    except ConfigError as e:
        return str(e)
    return None


def test_deepspeed_moe_combinations_that_cannot_be_right_are_refused_at_initialize():
    msg = run_on_ranks(4, _refused, {"tensor_model_parallel_size": 2})[0]
    assert msg and "megatron.tensor_model_parallel_size=2 with deepspeed.moe.layer.MoE" in msg
    msg = run_on_ranks(4, _refused, {"expert_model_parallel_size": 4}, 2)[0]
    assert msg and "megatron.expert_model_parallel_size=4" in msg and "ep_size=2" in msg
