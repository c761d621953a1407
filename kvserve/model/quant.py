"""Weight-only quantization, executed quantized (seed 000: quantization reads fewer bytes per token).

A decode step multiplies a few activation rows by every weight matrix, so its time is the bytes
of weight it reads. The linear weights are stored as int8 (1 byte a weight) or int4 (half a
byte) plus scales, stay that way in memory, and run through PyTorch's own CPU kernels, which
read the quantized bytes and scale inside the matmul:

  int8: per output channel, symmetric   w[n, k] ~ q[n, k] * scale[n]        q in -128..127
        torch.ops.aten._weight_int8pack_mm(x, q, scale)
  int4: groups of G along K (32..256)   w[n, k] ~ (q[n, k] - 8) * scale[n, k // G] + zero[n, k // G]
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, scales_and_zeros)

Both kernels are vectorized for bfloat16 activations only (float32 and float16 measured 10-30x
slower than bfloat16 here), so on the CPU every quantized matmul computes in bfloat16, whatever
the model dtype: a float32 model casts the activations in and the result back out. Scales are
stored in bfloat16 too. Other devices have no kernel: they dequantize, in the model dtype.

Kernel per step shape, by thresholds measured on the development machine (2 cores, AVX-512
with BF16 and VNNI, torch 2.13), not by a startup benchmark, so runs are reproducible:
  int8: at most `KERNEL_MAX_ROWS["int8"]` rows (decode batches) run the weight-only kernel; a
        bigger step dequantizes (below). With `use_w8a8()` (`quantize_activations=True`) a step
        of more than `W8A8_KERNEL_MAX_ROWS` rows quantizes the activations too, per row
        (symmetric int8; llama.cpp's Q8_0 matmuls quantize theirs in blocks of 32) and runs the
        integer GEMM `torch._int_mm`, `W8A8_ROWS` rows at a time, scaling the int32 sums in
        float32: faster than both weight-only paths from 16 rows on (the table below), at a
        measured cost in perplexity (README, Quantization).
  int4: at most `KERNEL_MAX_ROWS["int4"]` rows run the kernel.
A bigger step (prefill, big batches) dequantizes the weight for that one call and runs the dense
GEMM, which is compute-bound there, so the dequantization is paid once for many rows. No
dequantized copy is kept.

int4 needs K to be a multiple of the group and N of 64 (the packed layout); a matrix that is
not (stories260K's 172-wide MLP) is stored as int8. Embeddings stay in the model dtype (a lookup
reads a few rows, not the matrix); the lm_head is quantized like the layers unless it is tied
to the embedding: at one row the int8 kernel reads the benchmark's 32000 x 768 lm_head in
337 us against 2238 us for bfloat16. A GGUF file's own quantized weights (gguf_quant.py) keep
their format, the embedding included (looked up row by row, and tied, the lm_head).
"""
from __future__ import annotations

import logging
import re

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

METHODS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)      # what the int4 kernel accepts
INT4_ROW_BLOCK = 64                   # the packed int4 layout interleaves rows in blocks of 64

KERNEL_DTYPE = torch.bfloat16         # the only activation dtype the CPU kernels vectorize

