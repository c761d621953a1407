"""GGUF tensors in their own types (the default, quantization=None, on a .gguf file): the raw
blocks are decoded with numpy straight into formats.py's int4 and int8 forms, one tensor at a
time (Q4 tensors when they are fused and packed), so no float copy of the model is ever made.

  type  block of (bytes)                                  w =                 held as
  Q4_0  32: fp16 d, 16 B of nibbles (18)                  d (q - 8)           int4 g32: scale d, zero 0
  Q4_1  32: fp16 d, fp16 m, 16 B (20)                     d q + m             int4 g32: d, m + 8 d
  Q4_K  256: fp16 d, fp16 dmin, 12 B of 6-bit sc_j, m_j   d sc_j q - dmin m_j int4 g32: d sc_j,
        (8 sub-blocks of 32), 128 B of nibbles (144)                          8 d sc_j - dmin m_j
  Q5_0  32: fp16 d, 4 B of fifth bits, 16 B (22)          d (q - 16)          int5 g32: d, -8 d
  Q5_1  32: fp16 d, fp16 m, 4 B, 16 B (24)                d q + m             int5 g32: d, m + 8 d
  Q5_K  256: as Q4_K, 32 B of fifth bits before the       d sc_j q - dmin m_j int5 g32: as Q4_K
        nibbles (176)
  Q8_0  32: fp16 d, 32 int8 (34)                          d q                 Q8_0 (kvserve's kernels);
                                                                              else int8 per row
                                                                              (requantized), embedding
                                                                              and lm_head exact
  Q6_K  256: 128 B of low nibbles, 64 B of high bit     d sc_j (q - 32)     int8, d sc_j per 16
        pairs, 16 int8 sc_j, fp16 d (210)                                     (float16; kvserve's
                                                                              kernels), else int8
                                                                              per row (requantized)
  Q2_K, Q3_K (gguf.quants.dequantize)                                         int8 per row (requantized)
  F32, F16, BF16                                                              the model dtype

int5 is int4 with a fifth bit per weight (formats.Int4Weight `high`, q = nibble + 16 bit in 0..31,
the same (q - 8) * scale + zero): 0.625 + 4 / 32 bytes a weight against the file's 0.6875 (Q5_0),
read by kvserve's kernels only; without them the Q5 types are requantized to int8 per row.

Nibbles: in a Q4_0/Q4_1 block the 16 low nibbles are weights 0-15 and the high ones 16-31; in a
Q4_K super-block, bytes 32i..32i+31 hold sub-block 2i (low nibbles) and 2i+1 (high). The values
(q - 8) * scale + zero, in float32, equal gguf.quants.dequantize bit for bit (the products are
exact, and so is Q4_K's zero while 8 d sc_j and dmin m_j are within about 2^7 of each other,
as in llama.cpp's blocks: tests/model/test_gguf_quant.py). q/k rows are un-permuted in q, scale
and zero alike. The kernels then hold scales and zeros in
bfloat16 (quant.py): on SmolLM2-135M's Q4_1 layers that moves the weights by 0.20% RMS.

With kvserve's kernels, every Q8_0 matrix keeps its type (gguf_blocks.Int8BlockWeight: q and the
file's float16 d), and so does Q6_K (blocks of 16). Without them, Q8_0's scale per 32 weights
does not fit torch's int8 kernel's one scale per row, so its values d q are requantized per row
(max |w| / 127.5): measured on SmolLM2-135M's Q8_0 embedding that adds
1.17% RMS of the weights (Q8_0's own rounding is about 0.7%; the row's step is 1.8 times the
mean block step), and made its greedy answer to "What is the capital of France?" a tie (the top
two first tokens 0.1449 / 0.1449, against 0.1522 / 0.1402 dequantized). The embedding and the
lm_head, whose errors reach the residual stream and the logits directly, therefore keep Q8_0
exactly (gguf_blocks.Int8BlockWeight as two int4 planes: d in bfloat16, 0.16% RMS, 1.25 bytes a
weight and a slower kernel); other Q8_0 matrices take the per-row int8 kernel.
"""
from __future__ import annotations

import numpy as np
import torch

from kvserve import kernels
from kvserve.model.quant.formats import Int8Weight, quantize
from kvserve.model.quant.gguf_blocks import Int4Values, Int8BlockWeight

