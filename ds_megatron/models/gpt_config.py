"""``GPTConfig``: the ``megatron.model`` section of a job (pure Python, checked before launch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import ConfigError


@dataclass
class GPTConfig:
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden_size
    seq_length: int = 128
    vocab_size: int = 257
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    make_vocab_size_divisible_by: int = 128
    sequence_parallel: bool = False
    label_smoothing: float = 0.0

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                     "vocab_size", "make_vocab_size_divisible_by"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model.{name} must be a positive integer, got {v!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"model.hidden_size={self.hidden_size} is not divisible by "
                              f"model.num_attention_heads={self.num_attention_heads}; pick sizes that divide")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(self, name)!r}")

    def check_tensor_parallel(self, tp: int) -> None:
        for name in ("num_attention_heads", "ffn_hidden_size"):
            if getattr(self, name) % tp:
                raise ConfigError(f"model.{name}={getattr(self, name)} is not divisible by "
                                  f"tensor_model_parallel_size={tp}; choose a TP size that divides it")
        if self.sequence_parallel and self.seq_length % tp:
            raise ConfigError(f"model.seq_length={self.seq_length} is not divisible by tensor_model_parallel_size={tp}, "
                              "which sequence parallelism needs")
