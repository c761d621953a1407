"""Building blocks of the Llama family: RMSNorm, rotary position embedding (RoPE), SwiGLU."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * w / sqrt(mean(x^2) + eps), normalised in float32 like the reference models
    (one fused kernel; in float32 it equals transformers' formula bit for bit)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies theta^(-2j/d), with Llama-3, linear or per-frequency (`freq_factors`,
    from GGUF) `rope_scaling` applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return (inv_freq / factor).float()
    if kind == "freq_factors":   # GGUF's rope_freqs tensor: one divisor per frequency
        return (inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)).float()
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    raise ValueError(f"unsupported rope_scaling type {kind!r}; kvserve supports 'llama3', 'linear' "
                     "and 'freq_factors'.")


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [max_positions, head_dim] for the rotate_half convention:
    cos = [cos, cos], sin = [-sin, sin], so that rope(x) = x * cos + roll(x, d/2) * sin."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq.float())          # [P, head_dim/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (j, j + d/2) of every head. x [T, heads, d]; cos, sin [T, 1, d] from
    `rope_cos_sin`. roll(x, d/2) = [x2, x1]; times [-sin, sin] it is rotate_half(x) * sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, from the fused [T, 2I] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
