"""Building blocks of the Llama family: RMSNorm, rotary position embedding (RoPE), SwiGLU / GeGLU."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvserve import kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * w / sqrt(mean(x^2) + eps), normalised in float32 like the reference models
    (one fused kernel; in float32 it equals transformers' formula bit for bit). bfloat16 rows
    on the CPU: kvserve's op, the same arithmetic in one pass (4x torch's five ops at 2,048 x 576)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if _cpu_rows(x) and weight.dtype == torch.bfloat16 and weight.dim() == 1:
        return torch.ops.kvserve.rms_norm_bf16(x.view(-1, x.shape[-1]), weight, eps).view(x.shape)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): a residual branch added to the stream and the next
    norm of it. bfloat16 or float32 rows on the CPU: one pass of kvserve's op (bfloat16: torch's
    add and `rms_norm`'s arithmetic, bit for bit; float32: the add bit for bit, the norm the fused
    decode step's, its sum of squares in another order than torch's: a few ulp. torch's add, pow,
    sum and muls took 13% of the default model's prefill); otherwise the two torch calls."""
    if (_cpu_rows(x, _ROW_DTYPES) and _cpu_rows(delta, _ROW_DTYPES) and delta.dtype == weight.dtype == x.dtype
            and weight.dim() == 1):
        s, h = torch.ops.kvserve.add_rms_norm(x.view(-1, x.shape[-1]), delta.view(-1, x.shape[-1]), weight, eps)
        return s.view(x.shape), h.view(x.shape)
    x = x + delta
    return x, rms_norm(x, weight, eps)


_ROW_DTYPES = (torch.bfloat16, torch.float32)


def _cpu_rows(x: torch.Tensor, dtypes: tuple = (torch.bfloat16,)) -> bool:
    """x is contiguous, of one of `dtypes`, on the CPU, and kvserve's kernels run here (their row
    ops take it)."""
    return x.dtype in dtypes and x.device.type == "cpu" and x.is_contiguous() and kernels.available()


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
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; kvserve supports 'llama3', 'linear', "
                     "'yarn', 'longrope' and 'freq_factors'.")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_factors(scaling: dict, max_positions: int | None = None) -> tuple[float, float]:
    """(factor, attention factor) of a "yarn" rope_scaling, as transformers reads them: the
    attention factor multiplies cos and sin; with mscale and mscale_all_dim it is their ratio
    (DeepSeek-V2, whose softmax scale takes mscale_all_dim's share: model/deepseek.py)."""
    factor = scaling.get("factor") or max_positions / scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor))
    return float(factor), float(attention)


