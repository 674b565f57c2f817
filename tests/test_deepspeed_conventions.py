"""DeepSpeed conventions a user's config and loop already use, on the Megatron optimizer path.

* Engine queries (``bfloat16_enabled``, ``fp16_enabled``, ``gradient_clipping``, ``loss_scale``,
  ``get_global_grad_norm``) answer with what our path does (they said False / 0.0), and the
  fp32 + clipping step clips once, by the true global norm (an independent reference on 2 ranks);
  fp16 / bf16 checkpoints still load (DeepSpeed then passes ``load_optimizer_states=``).
* Every DeepSpeed key is honoured, refused naming the fix, or named in a notice.
* One rule for the learning rate; DeepSpeed's ``activation_checkpointing`` mapped onto recomputation.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.config import ConfigError, split_config
from ds_megatron.config.job import parse_job_config


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.weight = torch.nn.Parameter(torch.randn(4, 6))

    def forward(self, x):
        return (x @ self.weight).pow(2).mean()


def _batch(rank):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(50 + rank)) * 3


def _queries_and_step(precision, clip, tmp):
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 6, "gradient_clipping": clip,
           "megatron": {}, **precision}
    model = _Linear()
    engine, *_ = ds_megatron.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        config=cfg)
    answers = {"fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(), "clip": engine.gradient_clipping(),
               "loss_scale": engine.loss_scale(), "dynamic": engine.dynamic_loss_scale(),
               "initial_scale": engine.initial_dynamic_scale()}
    loss = engine(_batch(dist.get_rank()).to(engine.module.weight.dtype))
    engine.backward(loss)
    engine.step()
    answers["norm"] = engine.get_global_grad_norm()
    answers["weight"] = engine.module.weight.detach().float().clone()
    # A checkpoint round trip: with fp16/bf16 reported, DeepSpeed loads with load_optimizer_states=.
    ds_megatron.save_checkpoint(engine, tmp, tag="t")
    ds_megatron.load_checkpoint(engine, tmp, tag="t")
    answers["reloaded"] = torch.equal(engine.module.weight.detach().float(), answers["weight"])
    engine.megatron.state.destroy()
    return answers


def _reference(clip):
    """SGD on the mean loss of both ranks' batches, clipped by the global norm (one process, float64)."""
    model = _Linear().double()
    sum(model(_batch(r).double()) for r in range(2)).div(2).backward()
    norm = float(model.weight.grad.norm())
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    return norm, (model.weight - 0.1 * coef * model.weight.grad).detach().float()


@pytest.mark.parametrize("name,precision,clip,expect,tol", [
    ("fp32", {}, 0.5, dict(fp16=False, bf16=False, loss_scale=0.0), 1e-6),
    ("bf16", {"bf16": {"enabled": True}}, 1.0, dict(fp16=False, bf16=True), 2e-2),
    ("fp16 dynamic", {"fp16": {"enabled": True, "initial_scale_power": 8}}, 1.0,
     dict(fp16=True, bf16=False, loss_scale=0.0, dynamic=True, initial_scale=256.0), 2e-3),
    ("fp16 static", {"fp16": {"enabled": True, "loss_scale": 128}}, 0.0,
     dict(fp16=True, bf16=False, loss_scale=128.0, dynamic=False), 2e-3),
])
def test_engine_queries_tell_what_our_path_does(tmp_path, name, precision, clip, expect, tol):
    norm, weight = _reference(clip)
    for answers in run_on_ranks(2, _queries_and_step, precision, clip, str(tmp_path)):
        assert {k: answers[k] for k in expect} == expect, name
        assert answers["clip"] == clip
        assert answers["norm"] == pytest.approx(norm, rel=tol), name  # the true global norm, before clipping
        assert torch.allclose(answers["weight"], weight, atol=tol, rtol=tol), name  # clipped once, not twice
        assert answers["reloaded"], name


# --- DeepSpeed keys --------------------------------------------------------------------------------------

def _split(extra, megatron=None):
    return split_config({"train_micro_batch_size_per_gpu": 1, "megatron": megatron or {}, **extra})


