"""DeepSpeed's fp16/bf16/clipping sections under our optimizer path: what DeepSpeed sees, what fails at start."""
import pytest

from ds_megatron.config import ConfigError, split_config
from ds_megatron.config.precision import resolve_precision


def test_our_path_takes_precision_clipping_and_optimizer_from_deepspeed():
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
          "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 50,
                   "hysteresis": 3, "min_loss_scale": 0.25},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": {"type": "WarmupLR"}}
    p = resolve_precision(ds)
    assert (p.params_dtype, p.initial_scale, p.loss_scale_window, p.hysteresis, p.min_loss_scale, p.clip_grad) == \
        ("fp16", 4096.0, 50, 3, 0.25, 0.5)
    view = p.deepspeed_view(ds)
    assert "fp16" not in view and "optimizer" not in view and view["gradient_clipping"] == 0.0
    assert view["scheduler"] == ds["scheduler"] and ds["gradient_clipping"] == 0.5  # input untouched
    # DeepSpeed's defaults when the keys are absent (clipping 1.0, scale 2**16, window 1000, hysteresis 2).
    d = resolve_precision({"fp16": {"enabled": True}})
    assert (d.clip_grad, d.initial_scale, d.loss_scale_window, d.hysteresis) == (1.0, 65536.0, 1000, 2)
    assert resolve_precision({"bf16": {"enabled": True}}).params_dtype == "bf16"
    # DeepSpeed's own path sees the config as it is.
    deepspeed = resolve_precision(ds, "deepspeed")
    assert deepspeed.deepspeed_view(ds) == ds and not deepspeed.owns_optimizer


@pytest.mark.parametrize("ds,impl,message", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "megatron", "fp16.enabled and bf16.enabled are both true"),
    ({"zero_optimization": {"stage": 1}}, "megatron", "zero_optimization.stage=1 cannot be combined"),
    ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, "megatron", "optimizer_impl"),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, "megatron", "fp16.consecutive_hysteresis=True"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "megatron", "fp16.loss_scale_window must be"),
    ({"fp16": {"enabled": True, "scale": 3}}, "megatron", "unknown key fp16.scale"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "megatron", "bf16.immediate_grad_update"),
    ({"amp": {"enabled": True}}, "megatron", "amp.enabled is true"),
    ({"gradient_clipping": -1}, "megatron", "gradient_clipping must be"),
    ({}, "apex", "optimizer_impl='apex' is unknown"),
])
def test_bad_combinations_fail_with_the_field(ds, impl, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        resolve_precision(ds, impl)


def test_split_config_checks_before_anything_starts():
    with pytest.raises(ConfigError, match="zero_optimization.stage=2"):
        split_config({"zero_optimization": {"stage": 2}, "megatron": {}})
    ds, mcfg = split_config({"zero_optimization": {"stage": 2}, "megatron": {"optimizer_impl": "deepspeed"}})
    assert mcfg.optimizer_impl == "deepspeed" and ds["zero_optimization"]["stage"] == 2
    with pytest.raises(ConfigError, match="megatron.optimizer_impl='torch' is unknown"):
        split_config({"megatron": {"optimizer_impl": "torch"}})
