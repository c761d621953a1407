"""Weight-only quantization, executed quantized (seed 000: quantization reads fewer bytes per token).

A decode step multiplies a few activation rows by every weight matrix, so its time is the bytes
of weight it reads. The linear weights are stored as int8 (1 byte a weight) or int4 (half a byte;
int5 a fifth bit more) plus scales, stay that way in memory, and run through kernels that read the
quantized bytes and scale inside the matmul (kvserve's; where those are not built, torch's
`_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` on bfloat16 activations, float32 ones
measured 4-59x slower there: benchmarks/results/cpu_paths_f32_activations.json):

  int8: per output channel, symmetric   w[n, k] ~ q[n, k] * scale[n]        q in -128..127
  int4: groups of G along K (32..256)   w[n, k] ~ (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G]

The scales are bfloat16 on the CPU on every capability, so a weight holds the same values
everywhere. Other devices (CUDA) have no kernel of kvserve's: quantized weights there are refused
with a ValueError naming the fix (cpu_paths.refuse_off_cpu), not dequantized per call.

Which path a step takes is cpu_paths.kernel_plan()'s, by CPU capability (measured there):
  int8: at most `int8_kernel_max_rows` rows (decode batches) run the weight-only kernel; a bigger
        step dequantizes (below). With `use_w8a8()` (`quantize_activations=True`) a step of more
        than `w8a8_min_rows` rows quantizes the activations too, per row
        (symmetric int8; llama.cpp's Q8_0 matmuls quantize theirs in blocks of 32) and runs the
        integer GEMM `torch._int_mm`, `W8A8_ROWS` rows at a time, scaling the int32 sums in
        float32, at a measured cost in perplexity (docs/models/quantization.md).
  int4: at most `int4_kernel_max_rows` rows run the kernel.
A bigger step (prefill, big batches) dequantizes the weight for that one call and runs the dense
GEMM in the plan's `dense_dtype` (bfloat16 where the CPU has bf16 instructions, else float32),
compute-bound there, so the dequantization is paid once for many rows (`gemm_input_dtype`: the
dtype x is rounded to for it). No dequantized copy is kept, except where the plan is `float_resident`.

kvserve owns the values: int8 keeps q [N, K], int4 its nibbles and int5 also its fifth bits
(layouts.py) with (scale, zero) per row and group, nothing more; torch's int4 kernel, where it
runs, reads a packed copy of its own (never read back).

int4 needs K to be a multiple of the group; a matrix that is not (stories260K's 172-wide MLP)
is stored as int8. torch's int4 kernel takes N a multiple of 16 and its int8 one K a multiple of
32 (others crash or misread, torch 2.13): other shapes take the dequantize path, with one warning.
Embeddings stay in the model dtype (a lookup reads a few rows); an untied lm_head is quantized like
the layers (at one row the int8 kernel reads a 32000 x 768 lm_head in 337 us against 2238 us for
bfloat16). A GGUF file's quantized weights (gguf_types.py) keep their format, the embedding too.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.config.names import GROUP_SIZES, QUANTIZATION_METHODS as METHODS
from kvserve.model.quant.cpu_paths import kernel_plan, refuse_off_cpu, warn_once
from kvserve.model.quant.layouts import pack_high, pack_nibbles, unpack_high, unpack_nibbles  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

ROW_BLOCK = 64                        # rows dequantized (and packed) together: DEQUANT_CHUNK's unit
CPU_SCALE_DTYPE = torch.bfloat16      # the kernels' activation and scale dtype on the CPU
INT4_KERNEL_ROWS = 16                 # the int4 kernel takes out_features in multiples of this

# One torch._int_mm over 2048 rows was nearly 4x slower than the same rows in blocks (42.6 against
# 11.2 ms on 4096x768, AVX-512 VNNI), hence W8A8 in blocks of W8A8_ROWS rows written into one output.
W8A8_ROWS = 128
# Weights dequantized at a time on the dequantize path, in row blocks, so that the transient
# stays small enough for the allocator to reuse: glibc maps anything over 32 MB afresh, and
# the 32000 x 768 lm_head at 64 rows took 21.6 ms whole against 5.3 ms in 3M-weight blocks.
DEQUANT_CHUNK = 3 << 20


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 `x` stored in `dtype`, rounded toward +inf: a stored scale is never smaller than
    the exact one, so |w| / scale stays within the level range and the error within scale / 2."""
    y = x.to(dtype)
    up = torch.nextafter(y, torch.full_like(y, float("inf")))
    return torch.where(y.double() < x, up, y).clamp_min(torch.finfo(dtype).tiny)


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int8, scale [N] in `scale_dtype`). scale = max|w[n]| / 127.5, so
    |w / scale| <= 127.5: rounding and clamping to -128..127 moves a weight by <= scale / 2."""
    w = w.float()
    scale = _round_up(w.abs().amax(dim=1).double() / 127.5, scale_dtype)    # [N]
    q = torch.round(w / scale.float()[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int,
                  scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] uint8 in 0..15, scale [N, K // G] in `scale_dtype`), symmetric per group
    (zero point 0): scale = max|group| / 7.5 and q - 8 in -8..7, error <= scale / 2."""
    N, K = w.shape
    g = w.float().view(N, K // group_size, group_size)
    scale = _round_up(g.abs().amax(dim=-1).double() / 7.5, scale_dtype)     # [N, K/G]
    q = torch.round(g / scale.float()[..., None]).clamp(-8, 7) + 8
    return q.to(torch.uint8).view(N, K), scale


class QuantizedWeight:
    """A linear layer's weight [N, K] kept quantized. `linear(x)` = x @ W.T + bias on the
    quantized bytes for steps of <= `kernel_max_rows` rows, else through a per-call dequantize."""

    shape: tuple[int, int]
    dtype: torch.dtype                  # the model's: activations in, result out
    compute_dtype: torch.dtype          # the kernel's and the scales': bfloat16 on the CPU
    dense_dtype: torch.dtype            # the dequantize path's GEMM (cpu_paths.KernelPlan)
    kernel_max_rows: int                # -1: never the kernel

    def _setup(self, method: str, shape, dtype: torch.dtype, device: torch.device, why_not: str | None = None):
        """`why_not`: the reason this weight's shape cannot take the kernel (one warning), or None."""
        self.shape, self.dtype = tuple(shape), dtype
        refuse_off_cpu(method, device)
        plan = kernel_plan()
        self.compute_dtype, self.dense_dtype = CPU_SCALE_DTYPE, plan.dense_dtype
        self.kernel_max_rows = getattr(plan, f"{method}_kernel_max_rows")
        if why_not is not None and self.kernel_max_rows >= 0:
            warn_once("%s weights of shape %s: %s; they run on the dequantize path (exact, slower at "
                      "decode)", method, list(shape), why_not)
            self.kernel_max_rows = -1

    def gemm_input_dtype(self, rows: int) -> torch.dtype | None:
        """The dtype `linear` rounds an x of `rows` rows to for its GEMM (the dequantize path's:
        its producer may hand x over in it, rounded once), or None: x goes in as it is."""
        return self.dense_dtype if rows > self.kernel_max_rows else None

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] @ W.T -> [T, N] in the dense dtype, W dequantized about DEQUANT_CHUNK weights
        at a time."""
        N, K = self.shape
        x = x.to(self.dense_dtype)
        step = max(ROW_BLOCK, DEQUANT_CHUNK // K // ROW_BLOCK * ROW_BLOCK)
        if step >= N:
            return self._dense_rows(x, 0, N)
        return torch.cat([self._dense_rows(x, a, min(a + step, N)) for a in range(0, N, step)], dim=1)

    def _dense_rows(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, gemm_dtype: bool = False) -> torch.Tensor:
        """x [T, K] @ W.T + bias [T, N] in x's dtype; `gemm_dtype` (no bias): the same values in the
        dtype the path computed (a float32 model's big steps: their bfloat16 GEMM's, layers.swiglu)."""
        raise NotImplementedError


def finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gemm_dtype: bool) -> torch.Tensor:
    """A quantized linear's result y in x's dtype (or as it is: QuantizedWeight.linear), plus bias."""
    y = y if gemm_dtype and bias is None else y.to(x.dtype)
    return y if bias is None else y + bias


class Int8Weight(QuantizedWeight):
    """Per-output-channel int8: q [N, K] int8, scale [N]; W = q * scale[:, None].
    GGUF Q8_0 blocks of one row share a scale per 32 weights: requantize them per row first."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"Int8Weight takes q [N, K] int8 and scale [N]; got q {tuple(q.shape)} "
                             f"{q.dtype} and scale {tuple(scale.shape)}.")
        device = torch.device(device)
        # The kernel reads K in vector-width steps; other widths crash or misread (torch 2.13).
        self._setup("int8", q.shape, dtype, device,
                    None if q.shape[1] % 32 == 0 else "the int8 kernel needs in_features divisible by 32")
        self.q = q.contiguous().to(device)
        self.scale = scale.to(device=device, dtype=self.compute_dtype)
        self.w8a8 = False                           # more rows than the kernel's: W8A8 (use_w8a8)
        self.own_kernel = kernels.available(device)  # kvserve's GEMV for <= kernels.KERNEL_ROWS rows

    @classmethod
    def cat(cls, parts: list["Int8Weight"], dtype: torch.dtype, device) -> "Int8Weight":
        """Row blocks stacked into one weight (fused q, k, v), in the model's dtype and device."""
        return cls(torch.cat([p.q.cpu() for p in parts]), torch.cat([p.scale.float().cpu() for p in parts]),
                   dtype=dtype, device=device)

    def tensors(self):
        return [self.q, self.scale]

    def dequantize(self) -> torch.Tensor:
        return self.q.to(self.compute_dtype) * self.scale[:, None]          # [N, K]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [T, K] in the model dtype (an embedding lookup)."""
        return (self.q[ids].to(self.dtype) * self.scale[ids, None].to(self.dtype))

    def _dense_rows(self, x, start, stop):
        # The per-channel scale commutes with the GEMM: one pass over q, not two.
        return F.linear(x, self.q[start:stop].to(x.dtype)) * self.scale[start:stop].to(x.dtype)

    def gemm_input_dtype(self, rows):
        return None if self.w8a8 else super().gemm_input_dtype(rows)

    def use_w8a8(self) -> None:
        """Steps of more than the plan's w8a8_min_rows rows quantize the activations (the CPU only)."""
        if self.q.device.type == "cpu":
            self.w8a8 = True
            self.kernel_max_rows = min(self.kernel_max_rows, kernel_plan().w8a8_min_rows)

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N] float32: x quantized per row to int8, an int32 GEMM, both scales."""
        xf = x.float()
        sx = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127        # [T, 1]
        qx = torch.round(xf / sx).clamp_(-127, 127).to(torch.int8)
        return torch._int_mm(qx, self.q.t()).float().mul_(sx).mul_(self.scale)

    def linear(self, x, bias=None, gemm_dtype=False):
        T = x.shape[0]
        if T <= min(self.kernel_max_rows, kernels.KERNEL_ROWS) and self.own_kernel:
            y = torch.ops.kvserve.linear_int8(x.float(), self.q, self.scale)
        elif T <= self.kernel_max_rows:
            y = torch.ops.aten._weight_int8pack_mm(
                x.to(self.compute_dtype).contiguous(), self.q, self.scale)   # [T, N]
        elif self.w8a8 and T <= W8A8_ROWS:
            y = self._w8a8(x)
        elif self.w8a8:                  # row blocks written into one output in the model dtype
            y = torch.empty(T, self.shape[0], dtype=x.dtype, device=x.device)
            for a in range(0, T, W8A8_ROWS):
                y[a:a + W8A8_ROWS] = self._w8a8(x[a:a + W8A8_ROWS])
        else:
            y = self._dense(x)
        return finish(y, x, bias, gemm_dtype)


class Int4Weight(QuantizedWeight):
    """Group-wise int4: q [N, K] in 0..15, scale and zero [N, K / G];
    W = (q - 8) * scale + zero per group. Held as kvserve's nibbles [N, K/2] (pack_nibbles) and
    `scales` [N, 2, K/G] bfloat16 (a row's scales, then its zeros): 0.5 + 4 / G bytes a weight,
    what kvserve's kernels read at every row count. Only where those kernels are not built
    (KVSERVE_KERNELS=torch, no compiler) is torch's int4 kernel used instead, on a packed copy
    of its own and its [K/G, N, 2] scales. GGUF Q4_0 maps to zero = 0; Q4_1 (w = q * d + m) to
    scale = d, zero = m + 8 d.
    int5 (GGUF Q5_0 / Q5_1 / Q5_K, gguf_types.py): q in 0..31, its fifth bits held beside the
    nibbles as `high` [N, K/8] (pack_high; 0.125 bytes a weight more), read by kvserve's
    kernels only (torch's int4 kernel has no fifth bit): without them it is refused."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 name: str = "weight", nibbles: torch.Tensor | None = None, high: torch.Tensor | None = None):
        """`nibbles` (and `high`): q already in kvserve's layout (then `q` may be None); a q with
        values past 15 is int5."""
        N, K = (q.shape[0], q.shape[1]) if q is not None else (nibbles.shape[0], 2 * nibbles.shape[1])
        if scale.dim() != 2 or scale.shape[0] != N or K % scale.shape[1]:
            raise ValueError(f"Int4Weight takes q [N, K] and scale [N, K / group]; got q {(N, K)} and "
                             f"scale {tuple(scale.shape)}.")
        group = K // scale.shape[1]
        if group not in GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {GROUP_SIZES}; {name} has {group}.")
        device = torch.device(device)
        self.own_kernel = kernels.available(device)
        self._setup("int4", (N, K), dtype, device,
                    None if self.own_kernel or N % INT4_KERNEL_ROWS == 0
                    else f"the int4 kernel needs out_features divisible by {INT4_KERNEL_ROWS}")
        self.group_size = group
        if q is not None and high is None and bool((q > 15).any()):
            high = pack_high(q)
            q = q & 15
        if high is not None and not self.own_kernel:
            raise ValueError(f"{name}: 5-bit weights run on kvserve's CPU kernels only, and they are "
                             "not built here (KVSERVE_KERNELS=torch, or no compiler).")
        self.high = None if high is None else high.contiguous().to(device)
        self.nibbles = (pack_nibbles(q) if nibbles is None else nibbles).contiguous().to(device)
        self.has_zero = zero is not None and bool(zero.any())
        zero = torch.zeros_like(scale) if zero is None else zero
        self.scales = torch.stack([scale, zero], dim=1).to(device=device, dtype=self.compute_dtype).contiguous()
        # torch's kernel (the fallback where kvserve's are not built): its packed copy and scales
        self.packed = self.torch_scales = None
        if self.kernel_max_rows >= 0 and not self.own_kernel:
            self.packed = self._torch_packed()
            self.torch_scales = self.scales.permute(2, 0, 1).contiguous() if self.packed is not None else None

    def _torch_packed(self) -> torch.Tensor | None:
        """torch's packed copy [N, K/2] for its kernel (a layout of its own, never read back),
        packed a few row blocks at a time so the int32 transient stays small; None where the
        pack raises (one warning: the dequantize path)."""
        N, K = self.shape
        step = max(ROW_BLOCK, DEQUANT_CHUNK // K // ROW_BLOCK * ROW_BLOCK)
        try:
            return torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                unpack_nibbles(self.nibbles[a:a + step]).to(torch.int32), 2) for a in range(0, N, step)])
        except RuntimeError as e:
            warn_once("int4 weights of shape %s: torch's int4 pack failed (%s); they run on the "
                      "dequantize path", list(self.shape), e)
            self.kernel_max_rows = -1
            return None

    @classmethod
    def cat(cls, parts: list["Int4Weight"], dtype: torch.dtype, device, name: str = "weight") -> "Int4Weight":
        """Row blocks of one group size stacked into one weight (fused q, k, v), in the model's
        dtype and device."""
        sz = torch.cat([p.scales.float().cpu() for p in parts])                # [N, 2, K/G]
        high = None
        if any(p.high is not None for p in parts):
            high = torch.cat([p.high.cpu() if p.high is not None else torch.zeros(p.shape[0], p.shape[1] // 8,
                                                                                   dtype=torch.uint8)
                              for p in parts])
        return cls(None, sz[:, 0], sz[:, 1], dtype=dtype, device=device, name=name,
                   nibbles=torch.cat([p.nibbles.cpu() for p in parts]), high=high)

    def tensors(self):
        return [t for t in (self.nibbles, self.high, self.scales, self.packed, self.torch_scales) if t is not None]

    def q_values(self, start: int = 0, stop: int | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
        """q of rows start:stop (or rows `ids`) [n, K] uint8 in 0..15 (0..31 with a fifth bit)."""
        rows = slice(start, stop) if ids is None else ids
        q = unpack_nibbles(self.nibbles[rows])
        return q if self.high is None else q + unpack_high(self.high[rows])

    def dequantize(self, start: int = 0, stop: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows start:stop of W, [stop - start, K] in `dtype` (default the compute dtype): with
        kvserve's kernels each weight's exact value rounded once to `dtype` (float32 or bfloat16,
        in one pass: `dequantize_int4`), else torch's arithmetic in `dtype`."""
        K = self.shape[1]
        stop = self.shape[0] if stop is None else stop
        n, dtype = stop - start, dtype or self.compute_dtype
        if self.own_kernel and dtype in (torch.float32, torch.bfloat16):
            return torch.ops.kvserve.dequantize_int4(self.nibbles[start:stop], self.scales[start:stop],
                                                     self.group_size, dtype,
                                                     None if self.high is None else self.high[start:stop])
        w = self.q_values(start, stop).to(dtype).view(n, -1, self.group_size)
        scale, zero = self.scales[start:stop].to(dtype).unbind(1)             # [n, K/G]
        w = w.sub_(8).mul_(scale[..., None])
        return (w.add_(zero[..., None]) if self.has_zero else w).view(n, K)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [T, K] in the model dtype (an embedding lookup)."""
        T, (_, K), G = ids.shape[0], self.shape, self.group_size
        q = self.q_values(ids=ids)                                           # [T, K]
        scale, zero = self.scales[ids].to(self.dtype).unbind(1)              # [T, K/G]
        w = (q.to(self.dtype).view(T, -1, G) - 8) * scale[..., None] + zero[..., None]
        return w.view(T, K)

    def _dense_rows(self, x, start, stop):
        return F.linear(x, self.dequantize(start, stop, x.dtype))

    def linear(self, x, bias=None, gemm_dtype=False):
        if x.shape[0] <= self.kernel_max_rows and self.own_kernel:
            y = torch.ops.kvserve.linear_int4(x.float(), self.nibbles, self.scales, self.group_size, self.high)
        elif x.shape[0] <= self.kernel_max_rows:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(self.compute_dtype).contiguous(), self.packed, self.group_size,
                self.torch_scales)                                           # [T, N]
        else:
            y = self._dense(x)
        return finish(y, x, bias, gemm_dtype)


AMX_DENSE_ROWS = 64     # rows a bfloat16 weight takes kvserve's AMX tiles to (prefill chunks: oneDNN's GEMM)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, gemm_dtype: bool = False) -> torch.Tensor:
    """x [T, K] @ w.T + bias -> [T, N], for a plain weight tensor or a QuantizedWeight (`gemm_dtype`:
    QuantizedWeight.linear's; a plain weight's result is in x's dtype anyway). A bfloat16
    weight on a CPU with AMX runs kvserve's tiles up to AMX_DENSE_ROWS rows (float32 sums; 2.3x
    torch's GEMM on SmolLM2's 49,152 x 576 lm_head at one row), more rows torch's."""
    if isinstance(w, torch.Tensor):
        if (w.dtype == torch.bfloat16 and x.dim() == 2 and 0 < x.shape[0] <= AMX_DENSE_ROWS and w.device.type == "cpu"
                and w.shape[1] % 32 == 0 and kernels.amx()):
            y = torch.ops.kvserve.linear_bf16(x.float(), w).to(x.dtype)
            return y if bias is None else y + bias
        return F.linear(x, w, bias)
    return w.linear(x, bias, gemm_dtype)


def input_dtype(w, x: torch.Tensor) -> torch.dtype:
    """The dtype `linear(x, w)` computes with x's values in: x's own, or a quantized weight's GEMM's."""
    return (w.gemm_input_dtype(x.shape[0]) if isinstance(w, QuantizedWeight) else None) or x.dtype


def quantize(w: torch.Tensor, method: str, group_size: int | None, dtype: torch.dtype,
             device="cpu", name: str = "weight") -> QuantizedWeight:
    """A float weight [N, K] quantized with `method` ("int8" or "int4"). int4 groups are
    `group_size` wide (default 128 where it divides K, else 32); a matrix int4 cannot hold
    (K not a multiple of the group) is stored as int8 instead."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}.")
    refuse_off_cpu(method, device)
    N, K = w.shape
    if method == "int4":
        group = group_size or (128 if K % 128 == 0 else 32)
        if K % group == 0:
            return Int4Weight(*quantize_int4(w, group, CPU_SCALE_DTYPE), dtype=dtype,
                              device=device, name=name)
        logger.info("%s [%d, %d] does not fit int4 groups of %d; stored as int8", name, N, K, group)
    return Int8Weight(*quantize_int8(w, CPU_SCALE_DTYPE), dtype=dtype, device=device)


def keeps_quantized(device) -> bool:
    """False where the plan keeps quantized weights dequantized (cpu_paths: float_resident)."""
    return torch.device(device).type != "cpu" or not kernel_plan().float_resident