# Largest number of activation rows that runs the weight-only kernel; more rows dequantize (or
# run W8A8). Measured with the engine's 2 threads, bfloat16, best of 21 calls, in microseconds, on
# the benchmark Llama's matrices: kernel / dequantize + GEMM (a dense bfloat16 GEMM for reference).
#   rows               16               32               64               128              256
#   int8 gate_up  304/411 (227)    592/584 (357)   1208/775 (556)
#   int8 qkv      101/163 (103)    190/213 (142)    383/282 (211)
#   int4 gate_up                                   1112/1892 (556)  2243/2294 (980)  4503/3133 (1823)
#   int4 qkv                                        348/636 (211)    689/788 (351)   1383/1027 (595)
# The kernels' time grows with the rows from a few times below the dense GEMM's at one row
# (gate_up: 41 int8, 45 int4, 161 dense); dequantizing costs a fixed pass over the matrix,
# several times dearer for int4 (unpacking nibbles), so int4 crosses over later. (With one
# thread the int8 crossover moves to 16-32 rows.)
KERNEL_MAX_ROWS = {"int8": 32, "int4": 128}
# W8A8 (`python benchmarks/bench_int8_paths.py`: SmolLM2's gate_up 3072x576, qkv 960x576, down
# 576x1536, the benchmark Llama's gate_up 4096x768; 2 threads, microseconds), weight-only kernel /
# dequantize + GEMM / W8A8 / dense bfloat16 GEMM of the unquantized model:
#   rows          1              8               32              256               2048
#   3072x576   25/169/33/67   95/246/82/139   361/274/128/171  2974/1070/720/930  23247/9374/6526/8600
#   960x576    11/90/25/47    32/102/46/55    115/139/76/93    900/516/392/402    7094/2844/3040/2622
#   576x1536   14/131/27/62   43/127/62/63    165/180/117/110  1246/723/506/547   10049/4099/4142/3850
#   4096x768   41/342/44/172  160/410/120/217 618/610/247/422  4974/2112/1287/1860 40230/14932/9857/13191
# Past 8 rows W8A8 runs at 0.98-2.47x the speed of the faster weight-only path up to 256 rows
# (0.94-1.51x at 2048) and 0.86-1.81x the dense GEMM's. One torch._int_mm over 2048 rows was
# nearly 4x slower than the same rows in blocks (42.6 against 11.2 ms on 4096x768 when this was
# chosen), hence blocks of W8A8_ROWS rows written into one output.
W8A8_KERNEL_MAX_ROWS = 8
W8A8_ROWS = 128
# Weights dequantized at a time on the dequantize path, in row blocks, so that the transient
# stays small enough for the allocator to reuse: glibc maps anything over 32 MB afresh, and
# the 32000 x 768 lm_head at 64 rows took 21.6 ms whole against 5.3 ms in 3M-weight blocks.
DEQUANT_CHUNK = 3 << 20


