"""Grad scalers against an independent step-by-step model of the seed's algorithm."""
import random

import pytest
import torch

from ds_megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler


class ReferenceScaler:
    """The seed's rule, written out with plain floats: overflows spend hysteresis cumulatively
    (clean steps do not refill it); once spent, every overflow backs off (not below min);
    growth_interval clean steps in a row grow the scale and refill both trackers."""

    def __init__(self, scale, min_scale, growth, backoff, interval, hysteresis):
        self.scale, self.min_scale, self.growth, self.backoff = scale, min_scale, growth, backoff
        self.interval, self.hysteresis = interval, hysteresis
        self.clean_run, self.overflows_left = 0, hysteresis

    def update(self, found_inf):
        if found_inf:
            self.clean_run = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return
        self.clean_run += 1
        if self.clean_run == self.interval:
            self.clean_run, self.overflows_left = 0, self.hysteresis
            self.scale *= self.growth


@pytest.mark.parametrize("hysteresis,interval", [(1, 3), (2, 5), (4, 7)])
def test_dynamic_scaler_follows_the_seed_step_by_step(hysteresis, interval):
    rng = random.Random(hysteresis * 100 + interval)
    args = dict(min_scale=2.0 ** -3, growth_factor=2.0, backoff_factor=0.5, growth_interval=interval,
                hysteresis=hysteresis)
    scaler = DynamicGradScaler(2.0 ** 10, **args)
    ref = ReferenceScaler(2.0 ** 10, 2.0 ** -3, 2.0, 0.5, interval, hysteresis)
    # Phases of different overflow rates: bursts drive the scale to min_scale, calm grows it back.
    backoffs = growths = 0
    for step in range(4000):
        p = (0.05, 0.3, 0.9)[(step // 120) % 3]
        found_inf = rng.random() < p
        before = ref.scale
        scaler.update(found_inf)
        ref.update(found_inf)
        backoffs += ref.scale < before
        growths += ref.scale > before
        assert float(scaler.scale) == ref.scale, step
        assert scaler._hysteresis_tracker == ref.overflows_left and scaler._growth_tracker == ref.clean_run, step
        assert float(scaler.inv_scale) == 1.0 / ref.scale
    assert backoffs > 50 and growths > 50


def test_hysteresis_is_cumulative_and_backoff_stops_at_min_scale():
    s = DynamicGradScaler(8.0, min_scale=2.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2)
    trace = []
    for inf in [True, False, False, True, True, True, False, False, False]:
        s.update(inf)
        trace.append(float(s.scale))
    # overflow (1 of 2), clean, clean, overflow (2 of 2: back off), overflow (back off, hits min), overflow
    # (stays at min), 3 clean: grow.
    assert trace == [8.0, 8.0, 8.0, 4.0, 2.0, 2.0, 2.0, 2.0, 4.0]


def test_state_round_trip_continues_identically():
    rng = random.Random(7)
    seq = [rng.random() < 0.3 for _ in range(300)]
    a = DynamicGradScaler(2.0 ** 16, 1.0, 2.0, 0.5, 4, 2)
    for f in seq[:150]:
        a.update(f)
    b = DynamicGradScaler(1.0, 1.0, 2.0, 0.5, 4, 2)
    b.load_state_dict(a.state_dict())
    for f in seq[150:]:
        a.update(f)
        b.update(f)
        assert float(a.scale) == float(b.scale)
        assert a.state_dict()["growth_tracker"] == b.state_dict()["growth_tracker"]
    c = ConstantGradScaler(128.0)
    c.update(True)
    d = ConstantGradScaler(1.0)
    d.load_state_dict(c.state_dict())
    assert float(d.scale) == 128.0 and float(d.inv_scale) == 1 / 128


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="min_scale"):
        DynamicGradScaler(1.0, 2.0, 2.0, 0.5, 10, 1)
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicGradScaler(4.0, 1.0, 2.0, 1.5, 10, 1)
    with pytest.raises(ValueError, match="initial_scale"):
        ConstantGradScaler(0.0)
    assert DynamicGradScaler(4.0, 1.0, 2.0, 0.5, 1, 1).scale.dtype == torch.float32
