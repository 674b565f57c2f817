"""Rotary position embeddings (RoPE), the rotate-half convention of Megatron (non-interleaved) and transformers.

Channel ``i < rot/2`` of a head is paired with channel ``i + rot/2``; the pair
at position ``p`` turns by ``p * base^(-2i/rot)``.  Only the first
``rot = head_dim * rotary_percent`` channels turn, the rest pass through.
The angle table is computed in float32 and cast to the activations' dtype, as
Megatron and transformers both do, so a float64 model reproduces the tables
the checkpoint was trained with bit for bit.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rotary_dim: int, base: float):
        super().__init__()
        self.rotary_dim, self.base = rotary_dim, base
        self._cache: Dict[Tuple[int, torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, seq_len: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, torch.device(device))
        if key not in self._cache:
            inv_freq = 1.0 / (self.base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim))
            angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
            angles = torch.cat((angles, angles), dim=-1).to(device)  # [s, rot]
            self._cache[key] = (angles.cos(), angles.sin())
        return self._cache[key]

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [b, heads, s, d]`` rotated by position: 0..s-1, or ``positions [s]`` (a context-parallel rank's)."""
        if positions is None:
            cos, sin = self._table(x.size(2), x.device)
        else:
            cos, sin = self._table(int(positions.max()) + 1, x.device)
            cos, sin = cos[positions], sin[positions]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return out if rest.size(-1) == 0 else torch.cat((out, rest), dim=-1)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, base={self.base}"
