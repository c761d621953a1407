"""GGUF's block formats held on formats.py's kernels.

Int4Values: Q4_0 / Q4_1 / Q4_K unpacked (gguf_types.py) and not yet packed, because the parts
of one fused matrix (q, k, v) are packed together once they are all read.

Int8BlockWeight: Q8_0 (w = d q, a scale d per 32 weights) exactly, in its own type: q and d, read
by kvserve's Q8_0 kernel; with kvserve's kernels also Q6_K, whose 6-bit values q - 32 are int8 with
a scale d per 16 weights (its super-block's d times the sub-block's scale, rounded to float16).
Where kvserve's kernels are not built (torch's int8 kernel takes one
scale per row, and requantizing per row adds error: gguf_types.py measures it), each q
is split into two nibbles instead, q = 16 hi + lo with hi in -8..7 and lo in 0..15, so that
    w = hi * 16 d + lo * d = ((hi + 8) - 8) * 16 d + ((lo - 8) * d + 8 d)
is two int4 weights with groups of 32. Interleaved block by block they form one [N, 2K] int4
matrix, and x @ W.T = x2 @ W2.T where x2 repeats each 32-wide block of x. 1.25 bytes a weight
against 1.0 for per-row int8, and measured at one row (2 threads) 1.4 to 2.2 times the int8
kernel's time ([3072, 576]: 56 against 30 us; [49152, 576]: 907 against 650 us; [4096, 4096]:
417 against 189 us): without kvserve's kernels gguf_types.py uses it only for the embedding and
the lm_head.
"""
from __future__ import annotations

import logging

import torch

import torch.nn.functional as F