@pytest.mark.parametrize("extra,field,fix", [
    ({"prescale_gradients": True}, "prescale_gradients=True", "megatron.average_in_collective"),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor=2.0", "scale by 1/DP"),
    ({"communication_data_type": "fp16"}, "communication_data_type='fp16'", "megatron.grad_reduce_in_fp32"),
    ({"sparse_gradients": True}, "sparse_gradients=True", "dense"),
    ({"curriculum_learning": {"enabled": True}}, "curriculum_learning=", "curriculum_seqlen"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel=", "megatron.tensor_model_parallel_size"),
    ({"zero_optimization": {"stage": 0, "reduce_bucket_size": 5e7}}, "zero_optimization.reduce_bucket_size",
     "megatron.bucket_size"),
    ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal", "ZeRO optimizer states"),
    ({"data_types": {"param_dtype": "bf16"}}, "data_types.param_dtype='bf16'", "bf16.enabled"),
])
def test_deepspeed_keys_our_path_would_not_apply_are_refused_naming_the_key(extra, field, fix):
    with pytest.raises(ConfigError) as e:
        _split(extra)
    assert str(e.value).startswith(field) and fix in str(e.value), str(e.value)
    _split(extra, {"optimizer_impl": "deepspeed"})  # DeepSpeed's own path applies them


def test_deepspeed_keys_without_effect_or_unknown_are_named():
    _, mcfg = _split({"aio": {}, "gradient_cliping": 1.0, "zero_optimization": {"stage": 0, "contiguous_gradients": True},
                      "prescale_gradients": False, "steps_per_print": 5, "csv_monitor": {"enabled": False}})
    assert mcfg.notices == [
        "aio has no effect on megatron.optimizer_impl \"megatron\": ZeRO-Infinity swapping only",
        "gradient_cliping is not a DeepSpeed 0.19 config key; DeepSpeed ignores it (a typo?)",
        "zero_optimization.contiguous_gradients has no effect at stage 0 (ZeRO is off on megatron.optimizer_impl "
        "\"megatron\")"]


def _lr_scheduler_and_section():
    model = _Linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        ds_megatron.initialize(model=model, optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1),
                               config={"train_micro_batch_size_per_gpu": 1, "megatron": {},
                                       "scheduler": {"type": "WarmupLR", "params": {}}})
    except ConfigError as e:
        return str(e)


def test_a_scheduler_given_twice_is_refused():
    assert run_on_ranks(1, _lr_scheduler_and_section)[0].startswith(
        "lr_scheduler= was given together with a \"scheduler\" config section")


# --- ds-megatron train: the learning rate from one place, activation checkpointing -------------------------

def _job(extra=None, train=None, model=None):
    return {"train_micro_batch_size_per_gpu": 2, **(extra or {}),
            "megatron": {"model": {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, **(model or {})},
                         "train": train or {}}}


def test_learning_rate_comes_from_one_place():
    adam = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    warmup = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    parse_job_config(_job(train={"lr": 1e-3, "lr_warmup_iters": 3}))  # megatron.train alone
    parse_job_config(_job(adam))  # DeepSpeed's optimizer alone: constant lr, as in DeepSpeed
    parse_job_config(_job({**adam, **warmup}))
    with pytest.raises(ConfigError, match=r"^megatron.train.lr and DeepSpeed's \"optimizer\" section are both given"):
        parse_job_config(_job(adam, train={"lr": 1e-3}))
    with pytest.raises(ConfigError, match=r"^megatron.train.lr_warmup_iters and DeepSpeed's \"scheduler\" section"):
        parse_job_config(_job(warmup, train={"lr_warmup_iters": 3}))
    with pytest.raises(ConfigError, match=r"^megatron.train.min_lr is set, but with DeepSpeed's \"optimizer\" "
                                          r"section and no \"scheduler\" section"):
        parse_job_config(_job(adam, train={"min_lr": 1e-5}))


def test_activation_checkpointing_section_maps_onto_recomputation():
    job = parse_job_config(_job({"activation_checkpointing": {"partition_activations": False}}))
    assert job.model.recompute_granularity == "full"
    assert job.megatron.notices[-1].startswith("activation_checkpointing: ds-megatron train recomputes every layer")
    with pytest.raises(ConfigError, match=r"^activation_checkpointing.cpu_checkpointing is true"):
        parse_job_config(_job({"activation_checkpointing": {"cpu_checkpointing": True}}))
    moe = parse_job_config(_job({"activation_checkpointing": {}}, model={"num_experts": 2}))
    assert moe.model.recompute_granularity == "full"  # MoE layers are recomputed too
