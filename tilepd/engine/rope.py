"""Rotary position embeddings: cos/sin tables built once (default, linear, llama3, yarn), applied by position."""

from __future__ import annotations

import math
from typing import Any

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = float(s.get("factor") or 1.0)
    orig = int(s.get("original_max_position_embeddings") or max_pos)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)
    mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
    attn = s.get("attention_factor")
    if attn is None:
        attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all else _yarn_mscale(factor)

    def corr(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrap = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv, float(attn)


def rope_inv_freq(dim: int, base: float, scaling: dict[str, Any] | None, max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin multiplier (yarn's attention factor; 1 otherwise)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv, scaling), 1.0
    if kind == "yarn":
        return _yarn(dim, base, scaling, max_pos)
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3, yarn)")


def yarn_softmax_scale(scaling: dict[str, Any] | None) -> float:
    """DeepSeek's extra softmax factor mscale^2 under yarn (1 without scaling)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    m = scaling.get("mscale_all_dim") or 0
    return _yarn_mscale(float(scaling["factor"]), m) ** 2 if m else 1.0


def rope_table(dim: int, base: float, scaling: dict[str, Any] | None, max_pos: int, n: int, device: torch.device,
               dtype: torch.dtype = torch.float32, interleaved: bool = False) -> torch.Tensor:
    """[n, 2, dim] table in the compute dtype: row 0 = cos per channel, row 1 = sin with the rotation's
    sign folded in, laid out for the channel order (half-split for Llama, pairs for DeepSeek). A step then
    applies RoPE as x * cos + swap(x) * sin: three kernels, gathered by position once per step."""
    inv, mult = rope_inv_freq(dim, base, scaling, max_pos)
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    cos, sin = freqs.cos() * mult, freqs.sin() * mult
    if interleaved:
        cos_full = cos.repeat_interleave(2, dim=-1)
        sin_signed = torch.stack([-sin, sin], dim=-1).flatten(-2)
    else:
        cos_full = torch.cat([cos, cos], dim=-1)
        sin_signed = torch.cat([-sin, sin], dim=-1)
    return torch.stack([cos_full, sin_signed], dim=1).to(device=device, dtype=dtype)


def apply_rope_neox(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """Llama/Qwen (rotate-half) RoPE. x [T, H, D]; cs [T, 2, D] from rope_table(interleaved=False)."""
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)
    return torch.addcmul(x * cs[:, None, 0], swapped, cs[:, None, 1])


def apply_rope_interleaved(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """DeepSeek (GPT-J, pairwise) RoPE, output kept interleaved as vLLM's MLA cache holds it.
    x [T, H, D]; cs [T, 2, D] from rope_table(interleaved=True)."""
    t, h, d = x.shape
    swapped = x.reshape(t, h, d // 2, 2).flip(3).view(t, h, d)
    return torch.addcmul(x * cs[:, None, 0], swapped, cs[:, None, 1])
