"""``ConfigError`` (and ``ConvertError``) and the small checks that raise them (no imports: every module may use them).

A config error is one sentence naming the field, the value and the fix; it is a
``ValueError`` so that callers catching bad values catch it too.
"""
from __future__ import annotations

from typing import Any, Sequence


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and the fix."""


def check_positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1 (bools are not ints here), else a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_choice(name: str, value: Any, allowed: Sequence[Any]) -> Any:
    """``value`` if it is one of ``allowed``, else a ConfigError listing them."""
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is unknown; use one of {', '.join(map(repr, allowed))}")
    return value


class ConvertError(ConfigError):
    """A checkpoint or config that cannot be converted exactly (one line: the file, the field or tensor, the fix)."""


class NonFiniteLossError(RuntimeError):
    """The training loss stayed non-finite (or, outside fp16 loss scaling, every update was skipped for
    non-finite gradients) for ``megatron.train.max_consecutive_nonfinite_steps`` steps: the job stops
    with ``exit_code`` instead of reporting success."""

    exit_code = 3