def parse_quantization(method: str | None, group_size: int | None) -> tuple[str | None, int | None]:
    """("int4-g32", None) -> ("int4", 32); checks the method and the group size. "dequant":
    a GGUF file's quantized tensors dequantized to the model dtype at load (else the same as None)."""
    if method is None or method in ("none", "dequant"):
        if group_size is not None:
            raise ValueError("quantization_group_size needs quantization='int4'; set both or neither.")
        return (None if method == "none" else method), None
    match = re.fullmatch(r"(int8|int4)(?:-g(\d+))?", str(method))
    if match is None:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} (int4 may carry a "
                         f"group size, e.g. 'int4-g32') or 'dequant', got {method!r}.")
    method, suffix = match.group(1), match.group(2)
    if suffix is not None:
        if group_size is not None and group_size != int(suffix):
            raise ValueError(f"quantization {method}-g{suffix} and quantization_group_size={group_size} "
                             "disagree; give the group size once.")
        group_size = int(suffix)
    if method == "int8" and group_size is not None:
        raise ValueError("int8 quantization is per output channel and takes no group size; "
                         "drop quantization_group_size or use int4.")
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}.")
    return method, group_size


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
    compute_dtype: torch.dtype          # the matmul's and the scales': bfloat16 on the CPU
    kernel_max_rows: int                # -1: never the kernel

    def _setup(self, method: str, shape, dtype: torch.dtype, device: torch.device, kernel_ok: bool = True):
        on_cpu = device.type == "cpu"
        self.shape, self.dtype = tuple(shape), dtype
        self.compute_dtype = KERNEL_DTYPE if on_cpu else dtype
        self.kernel_max_rows = KERNEL_MAX_ROWS[method] if on_cpu and kernel_ok else -1

    def _dense(self, xc: torch.Tensor) -> torch.Tensor:
        """xc [T, K] @ W.T -> [T, N], W dequantized about DEQUANT_CHUNK weights at a time."""
        N, K = self.shape
        step = max(INT4_ROW_BLOCK, DEQUANT_CHUNK // K // INT4_ROW_BLOCK * INT4_ROW_BLOCK)
        if step >= N:
            return self._dense_rows(xc, 0, N)
        return torch.cat([self._dense_rows(xc, a, min(a + step, N)) for a in range(0, N, step)], dim=1)

    def _dense_rows(self, xc: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


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
        self._setup("int8", q.shape, dtype, device, kernel_ok=q.shape[1] % 32 == 0)
        self.q = q.contiguous().to(device)
        self.scale = scale.to(device=device, dtype=self.compute_dtype)
        self.w8a8 = False                           # more rows than the kernel's: W8A8 (use_w8a8)

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

    def _dense_rows(self, xc, start, stop):
        # The per-channel scale commutes with the GEMM: one pass over q, not two.
        return F.linear(xc, self.q[start:stop].to(xc.dtype)) * self.scale[start:stop]

    def use_w8a8(self) -> None:
        """Steps of more than W8A8_KERNEL_MAX_ROWS rows quantize the activations (the CPU only)."""
        if self.q.device.type == "cpu":
            self.w8a8 = True
            self.kernel_max_rows = min(self.kernel_max_rows, W8A8_KERNEL_MAX_ROWS)

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N] float32: x quantized per row to int8, an int32 GEMM, both scales."""
        xf = x.float()
        sx = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127        # [T, 1]
        qx = torch.round(xf / sx).clamp_(-127, 127).to(torch.int8)
        return torch._int_mm(qx, self.q.t()).float().mul_(sx).mul_(self.scale)

    def linear(self, x, bias=None):
        T = x.shape[0]
        if T <= self.kernel_max_rows:
            y = torch.ops.aten._weight_int8pack_mm(
                x.to(self.compute_dtype).contiguous(), self.q, self.scale)   # [T, N]
        elif self.w8a8 and T <= W8A8_ROWS:
            y = self._w8a8(x)
        elif self.w8a8:                  # row blocks written into one output in the model dtype
            y = torch.empty(T, self.shape[0], dtype=x.dtype, device=x.device)
            for a in range(0, T, W8A8_ROWS):
                y[a:a + W8A8_ROWS] = self._w8a8(x[a:a + W8A8_ROWS])
        else:
            y = self._dense(x.to(self.compute_dtype))
        y = y.to(x.dtype)
        return y if bias is None else y + bias


def _unpack_int4(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The CPU kernel's packed [N, K/2] uint8 -> q [N, K] uint8. Layout (torch 2.13): per block
    of 64 rows, K runs of 32 bytes; byte j of run k holds row j (low nibble) and row j + 32."""
    blocks = packed.view(N // INT4_ROW_BLOCK, K, INT4_ROW_BLOCK // 2)
    rows = torch.cat([blocks & 15, blocks >> 4], dim=-1)                    # [N/64, K, 64]
    return rows.transpose(1, 2).reshape(N, K)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [n, K] in 0..15 (n a multiple of 64) -> the CPU kernel's packed [n, K/2] uint8, checked
    against _unpack_int4."""
    n, K = q.shape
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
    if not torch.equal(_unpack_int4(packed, n, K), q.to(torch.uint8)):
        raise RuntimeError("this torch packs int4 weights in an unknown layout; kvserve's "
                           "dequantize (_unpack_int4) must be updated for it.")
    return packed


class Int4Weight(QuantizedWeight):
    """Group-wise int4: q [N, K] in 0..15, scale and zero [N, K / G];
    W = (q - 8) * scale + zero per group. Held as the kernel's packed [N, K/2] bytes and
    scales_and_zeros [K/G, N, 2]. GGUF Q4_0 maps to zero = 0; Q4_1 (w = q * d + m) to
    scale = d, zero = m + 8 d."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 name: str = "weight"):
        N, K = q.shape
        if scale.dim() != 2 or scale.shape[0] != N or K % scale.shape[1]:
            raise ValueError(f"Int4Weight takes q [N, K] and scale [N, K / group]; got q {(N, K)} and "
                             f"scale {tuple(scale.shape)}.")
        group = K // scale.shape[1]
        if group not in GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {GROUP_SIZES}; {name} has {group}.")
        if N % INT4_ROW_BLOCK:
            raise ValueError(f"int4 needs out_features divisible by {INT4_ROW_BLOCK}; {name} has {N}: "
                             "use quantization='int8' for this model.")
        device = torch.device(device)
        self._setup("int4", (N, K), dtype, device)
        self.group_size = group
        # Blocks of 64 rows pack independently: a few at a time, so the int32 copy stays small.
        step = max(INT4_ROW_BLOCK, DEQUANT_CHUNK // K // INT4_ROW_BLOCK * INT4_ROW_BLOCK)
        packed = torch.cat([_pack_int4(q[a:a + step].cpu()) for a in range(0, N, step)])
        self.has_zero = zero is not None and bool(zero.any())
        zero = torch.zeros_like(scale) if zero is None else zero
        self.packed = packed.to(device)                                     # [N, K/2] uint8
        self.scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(
            device=device, dtype=self.compute_dtype)                        # [K/G, N, 2]

    @classmethod
    def cat(cls, parts: list["Int4Weight"], dtype: torch.dtype, device, name: str = "weight") -> "Int4Weight":
        """Row blocks of one group size stacked into one weight (fused q, k, v), in the model's
        dtype and device."""
        qs = [_unpack_int4(p.packed.cpu(), *p.shape) for p in parts]
        sz = torch.cat([p.scales_and_zeros.float().cpu() for p in parts], dim=1)    # [K/G, N, 2]
        return cls(torch.cat(qs), sz[..., 0].T, sz[..., 1].T, dtype=dtype, device=device, name=name)

    def tensors(self):
        return [self.packed, self.scales_and_zeros]

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop (multiples of 64) of W, [stop - start, K] in the compute dtype."""
        K = self.shape[1]
        stop = self.shape[0] if stop is None else stop
        n = stop - start
        w = _unpack_int4(self.packed[start:stop], n, K).to(self.compute_dtype).view(n, -1, self.group_size)
        scale, zero = self.scales_and_zeros[:, start:stop].transpose(0, 1).unbind(-1)   # [n, K/G]
        w = w.sub_(8).mul_(scale[..., None])
        return (w.add_(zero[..., None]) if self.has_zero else w).view(n, K)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [T, K] in the model dtype (an embedding lookup), read from the packed layout:
        row r is nibble r // 32 % 2 of byte column r % 32 in block r // 64."""
        T, (N, K), G = ids.shape[0], self.shape, self.group_size
        blocks = self.packed.view(N // INT4_ROW_BLOCK, K, INT4_ROW_BLOCK // 2)
        j = ids % INT4_ROW_BLOCK
        byte = blocks[ids // INT4_ROW_BLOCK, :, j % 32]                      # [T, K]
        q = (byte >> (4 * (j // 32)).to(torch.uint8)[:, None]) & 15
        scale, zero = self.scales_and_zeros[:, ids].to(self.dtype).permute(1, 0, 2).unbind(-1)  # [T, K/G]
        w = (q.to(self.dtype).view(T, -1, G) - 8) * scale[..., None] + zero[..., None]
        return w.view(T, K)

    def _dense_rows(self, xc, start, stop):
        return F.linear(xc, self.dequantize(start, stop))

    def linear(self, x, bias=None):
        xc = x.to(self.compute_dtype)
        if x.shape[0] <= self.kernel_max_rows:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xc.contiguous(), self.packed, self.group_size, self.scales_and_zeros)  # [T, N]
        else:
            y = self._dense(xc)
        y = y.to(x.dtype)
        return y if bias is None else y + bias


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ w.T + bias -> [T, N], for a plain weight tensor or a QuantizedWeight."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w.linear(x, bias)


def quantize(w: torch.Tensor, method: str, group_size: int | None, dtype: torch.dtype,
             device="cpu", name: str = "weight") -> QuantizedWeight:
    """A float weight [N, K] quantized with `method` ("int8" or "int4"). int4 groups are
    `group_size` wide (default 128 where it divides K, else 32); a matrix int4 cannot hold
    (K not a multiple of the group, N not a multiple of 64) is stored as int8 instead."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}.")
    N, K = w.shape
    if method == "int4":
        group = group_size or (128 if K % 128 == 0 else 32)
        if K % group == 0 and N % INT4_ROW_BLOCK == 0:
            return Int4Weight(*quantize_int4(w, group, _scale_dtype(dtype, device)), dtype=dtype,
                              device=device, name=name)
        logger.info("%s [%d, %d] does not fit int4 groups of %d and blocks of %d rows; stored as int8",
                    name, N, K, group, INT4_ROW_BLOCK)
    return Int8Weight(*quantize_int8(w, _scale_dtype(dtype, device)), dtype=dtype, device=device)


def _scale_dtype(dtype: torch.dtype, device) -> torch.dtype:
    return KERNEL_DTYPE if torch.device(device).type == "cpu" else dtype
