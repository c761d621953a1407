"""GGUF's block formats held on formats.py's kernels.

Int4Values: Q4_0 / Q4_1 / Q4_K unpacked (gguf_types.py) and not yet packed, because the parts
of one fused matrix (q, k, v) are packed together once they are all read.

Int8BlockWeight: Q8_0 (w = d q, a scale d per 32 weights) exactly. The int8 kernel takes one
scale per row, and requantizing per row adds error (gguf_types.py measures it); instead each q
is split into two nibbles, q = 16 hi + lo with hi in -8..7 and lo in 0..15, so that
    w = hi * 16 d + lo * d = ((hi + 8) - 8) * 16 d + ((lo - 8) * d + 8 d)
is two int4 weights with groups of 32. Interleaved block by block they form one [N, 2K] int4
matrix, and x @ W.T = x2 @ W2.T where x2 repeats each 32-wide block of x. 1.25 bytes a weight
against 1.0 for per-row int8, and measured at one row (2 threads) 1.4 to 2.2 times the int8
kernel's time ([3072, 576]: 56 against 30 us; [49152, 576]: 907 against 650 us; [4096, 4096]:
417 against 189 us): gguf_types.py uses it only for the embedding and the lm_head.
"""
from __future__ import annotations

import logging

import torch

from kvserve.config.names import GROUP_SIZES
from kvserve.model.quant.formats import INT4_KERNEL_ROWS, Int4Weight, QuantizedWeight, quantize

logger = logging.getLogger(__name__)

QK8 = 32     # weights per Q8_0 block
PLANE_ROWS = 4096   # rows split into int4 planes at a time


class Int4Values:
    """Int4 weights not yet packed: q [N, K] uint8 in 0..15, scale and zero [N, K / G] float32
    (zero None: 0); W = (q - 8) * scale + zero. A GGUF file's Q4 tensors load as this, to be
    fused (q, k, v; gate, up) before they are packed.
    `Int4Values.lazy` decodes the values only when they are fused or packed, and keeps nothing:
    unpacked (1.25 bytes a weight), a whole model waiting to be fused would be its biggest
    transient at load."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None):
        self._values, self._load = (q, scale, zero), None
        self.shape = tuple(q.shape)
        self.group_size = q.shape[1] // scale.shape[1]

    @classmethod
    def lazy(cls, load, shape: tuple[int, int], group_size: int) -> "Int4Values":
        """Values that `load()` -> (q, scale, zero) decodes afresh on each use."""
        self = cls.__new__(cls)
        self._values, self._load = None, load
        self.shape, self.group_size = tuple(shape), group_size
        return self

    def values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q, scale, zero); a lazy one decodes them on every call, so read them once."""
        return self._values if self._load is None else self._load()

    @classmethod
    def cat(cls, parts: list["Int4Values"]) -> "Int4Values":
        values = [p.values() for p in parts]
        zeros = None
        if any(z is not None for _, _, z in values):
            zeros = torch.cat([torch.zeros_like(s) if z is None else z for _, s, z in values])
        return cls(torch.cat([q for q, _, _ in values]), torch.cat([s for _, s, _ in values]), zeros)

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32, each weight (q - 8) * scale + zero in one float32 rounding."""
        N, K = self.shape
        q, scale, zero = self.values()
        w = (q.float().view(N, -1, self.group_size) - 8) * scale[..., None]
        return (w if zero is None else w + zero[..., None]).view(N, K)

    def pack(self, dtype: torch.dtype, device, name: str = "weight") -> QuantizedWeight:
        """An Int4Weight, or where its groups are not the int4 kernel's, int8 from the values
        (as `quantize` falls back)."""
        N, K = self.shape
        if self.group_size in GROUP_SIZES:
            return Int4Weight(*self.values(), dtype=dtype, device=device, name=name)
        logger.info("%s [%d, %d] has int4 groups of %d; stored as int8", name, N, K, self.group_size)
        return quantize(self.dequantize(), "int8", None, dtype, device, name)


class Int8BlockWeight(QuantizedWeight):
    """q [N, K] int8 with d [N, K / 32]: W = q * d per block, as two int4 planes (module doc) in
    one Int4Weight [N, 2K]. N must be a multiple of INT4_KERNEL_ROWS (`fits`)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", name: str = "weight"):
        N, K = q.shape
        planes = torch.empty(N, K // QK8, 2, QK8, dtype=torch.uint8)       # 0..15 each
        for a in range(0, N, PLANE_ROWS):      # row blocks: no full-size temporaries at load
            b = q[a:a + PLANE_ROWS].view(-1, K // QK8, QK8)
            planes[a:a + PLANE_ROWS, :, 0] = ((b >> 4) + 8).view(torch.uint8)   # q = 16 (q >> 4) + (q & 15)
            planes[a:a + PLANE_ROWS, :, 1] = (b & 15).view(torch.uint8)         # in two's complement
        planes = planes.view(N, 2 * K)
        scale = torch.stack([16 * d, d], dim=-1).view(N, -1)                # [N, 2K / 32]
        zero = torch.stack([torch.zeros_like(d), 8 * d], dim=-1).view(N, -1)
        self.planes = Int4Weight(planes, scale, zero, dtype=dtype, device=device, name=name)
        self._setup("int4", (N, K), dtype, torch.device(device))

    @staticmethod
    def fits(N: int) -> bool:
        return N % INT4_KERNEL_ROWS == 0

    def tensors(self):
        return self.planes.tensors()

    def _twice(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, 2K], each block of 32 repeated: one copy per plane."""
        T, nb = x.shape[0], self.shape[1] // QK8            # (named: T may be 0, a chunk that samples nothing)
        return x.view(T, nb, 1, QK8).expand(T, nb, 2, QK8).reshape(T, 2 * self.shape[1])

    def linear(self, x, bias=None):
        return self.planes.linear(self._twice(x), bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [T, K] in the model dtype; in float32 exactly q * d (d as stored)."""
        r = self.planes.rows(ids).view(ids.shape[0], -1, 2, QK8)
        return (r[:, :, 0] + r[:, :, 1]).reshape(ids.shape[0], self.shape[1])

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0], device=self.planes.nibbles.device))