def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (NTK-by-parts): frequencies that turn fewer than beta_slow times over the original
    context are interpolated (divided by `factor`), those that turn more than beta_fast times
    kept, a linear ramp between."""
    factor, _ = yarn_factors(scaling, scaling.get("max_position_embeddings"))
    orig = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations):        # the dim whose frequency turns `rotations` times over `orig`
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    extrapolated = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    interpolated = extrapolated / factor
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low))
    keep = 1 - ramp.clamp(0, 1)
    return interpolated * (1 - keep) + extrapolated * keep


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [max_positions, head_dim] for the rotate_half convention:
    cos = [cos, cos], sin = [-sin, sin], so that rope(x) = x * cos + roll(x, d/2) * sin."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq.float())          # [P, head_dim/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rope_tables(dim: int, theta: float, scaling: dict | None,
                max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and signed sin tables [max_positions, dim] of `rope_cos_sin` for a RoPE over `dim`
    dims (a head's, or its rotary part), `scaling` applied. LongRoPE (Phi-3) is two sets of
    frequencies: short_factor's for positions below original_max_position_embeddings, long_factor's
    from there on, both tables times the attention factor, as transformers scales cos and sin.
    The switch is by position (a token's keys never change once cached); it is transformers'
    choice for every token generated one at a time, while transformers rotates a whole prompt
    longer than original_max_position_embeddings with long_factor (kvserve: its positions below
    that with short_factor)."""
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        cos, sin = rope_cos_sin(rope_inv_freq(dim, theta, scaling), max_positions)
        _, attention = yarn_factors(scaling, scaling.get("max_position_embeddings"))
        return cos * attention, sin * attention
    if kind != "longrope":
        return rope_cos_sin(rope_inv_freq(dim, theta, scaling), max_positions)
    orig = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    tables = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        if ext.numel() != dim // 2:
            raise ValueError(f"rope_scaling {key} holds {ext.numel()} factors; the rotary dim {dim} "
                             f"needs {dim // 2}.")
        tables.append(rope_cos_sin(1.0 / (ext * theta ** exponents), max_positions))
    (short_cos, short_sin), (long_cos, long_sin) = tables
    use_long = (torch.arange(max_positions) >= orig).unsqueeze(1)
    return (torch.where(use_long, long_cos, short_cos) * attention,
            torch.where(use_long, long_sin, short_sin) * attention)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (j, j + d/2) of every head. x [T, heads, d]; cos, sin [T, 1, d] from
    `rope_cos_sin`. roll(x, d/2) = [x2, x1]; times [-sin, sin] it is rotate_half(x) * sin.
    bfloat16 or float32 heads on the CPU: kvserve's op, one pass rounding where these torch ops
    round, bit for bit (a prefill step spent 8% of its time in them: mul, roll's cat, addcmul)."""
    if (x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu" and x.dim() == 3 and x.stride(-1) == 1
            and (x.shape[1] == 1 or x.stride(1) == x.shape[2]) and cos.dtype == sin.dtype == x.dtype
            and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2]) and kernels.available()):
        return torch.ops.kvserve.rope(x, cos.view(x.shape[0], -1), sin.view(x.shape[0], -1))
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (2j, 2j + 1) of every head (GPT-J's layout; DeepSeek-V2's, and
    llama.cpp's "normal" RoPE). x [T, heads, d]; cos, sin [T, 1, d/2] (`rope_cos_sin`'s first half)."""
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)                       # [T, heads, d/2] each
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def swiglu(gate_up: torch.Tensor, dtype: torch.dtype | None = None, store: torch.dtype | None = None) -> torch.Tensor:
    """silu(gate) * up, from the fused [T, 2I] projection, computed in `dtype` (default gate_up's: a
    float32 model hands its big steps' bfloat16 GEMM output over as it is, `linear(...,
    gemm_dtype=True)`) and stored in `store` (default `dtype`: the next GEMM's input dtype, so a
    float32 result its bfloat16 GEMM would round anyway is rounded here, once). On the CPU
    kvserve's op, one pass: bfloat16 rows rounding as torch's two ops do; float32 rows (and
    bfloat16 ones into float32: their exact values, without a float32 copy of [T, 2I]) within a
    few ulp of torch (its exp is a polynomial, ~2 ulp: the fused decode step's SwiGLU, so prefill
    and decode agree)."""
    dtype = dtype or gate_up.dtype
    store = store or dtype
    if gate_up.dim() == 2 and _cpu_rows(gate_up, _ROW_DTYPES):
        if dtype == store == gate_up.dtype:
            return torch.ops.kvserve.silu_mul(gate_up, None)
        if dtype == torch.float32 and gate_up.dtype == torch.bfloat16 and store in _ROW_DTYPES:
            return torch.ops.kvserve.silu_mul(gate_up, store)
    gate, up = gate_up.to(dtype).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(store)


def geglu_tanh(gate_up: torch.Tensor, dtype: torch.dtype | None = None, store: torch.dtype | None = None) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's MLP), from the fused [T, 2I] projection, in `dtype`, stored in `store`."""
    gate, up = gate_up.to(dtype or gate_up.dtype).chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(store or dtype or gate_up.dtype)


GATED_ACTIVATIONS = {"silu": swiglu, "swish": swiglu, "gelu_pytorch_tanh": geglu_tanh}


def gated_activation(name: str):
    """The MLP's act(gate) * up for config.json's hidden_act; ValueError for one kvserve lacks."""
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"unsupported MLP activation {name!r}; kvserve runs {', '.join(GATED_ACTIVATIONS)}.")
    return GATED_ACTIVATIONS[name]