QK = 32          # weights per block of the legacy types (Q4_0, Q4_1, Q8_0)
QK_K = 256       # weights per K-quant super-block
# Types requantized to per-row int8 rather than kept in the model dtype, where they would be
# closer but 4 (float32) or 2 (bfloat16) bytes a weight. Measured against the original weights
# (relative RMS; stories260K's trained float32 layers; for the K-quants, which need rows of 256,
# SmolLM2's Q4_1 layer values standing in, Q6_K and Q5_K simulated by plain rounding):
#   type   its own error   + int8 per row   + bfloat16 (kept in dtype)
#   Q8_0   0.54%           0.70%            0.56%
#   Q5_0   4.30%           4.35%            4.31%
#   Q5_1   3.79%           3.84%            3.79%
#   Q6_K   2.32%           2.50%            2.32%
#   Q5_K   4.54%           4.65%            4.55%
# int8 adds 0.4-1.1% RMS of its own, which next to Q5's and Q6's own error grows the total by
# 1-8%: int8 keeps them 4x smaller than float32 and runs on the int8 kernel. (Q2_K and Q3_K,
# coarser than Q4, were not measured; int8 adds relatively less there.)
REQUANTIZED = ("Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K")   # Q5, Q6_K: without kvserve's kernels
INT8_ROWS_AT_ONCE = 1 << 20      # weights decoded and requantized at a time: bounds the transient


