"""The engine's precision queries tell the truth on our optimizer path (a documented DeepSpeed seam).

DeepSpeed must be built with fp16 / bf16 off and ``gradient_clipping`` 0 on our path
(``integration.optimizer``): otherwise it wraps our optimizer in its own, refuses fp16 on a
CPU, and clips the still-scaled gradients.  Its queries read that config
(``runtime/engine.py:1672-1779``), so they would answer False / 0.0 while our path trains
in bf16 with clipping, and users' loops branch on them.  After ``deepspeed.initialize``,
``report_precision`` writes what is in force into the engine's config object
(``engine._config``): ``float16_config.enabled`` / ``loss_scale`` / ``initial_scale_power`` /
``loss_scale_window`` / ``hysteresis`` / ``min_loss_scale``, ``bfloat16_config.enabled`` and
``gradient_clipping``.  Then:

* ``engine.fp16_enabled()``, ``bfloat16_enabled()``, ``gradient_clipping()``, ``loss_scale()``
  (the configured static scale, 0 = dynamic, as in DeepSpeed), ``dynamic_loss_scale()``,
  ``initial_dynamic_scale()`` answer with our settings; ``get_global_grad_norm()`` already
  returns our optimizer's true global norm (``_global_grad_norm``, ``runtime/engine.py:3519``).

Every place DeepSpeed reads these flags after ``__init__`` (0.19.8) was checked:

* ``_take_model_step`` (``:3506-3533``): with fp16 / bf16 on it skips its own fp32 clipping and
  calls ``optimizer.zero_grad()`` (ours clears the model grads); with fp32 and clipping > 0 it
  would clip itself (``clip_fp32_gradients``, ``:3502``) before our step, on gradients our
  buffers have not reduced yet: that one method is replaced on the instance by a no-op, since
  our optimizer clips by the true global norm (the only method of the engine we replace);
* ``step`` (``:3632``): with fp16 on, the monitor gets ``Train/Samples/loss_scale`` from
  ``optimizer.cur_scale``;
* ``load_checkpoint`` (``:4695``): with fp16 / bf16 on it passes ``load_optimizer_states=`` to
  ``optimizer.load_state_dict``, which our optimizers accept;
* ``communication_data_type`` and the ZeRO checkpoint names: used only by DeepSpeed's own
  reduction and ZeRO, both off on our path.
"""
from __future__ import annotations

from ..config.precision import PrecisionConfig


def _our_optimizer_clips() -> None:
    """Stands in for ``DeepSpeedEngine.clip_fp32_gradients`` on our path (see the module docstring)."""


def report_precision(engine, precision: PrecisionConfig) -> None:
    """Make the engine's precision queries answer with ``precision`` (our path's settings)."""
    config = engine._config
    fp16 = config.float16_config
    fp16.enabled = precision.params_dtype == "fp16"
    if fp16.enabled:
        fp16.loss_scale = precision.loss_scale
        fp16.initial_scale_power = precision.initial_scale_power
        fp16.loss_scale_window = precision.loss_scale_window
        fp16.hysteresis = precision.hysteresis
        fp16.min_loss_scale = precision.min_loss_scale
    config.bfloat16_config.enabled = precision.params_dtype == "bf16"
    config.gradient_clipping = precision.clip_grad
    if precision.params_dtype == "fp32" and precision.clip_grad > 0:
        engine.clip_fp32_gradients = _our_optimizer_clips


__all__ = ["report_precision"]
