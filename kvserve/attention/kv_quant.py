"""KV-cache quantization: one byte per K/V element plus one scale per token and KV head
(seed 000 / seed 003: the KV cache bounds the batch, so a smaller cache holds more tokens;
int8 or fp8 holds about 2x the tokens of bf16, 4x of float32).

`kv_cache_dtype` uses vLLM's names: "auto" (the model dtype, no scales; worker/build.py decides
it before here), "float32" (a float32 model's), "bfloat16" (a float32 model's K/V rounded to
bfloat16 as they are written: half the bytes, no scales), "int8" (symmetric,
scale = amax / 127), "fp8_e4m3" / "fp8_e5m2" (scale = amax / the format's max). Each token's
K / V row of one KV head is quantized once, when it is written into its slot, so a sequence's
cache content never depends on how its prompt was chunked or batched.

A quantized layer cache is a pair (values [num_blocks, KV, block_size, D] int8 / float8,
scales [num_blocks, KV, block_size] float32); an "auto" cache is a plain tensor. `cache_tensors`
lists the tensors of either so that block copies and swaps move them all generically.
"""
from __future__ import annotations

import torch

STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QMAX = {"int8": 127.0, "fp8_e4m3": torch.finfo(torch.float8_e4m3fn).max,
        "fp8_e5m2": torch.finfo(torch.float8_e5m2).max}
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
TINY = 1e-12                     # floor of a scale, so an all-zero row divides cleanly


def is_quantized(name: str) -> bool:
    """A cache of values and scales (int8, fp8); "auto", "float32" and "bfloat16" are plain tensors."""
    return name in STORAGE


def plain_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """A plain cache's dtype: the model's ("auto"), or the one named (float32 only for a float32
    model: worker/build.py refuses it for another)."""
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(name, model_dtype)


def bytes_per_token_head(name: str, head_dim: int, model_dtype: torch.dtype) -> int:
    """Bytes one token's K (or V) row of one KV head takes: D elements, plus a scale if quantized."""
    if not is_quantized(name):
        return head_dim * torch.empty((), dtype=plain_dtype(name, model_dtype)).element_size()
    return head_dim + SCALE_BYTES


def allocate(shape: tuple[int, ...], name: str, model_dtype: torch.dtype, device,
             pin_memory: bool = False, zeros: bool = True):
    """One layer's K (or V) pool: a tensor of `shape`, or (values of `shape`, scales shape[:-1])."""
    make = torch.zeros if zeros else torch.empty
    if not is_quantized(name):
        return make(shape, dtype=plain_dtype(name, model_dtype), device=device, pin_memory=pin_memory)
    return (make(shape, dtype=STORAGE[name], device=device, pin_memory=pin_memory),
            make(shape[:-1], dtype=SCALE_DTYPE, device=device, pin_memory=pin_memory))


def cache_tensors(cache) -> list[torch.Tensor]:
    """The tensors of one pool, float8 viewed as bytes (CPU index_copy_ has no float8 kernel)."""
    parts = list(cache) if isinstance(cache, tuple) else [cache]
    return [t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
            for t in parts]


def quantize(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, KV, D] -> (values [T, KV, D] in the storage dtype, scales [T, KV] float32):
    x ~= values * scale, scale = amax over D / qmax."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / QMAX[name]).clamp_min(TINY)          # [T, KV]
    y = xf / scale.unsqueeze(-1)
    if name == "int8":
        y = y.round().clamp_(-127, 127)
    return y.to(STORAGE[name]), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D], scales [...] -> values * scales in `dtype`."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)