from kvserve import kernels
from kvserve.config.names import GROUP_SIZES
from kvserve.model.quant.formats import INT4_KERNEL_ROWS, Int4Weight, QuantizedWeight, finish, quantize
from kvserve.model.quant.layouts import unpack_nibbles

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

    def int8_blocks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q [N, K] int8, d [N, K / 32] float32) of the same values as Int8BlockWeight holds them,
        where each group of 32 is d times integers: no zero (Q4_0: q - 8) or a zero of -8 d
        (Q5_0: q - 16), d a float16 value; else None (a min: Q4_1, Q5_1, Q4_K, Q5_K)."""
        q, scale, zero = self.values()
        if self.group_size != QK8 or not torch.equal(scale.half().float(), scale):
            return None
        if zero is not None and not torch.equal(zero, -8 * scale):
            return None
        offset = 8 if zero is None else 16
        return (q.to(torch.int16) - offset).to(torch.int8), scale

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
    """GGUF Q8_0 in its own type: q [N, K] int8 with d [N, K / B] float16 (GGUF's d as it is in
    the file), B = 32; W = q * d per block of B, 1.0625 bytes a weight, the file's. Q6_K's
    sub-blocks are blocks of B = 16 (1.125 bytes a weight against the file's 0.82), with
    kvserve's kernels only. kvserve's kernel (`linear_q8_0`) reads it at every row count up to
    the plan's int4 limit (a few rows: a float GEMV; more: each weight dequantized once into a
    tile, then a register-blocked product), bigger steps dequantize in row blocks. Where
    kvserve's kernels are not built, a B = 32 weight is held as two int4 planes instead (module
    doc) for torch's int4 kernel."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", name: str = "weight"):
        N, K = q.shape
        self.block = K // d.shape[1] if d.dim() == 2 and d.shape[1] else 0
        if (q.dtype != torch.int8 or K % QK8 or self.block not in (QK8, QK8 // 2)
                or tuple(d.shape) != (N, K // self.block)):
            raise ValueError(f"Int8BlockWeight takes q [N, K] int8 (K a multiple of {QK8}) and d [N, K/B], "
                             f"B {QK8} or {QK8 // 2}; got q {tuple(q.shape)} {q.dtype} and d {tuple(d.shape)}.")
        device = torch.device(device)
        self.own_kernel = kernels.available(device)
        if self.block != QK8 and not self.own_kernel:
            raise ValueError(f"{name}: blocks of {self.block} weights need kvserve's kernels, which are not built.")
        # kvserve's own kernel, dequantizing into tiles past a few rows as the int4 one does: the
        # CPU plan's int4 rows (model/quant/cpu_paths.py) say where the dequantize path wins
        self._setup("int4" if self.own_kernel else "int8", (N, K), dtype, device)
        self.q = self.d = self.planes = None
        if self.own_kernel:
            d16 = d.to(torch.float16)
            if not torch.equal(d16.float(), d.float()):
                raise ValueError(f"{name}: Q8_0's d are float16 values (GGUF's); these are not.")
            self.q, self.d = q.contiguous().to(device), d16.contiguous().to(device)
        else:
            self.planes = self._planes(q, d, dtype, device, name)
            self.kernel_max_rows = self.planes.kernel_max_rows

    @staticmethod
    def _planes(q: torch.Tensor, d: torch.Tensor, dtype, device, name) -> Int4Weight:
        N, K = q.shape
        planes = torch.empty(N, K // QK8, 2, QK8, dtype=torch.uint8)       # 0..15 each
        for a in range(0, N, PLANE_ROWS):      # row blocks: no full-size temporaries at load
            b = q[a:a + PLANE_ROWS].view(-1, K // QK8, QK8)
            planes[a:a + PLANE_ROWS, :, 0] = ((b >> 4) + 8).view(torch.uint8)   # q = 16 (q >> 4) + (q & 15)
            planes[a:a + PLANE_ROWS, :, 1] = (b & 15).view(torch.uint8)         # in two's complement
        planes = planes.view(N, 2 * K)
        scale = torch.stack([16 * d, d], dim=-1).view(N, -1)                # [N, 2K / 32]
        zero = torch.stack([torch.zeros_like(d), 8 * d], dim=-1).view(N, -1)
        return Int4Weight(planes, scale, zero, dtype=dtype, device=device, name=name)

    @staticmethod
    def fits(N: int) -> bool:
        """Whether a weight of N rows can be held: kvserve's kernel takes any N; the planes need
        torch's int4 kernel's multiple of INT4_KERNEL_ROWS."""
        return kernels.available("cpu") or N % INT4_KERNEL_ROWS == 0

    @classmethod
    def cat(cls, parts: list["Int8BlockWeight"], dtype: torch.dtype, device) -> "Int8BlockWeight":
        """Row blocks stacked into one weight (fused q, k, v), in the model's dtype and device;
        parts of blocks of 16 and 32 (a Q6_K v beside Q8_0 q, k) in blocks of 16, each d of a
        block of 32 repeated: the same values."""
        qd = [p.values() for p in parts]
        block = min(p.block for p in parts)
        ds = [d.repeat_interleave(q.shape[1] // d.shape[1] // block, dim=1) for q, d in qd]
        return cls(torch.cat([q for q, _ in qd]), torch.cat(ds), dtype, device)

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, K] int8, d [N, K / B] float32) on the CPU."""
        if self.q is not None:
            return self.q.cpu(), self.d.float().cpu()
        w = self.planes
        hi = unpack_nibbles(w.nibbles).view(self.shape[0], -1, 2, QK8).to(torch.int16)     # [N, K/32, 2, 32]
        q = ((hi[:, :, 0] - 8) * 16 + hi[:, :, 1]).to(torch.int8).view(self.shape)
        return q.cpu(), w.scales[:, 0, 1::2].float().cpu()

    def tensors(self):
        return self.planes.tensors() if self.planes is not None else [self.q, self.d]

    def _twice(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, 2K], each block of 32 repeated: one copy per plane."""
        T, nb = x.shape[0], self.shape[1] // QK8            # (named: T may be 0, a chunk that samples nothing)
        return x.view(T, nb, 1, QK8).expand(T, nb, 2, QK8).reshape(T, 2 * self.shape[1])

    def _dense_rows(self, x, start, stop):
        if x.dtype in (torch.float32, torch.bfloat16):      # one pass, each value rounded once
            return F.linear(x, torch.ops.kvserve.dequantize_q8_0(self.q[start:stop], self.d[start:stop], x.dtype))
        return F.linear(x, self._rows_values(self.q[start:stop], self.d[start:stop], x.dtype))

    @staticmethod
    def _rows_values(q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        n, K = q.shape
        return (q.to(dtype).view(n, d.shape[1], -1) * d.to(dtype)[..., None]).view(n, K)

    def gemm_input_dtype(self, rows):
        return self.planes.gemm_input_dtype(rows) if self.planes is not None else super().gemm_input_dtype(rows)

    def linear(self, x, bias=None, gemm_dtype=False):
        if self.planes is not None:
            return self.planes.linear(self._twice(x), bias, gemm_dtype)
        if x.shape[0] <= self.kernel_max_rows:
            y = torch.ops.kvserve.linear_q8_0(x.float(), self.q, self.d)
        else:
            y = self._dense(x)
        return finish(y, x, bias, gemm_dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [T, K] in the model dtype; in float32 exactly q * d."""
        if self.planes is None:
            return self._rows_values(self.q[ids], self.d[ids], self.dtype)
        r = self.planes.rows(ids).view(ids.shape[0], -1, 2, QK8)
        return (r[:, :, 0] + r[:, :, 1]).reshape(ids.shape[0], self.shape[1])

    def dequantize(self) -> torch.Tensor:
        if self.planes is None:
            return self._rows_values(self.q, self.d, torch.float32)
        return self.rows(torch.arange(self.shape[0], device=self.planes.nibbles.device))
