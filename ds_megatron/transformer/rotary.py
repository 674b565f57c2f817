"""Rotary position embeddings (RoPE), the rotate-half convention of Megatron (non-interleaved) and transformers.

Channel ``i < rot/2`` of a head is paired with channel ``i + rot/2``; the pair
at position ``p`` turns by ``p * inv_freq[i]``, ``inv_freq[i] = base^(-2i/rot)``
for plain RoPE, rescaled by RoPE scaling (``model.rope_scaling_type``): llama3,
yarn or linear, each with the formula of transformers' ``modeling_rope_utils``.
YaRN also multiplies cos and sin by its attention factor.  Only the first
``rot = head_dim * rotary_percent`` channels turn, the rest pass through.

The inverse frequencies and the angle table are computed in float32 with the
same operations in the same order as transformers (so each rounding is the
same) and cast to the activations' dtype, as Megatron and transformers both do:
a float64 model reproduces the tables the checkpoint was trained with bit for bit.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def linear_inv_freq(dim: int, base: float, factor: float) -> torch.Tensor:
    """Position interpolation: every frequency divided by ``factor`` (positions / factor)."""
    return default_inv_freq(dim, base) / factor


def llama3_inv_freq(dim: int, base: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_positions: int) -> torch.Tensor:
    """Llama 3.1: wavelengths above ``original / low_freq_factor`` are divided by ``factor``, those below
    ``original / high_freq_factor`` kept, and the band between blended linearly in ``original / wavelength``."""
    inv_freq = default_inv_freq(dim, base)
    wavelen = 2 * math.pi / inv_freq
    long_wavelen = original_max_positions / low_freq_factor
    short_wavelen = original_max_positions / high_freq_factor
    scaled = torch.where(wavelen > long_wavelen, inv_freq / factor, inv_freq)
    # 0 at the long end of the band, 1 at the short end
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < short_wavelen) * ~(wavelen > long_wavelen)
    return torch.where(in_band, blended, scaled)


def yarn_correction_range(dim: int, base: float, original_max_positions: int, beta_fast: float, beta_slow: float,
                          round_to_int: bool) -> Tuple[float, float]:
    """The channel-pair range over which YaRN ramps from extrapolation (beta_fast rotations over the original
    context) to interpolation (beta_slow rotations)."""
    def pair_index(rotations):  # the pair that turns ``rotations`` times over the original context
        return (dim * math.log(original_max_positions / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, base: float, factor: float, original_max_positions: int, beta_fast: float,
                  beta_slow: float, round_to_int: bool = True) -> torch.Tensor:
    """YaRN (NTK-by-parts): fast pairs keep their frequency, slow pairs are interpolated (divided by ``factor``),
    a linear ramp between."""
    powers = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (factor * powers)
    low, high = yarn_correction_range(dim, base, original_max_positions, beta_fast, beta_slow, round_to_int)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # weight of the unscaled frequency
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """YaRN's scale of cos and sin: ``m(s, mscale) / m(s, mscale_all_dim)``, ``m(s, k) = 0.1 k ln(s) + 1`` (1 for
    s <= 1); mscale 1 and mscale_all_dim 0 give the paper's ``0.1 ln(s) + 1``."""
    def m(k):
        return 1.0 if factor <= 1 else 0.1 * k * math.log(factor) + 1.0

    return float(m(mscale) / m(mscale_all_dim))


def rope_frequencies(config) -> Tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] float32, the factor cos and sin are multiplied by) of a GPTConfig."""
    dim, base, kind = config.rotary_dim, config.rotary_base, config.rope_scaling_type
    if kind is None:
        return default_inv_freq(dim, base), 1.0
    factor = config.rope_scaling_factor
    if kind == "linear":
        return linear_inv_freq(dim, base, factor), 1.0
    if kind == "llama3":
        return llama3_inv_freq(dim, base, factor, config.rope_low_freq_factor, config.rope_high_freq_factor,
                               config.original_max_position_embeddings), 1.0
    if kind == "yarn":
        inv_freq = yarn_inv_freq(dim, base, factor, config.original_max_position_embeddings, config.yarn_beta_fast,
                                 config.yarn_beta_slow, config.yarn_correction_range_round_to_int)
        scale = config.yarn_attention_factor
        if scale is None:
            scale = yarn_attention_factor(factor, config.yarn_mscale, config.yarn_mscale_all_dim)
        return inv_freq, float(scale)
    raise ValueError(f"rope_scaling_type={kind!r}")  # GPTConfig refuses it first


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rotary_dim: int, base: float, inv_freq: Optional[torch.Tensor] = None,
                 attention_factor: float = 1.0):
        super().__init__()
        self.rotary_dim, self.base, self.attention_factor = rotary_dim, base, attention_factor
        self.inv_freq = default_inv_freq(rotary_dim, base) if inv_freq is None else inv_freq.to(torch.float32)
        self._cache: Dict[Tuple[int, torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_config(cls, config) -> "RotaryEmbedding":
        inv_freq, factor = rope_frequencies(config)
        return cls(config.rotary_dim, config.rotary_base, inv_freq, factor)

    def _table(self, seq_len: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, torch.device(device))
        if key not in self._cache:
            angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            angles = torch.cat((angles, angles), dim=-1).to(device)  # [s, rot]
            cos, sin = angles.cos(), angles.sin()
            if self.attention_factor != 1.0:  # YaRN; in float32, before the cast, as transformers
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            self._cache[key] = (cos, sin)
        return self._cache[key]

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [b, heads, s, d]`` rotated by position: 0..s-1, ``positions [s]`` (a context-parallel rank's) or
        ``positions [b, s]`` (each row's own: packed documents, ``PackedSeqParams.local_position_ids``)."""
        if positions is None:
            cos, sin = self._table(x.size(2), x.device)
        else:
            cos, sin = self._table(int(positions.max()) + 1, x.device)
            cos, sin = cos[positions], sin[positions]
            if positions.dim() == 2:  # [b, s, rot] -> [b, 1, s, rot]: every head of a row
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return out if rest.size(-1) == 0 else torch.cat((out, rest), dim=-1)

    def extra_repr(self) -> str:
        extra = "" if self.attention_factor == 1.0 else f", attention_factor={self.attention_factor}"
        return f"rotary_dim={self.rotary_dim}, base={self.base}{extra}"