def _fp16(fields: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 little-endian float16 fields -> [n] float32."""
    return np.ascontiguousarray(fields).view(np.float16)[:, 0].astype(np.float32)


def _blocks(raw: np.ndarray, nbytes: int) -> np.ndarray:
    return np.asarray(raw).view(np.uint8).reshape(-1, nbytes)


def _low_high(qs: np.ndarray, run: int) -> np.ndarray:
    """[n, m * run] bytes -> [n, 2 * m * run] nibbles: per run of bytes, the low nibbles, then
    the high ones."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, run)
    return np.concatenate([runs & 15, runs >> 4], axis=2).reshape(n, -1)


def unpack_q4_0(raw: np.ndarray, N: int, K: int):
    """Q4_0 bytes of an [N, K] matrix -> (q [N, K] uint8 0..15, scale [N, K/32] float32, None)."""
    b = _blocks(raw, 18)
    return _low_high(b[:, 2:], 16).reshape(N, K), _fp16(b[:, :2]).reshape(N, K // QK), None


def unpack_q4_1(raw: np.ndarray, N: int, K: int):
    """Q4_1 -> (q, scale = d, zero = m + 8 d): d q + m = d (q - 8) + (m + 8 d)."""
    b = _blocks(raw, 20)
    d, m = _fp16(b[:, :2]), _fp16(b[:, 2:4])
    zero = m + np.float32(8) * d
    return _low_high(b[:, 4:], 16).reshape(N, K), d.reshape(N, K // QK), zero.reshape(N, K // QK)


def q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 12] packed 6-bit fields -> (sc, m) [n, 8] each. Bytes 0-3: sc_0..3 in the low 6 bits,
    the top 2 bits of sc_4..7 above; bytes 4-7: the same for m; bytes 8-11: the low 4 bits of
    sc_4..7 (low nibble) and of m_4..7 (high nibble)."""
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, m


def unpack_q4_k(raw: np.ndarray, N: int, K: int):
    """Q4_K -> (q, scale = d sc_j, zero = 8 d sc_j - dmin m_j), groups of 32 (the sub-blocks)."""
    b = _blocks(raw, 144)
    d, dmin = _fp16(b[:, 0:2])[:, None], _fp16(b[:, 2:4])[:, None]
    sc, m = q4_k_scales_mins(b[:, 4:16])
    scale = d * sc.astype(np.float32)                                       # [n, 8], exact
    zero = np.float32(8) * scale - dmin * m.astype(np.float32)
    return _low_high(b[:, 16:], 32).reshape(N, K), scale.reshape(N, K // QK), zero.reshape(N, K // QK)


def _q5_high(qh: np.ndarray, runs: int) -> np.ndarray:
    """[n, 4 * runs] little-endian 32-bit words of fifth bits -> [n, 32 * runs] 0 or 16: bit j
    of word r is weight j of run r."""
    words = np.ascontiguousarray(qh).view("<u4").reshape(qh.shape[0], runs, 1)
    return (((words >> np.arange(32, dtype=np.uint32)) & 1) * 16).astype(np.uint8).reshape(qh.shape[0], -1)


def unpack_q5_0(raw: np.ndarray, N: int, K: int):
    """Q5_0 -> (q 0..31, scale = d, zero = -8 d): d (q - 16) = d (q - 8) - 8 d. Weight j of a
    block: the low nibble of byte j (j < 16) or the high one of byte j - 16, plus 16 bit j of qh."""
    b = _blocks(raw, 22)
    d = _fp16(b[:, :2])
    q = _low_high(b[:, 6:], 16) + _q5_high(b[:, 2:6], 1)
    return q.reshape(N, K), d.reshape(N, K // QK), (np.float32(-8) * d).reshape(N, K // QK)


def unpack_q5_1(raw: np.ndarray, N: int, K: int):
    """Q5_1 -> (q 0..31, scale = d, zero = m + 8 d), the bits as Q5_0's."""
    b = _blocks(raw, 24)
    d, m = _fp16(b[:, :2]), _fp16(b[:, 2:4])
    q = _low_high(b[:, 8:], 16) + _q5_high(b[:, 4:8], 1)
    return q.reshape(N, K), d.reshape(N, K // QK), (m + np.float32(8) * d).reshape(N, K // QK)


def unpack_q5_k(raw: np.ndarray, N: int, K: int):
    """Q5_K -> (q 0..31, scale = d sc_j, zero = 8 d sc_j - dmin m_j) as Q4_K; weight l of
    sub-block j adds 16 bit j of qh[l] (32 bytes before the nibbles)."""
    b = _blocks(raw, 176)
    d, dmin = _fp16(b[:, 0:2])[:, None], _fp16(b[:, 2:4])[:, None]
    sc, m = q4_k_scales_mins(b[:, 4:16])
    scale = d * sc.astype(np.float32)
    zero = np.float32(8) * scale - dmin * m.astype(np.float32)
    high = ((b[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1).transpose(0, 2, 1) * 16   # [n, 8 sub-blocks, 32]
    q = _low_high(b[:, 48:], 32) + high.reshape(b.shape[0], -1).astype(np.uint8)
    return q.reshape(N, K), scale.reshape(N, K // QK), zero.reshape(N, K // QK)


def unpack_q8_0(raw: np.ndarray, N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 bytes -> (q [N, K] int8, d [N, K/32] float32); w = q * d per block of 32."""
    b = _blocks(raw, 34)
    return np.ascontiguousarray(b[:, 2:]).view(np.int8).reshape(N, K), _fp16(b[:, :2]).reshape(N, K // QK)


def unpack_q6_k(raw: np.ndarray, N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K bytes -> (q [N, K] int8 in -32..31, d [N, K/16] float32); w = q * d per 16 weights,
    d = the super-block's d times the sub-block's int8 scale, rounded to float16 (the kernels'
    scale type: within 2^-11 of the product, which float32 holds exactly).
    A super-block (210 bytes): 128 B of low nibbles, 64 B of high bit pairs, 16 int8 scales,
    fp16 d. Its two halves of 128 weights: weight i of half h takes the low nibble (i < 64) or
    the high one of low byte 64h + i % 64, and bits 2 (i // 32), +1 of high byte 32h + i % 32."""
    b = _blocks(raw, 210)
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64)
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15                # [n, 2, 2, 64]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3         # [n, 2, 4, 32]
    q = (low.reshape(n, 256) | (high.reshape(n, 256) << 4)).astype(np.int8) - np.int8(32)
    d = _fp16(b[:, 208:210])[:, None] * np.ascontiguousarray(b[:, 192:208]).view(np.int8)   # [n, 16], exact
    with np.errstate(over="ignore"):
        d16 = d.astype(np.float16).astype(np.float32)
    if not np.isfinite(d16).all():
        raise ValueError("a Q6_K scale past float16's range")
    return q.reshape(N, K), d16.reshape(N, K // 16)


UNPACK_INT4 = {"Q4_0": unpack_q4_0, "Q4_1": unpack_q4_1, "Q4_K": unpack_q4_k}
UNPACK_INT5 = {"Q5_0": unpack_q5_0, "Q5_1": unpack_q5_1, "Q5_K": unpack_q5_k}   # kvserve's kernels only


def unpermute_rope_rows(w: np.ndarray | torch.Tensor, n_heads: int):
    """Undo convert_hf_to_gguf's q/k row permutation: per head, GGUF row 2j + h holds HF row
    h * d/2 + j (interleaved RoPE pairs -> HF's rotate_half halves). w [n_heads * d, ...]: any
    row-wise array (weights, or a quantized weight's q, scale and zero alike)."""
    d = w.shape[0] // n_heads
    split = w.reshape(n_heads, d // 2, 2, *w.shape[1:])
    if isinstance(w, torch.Tensor):
        return split.transpose(1, 2).reshape(w.shape).contiguous()
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(w.shape))


def _float_rows(t, start: int, stop: int, K: int) -> np.ndarray:
    """Rows start:stop of a 2-D tensor as float32 [rows, K]: Q8_0 decoded here, others by gguf."""
    raw = t.data[start:stop]
    if t.tensor_type.name == "Q8_0":
        q, d = unpack_q8_0(raw, stop - start, K)
        return (q.reshape(-1, K // QK, QK).astype(np.float32) * d[..., None]).reshape(-1, K)
    from gguf.quants import dequantize
    return np.asarray(dequantize(raw, t.tensor_type), dtype=np.float32).reshape(-1, K)


def native_weight(t, shape: tuple[int, ...], heads: int | None, dtype: torch.dtype,
                  device: torch.device | str, logits_side: bool = False):
    """One GGUF tensor (a `gguf.ReaderTensor` of torch `shape`) in its own type: Int4Values for
    Q4_0/Q4_1/Q4_K, an Int8Weight for the other quantized types, else a tensor in `dtype` on
    `device` (Q5_0 / Q5_1 / Q5_K: Int4Values with a fifth bit where kvserve's kernels run them,
    else an Int8Weight). `heads`: undo llama.cpp's q/k row permutation over that many heads.
    Q8_0 stays exact, an Int8BlockWeight, where kvserve's kernels run it; without them only
    `logits_side` (the embedding and the lm_head) does, the other Q8_0 tensors are requantized.
    Q6_K is an Int8BlockWeight of 16-weight blocks where kvserve's kernels run it, else requantized."""
    kind = t.tensor_type.name
    own = kernels.available(device)
    if len(shape) == 2 and Int8BlockWeight.fits(shape[0]) and (
            (kind == "Q8_0" and (own or logits_side)) or (kind == "Q6_K" and own)):
        try:
            q, d = (unpack_q8_0 if kind == "Q8_0" else unpack_q6_k)(t.data, *shape)
        except ValueError as e:     # a scale float16 cannot hold: say which tensor
            raise ValueError(f"{t.name}: {e}") from None
        if heads is not None:
            q, d = unpermute_rope_rows(q, heads), unpermute_rope_rows(d, heads)
        return Int8BlockWeight(torch.from_numpy(q), torch.from_numpy(d), dtype, device, t.name)
    unpack = UNPACK_INT4.get(kind) or (UNPACK_INT5.get(kind) if own else None)
    if len(shape) == 2 and unpack is not None:
        def load():
            arrays = unpack(t.data, *shape)
            arrays = [a if a is None or heads is None else unpermute_rope_rows(a, heads) for a in arrays]
            return tuple(None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)
        return Int4Values.lazy(load, shape, QK)       # the Q4 and Q5 types all have groups of 32
    if len(shape) == 2 and kind in REQUANTIZED:
        N, K = shape
        step = max(1, INT8_ROWS_AT_ONCE // K)
        chunks = [quantize(torch.from_numpy(_float_rows(t, a, min(a + step, N), K)), "int8", None,
                           dtype, device) for a in range(0, N, step)]
        q, scale = torch.cat([c.q for c in chunks]), torch.cat([c.scale for c in chunks])
        if heads is not None:   # int8 rows are quantized independently: permute them afterwards
            q, scale = unpermute_rope_rows(q, heads), unpermute_rope_rows(scale, heads)
        return Int8Weight(q, scale, dtype=dtype, device=device)
    from gguf.quants import dequantize
    # np.array copies: F32 comes back as a view of the file mapping
    w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    if heads is not None:
        w = unpermute_rope_rows(w, heads)
    return torch.from_numpy(np.ascontiguousarray(w)).to(device=device, dtype=dtype)
