"""Loss scalers for fp16 training: Megatron's ``ConstantGradScaler`` and ``DynamicGradScaler``.

The loss is multiplied by ``scale`` before backward so that small gradients
survive fp16; the optimizer multiplies the gradients by ``inv_scale`` before
using them and calls ``update(found_inf)`` once per step.

``DynamicGradScaler`` follows Megatron's rule exactly:

* an overflow resets the growth tracker and spends one unit of hysteresis;
  once the hysteresis is spent (tracker <= 0) this and every further overflow
  backs the scale off by ``backoff_factor``, never below ``min_scale``.  The
  hysteresis is *not* refilled by clean steps or by a backoff: overflows are
  counted cumulatively until the next growth;
* ``growth_interval`` consecutive clean steps multiply the scale by
  ``growth_factor`` and reset both trackers (hysteresis refilled).

The scale is a one-element fp32 tensor on the parameters' device, so the
unscale kernel reads it without a host round trip.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, Optional, Union

import torch

Device = Optional[Union[str, torch.device]]


class MegatronGradScaler(ABC):
    """A loss scale held as a one-element fp32 tensor."""

    def __init__(self, initial_scale: float, device: Device = None):
        if not initial_scale > 0.0:
            raise ValueError(f"initial_scale must be > 0, got {initial_scale}")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        # The reciprocal in float64 so that 1/2^k stays exact before rounding to fp32.
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool) -> None: ...

    @abstractmethod
    def state_dict(self) -> Dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None: ...


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (``"fp16": {"loss_scale": S}`` with S > 0): ``update`` changes nothing."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self._scale.clone()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._scale = state_dict["scale"].to(device=self._scale.device, dtype=torch.float32).clone()


class DynamicGradScaler(MegatronGradScaler):
    """Grows the scale after ``growth_interval`` clean steps, backs off after ``hysteresis`` overflows."""

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float, backoff_factor: float,
                 growth_interval: int, hysteresis: int, device: Device = None):
        super().__init__(initial_scale, device)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"min_scale must be in (0, initial_scale={initial_scale}], got {min_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32, device=device)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float32, device=device)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float32, device=device)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self._scale.clone(), "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._scale = state_dict["scale"].to(device=self._scale.device, dtype=torch.float32).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
