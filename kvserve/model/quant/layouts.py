"""The bit layouts kvserve's kernels read a quantized weight in (kvserve/kernels/csrc): int4 as
nibbles, two weights a byte, and int5 (GGUF's Q5 types) as those nibbles plus a plane of fifth
bits. formats.Int4Weight holds both."""
from __future__ import annotations

import torch


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 (K even) -> kvserve's int4 layout [N, K/2] uint8: q[:, 2k] in the low
    nibble of byte k, q[:, 2k + 1] in the high one."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> q [N, K] uint8 in 0..15 (pack_nibbles undone)."""
    return torch.stack([nibbles & 15, nibbles >> 4], dim=-1).view(nibbles.shape[0], -1)


def pack_high(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..31 (K a multiple of 32) -> the fifth bits [N, K/8] uint8 as kvserve's
    kernels read them: per 32 weights a little-endian 32-bit word whose bit i is weight 2i's
    (i < 16) or weight 2(i - 16) + 1's: the order the kernels take a block's weights in."""
    N, K = q.shape
    b = (q.to(torch.uint8) >> 4).view(N, K // 32, 32)
    ordered = torch.cat([b[..., 0::2], b[..., 1::2]], dim=-1).view(N, K // 8, 8)
    return (ordered << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def unpack_high(high: torch.Tensor) -> torch.Tensor:
    """[N, K/8] fifth bits -> [N, K] uint8, 16 where a weight's bit is set (pack_high undone)."""
    N = high.shape[0]
    bits = ((high[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).view(N, -1, 2, 16)
    return (bits.transpose(2, 3).reshape(N, -1) * 16).to(torch.uint8)
