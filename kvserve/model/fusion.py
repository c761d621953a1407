"""The model's weights from a checkpoint's parts: q, k, v (and gate, up) fused row-wise into one
matrix, each part in its format -- a float tensor, or already quantized by a GGUF file
(quant/gguf_blocks.Int4Values, quant/formats.Int8Weight, quant/gguf_blocks.Int8BlockWeight) -- and the
result in the model dtype or quantized (quant/formats.py)."""
from __future__ import annotations

import torch

from kvserve.model.quant.cpu_paths import kernel_plan, warn_once
from kvserve.model.quant.formats import Int4Weight, Int8Weight, QuantizedWeight, keeps_quantized, quantize
from kvserve.model.quant.gguf_blocks import Int4Values, Int8BlockWeight


def _format(w) -> tuple:
    """A weight's storage: ("float",), ("int8",), ("int4", group, class), or its class."""
    if isinstance(w, (Int4Values, Int4Weight)):
        return ("int4", w.group_size, type(w))
    if isinstance(w, QuantizedWeight):
        return ("int8",) if isinstance(w, Int8Weight) else (type(w).__name__,)
    return ("float",)


def _int8_blocks(parts: list, dtype: torch.dtype, device) -> Int8BlockWeight | None:
    """Parts of mixed formats as one Int8BlockWeight with the same values, where one of them is
    (Q8_0, Q6_K) and every other one is d times integers (Int4Values.int8_blocks: Q4_0, Q5_0),
    as Q4_K_M's q, k (Q5_0) and v (Q8_0) are; else None."""
    if not any(isinstance(p, Int8BlockWeight) for p in parts):
        return None
    blocks = []
    for p in parts:
        if isinstance(p, Int4Values):
            qd = p.int8_blocks()
            if qd is None:
                return None
            p = Int8BlockWeight(*qd, dtype, "cpu")
        elif not isinstance(p, Int8BlockWeight):
            return None
        blocks.append(p)
    return Int8BlockWeight.cat(blocks, dtype, device)


def _fuse(parts: list, dtype: torch.dtype, device, name: str):
    """Parts of one quantized format stacked as they are."""
    first = parts[0]
    if (len(parts) == 1 and isinstance(first, QuantizedWeight) and first.dtype == dtype
            and first.tensors()[0].device == torch.device(device)):
        return first
    if isinstance(first, Int4Values):
        return Int4Values.cat(parts).pack(dtype, device, name)
    if isinstance(first, Int4Weight):
        return Int4Weight.cat(parts, dtype, device, name)
    if isinstance(first, Int8Weight):
        return Int8Weight.cat(parts, dtype, device)
    if isinstance(first, Int8BlockWeight):
        return Int8BlockWeight.cat(parts, dtype, device)
    return quantize(torch.cat([_float(p) for p in parts]), "int8", None, dtype, device, name)


def _float(w) -> torch.Tensor:
    """A weight's values as a float tensor (int8 exactly: q times the stored scale)."""
    if isinstance(w, Int8Weight):
        return w.q.float() * w.scale.float()[:, None]
    if isinstance(w, Int4Weight):
        return w.dequantize(dtype=torch.float32)
    return w if isinstance(w, torch.Tensor) else w.dequantize().float()


def resident(w, dtype: torch.dtype, device):
    """`w` as it is kept: a quantized weight stays quantized unless the CPU's plan keeps its
    values dequantized (quant/cpu_paths: float_resident), then it is a tensor in `dtype` (one warning)."""
    if not isinstance(w, QuantizedWeight) or keeps_quantized(device):
        return w
    warn_once("CPU capability %s: torch's int4 / int8 kernels and dequantization run without SIMD "
              "here (benchmarks/bench_cpu_paths.py), so quantized weights keep their quantized values "
              "but are held dequantized in %s: the same numbers, none of the memory saving",
              kernel_plan().capability, str(dtype).removeprefix("torch."))
    return _float(w).to(device=device, dtype=dtype)


def linear_weight(parts: list, name: str, method: str | None, group_size: int | None,
                  device: torch.device, dtype: torch.dtype):
    """`_linear_weight`, then as the CPU keeps it (`resident`)."""
    return resident(_linear_weight(parts, name, method, group_size, device, dtype), dtype, device)


def _linear_weight(parts: list, name: str, method: str | None, group_size: int | None,
                   device: torch.device, dtype: torch.dtype):
    """One fused linear weight from its row blocks (q, k, v or gate, up). Float parts give a
    tensor in `dtype` (method None or "dequant"), or are quantized with `method`. Parts that
    arrive quantized (a GGUF file: Int4Values, Int8Weight) keep their format when `method` is
    None or already that format, and they share it; with method None, quantized parts of
    different formats become one Int8BlockWeight where their values allow (`_int8_blocks`), else
    int8 part by part (its rows are independent); otherwise every part is dequantized first."""
    formats = {_format(p) for p in parts}
    fmt = _format(parts[0])
    wanted = method is None or (method == fmt[0] and (group_size is None or fmt[1:2] == (group_size,)))
    if len(formats) == 1 and fmt[0] != "float" and wanted:
        return _fuse(parts, dtype, device, name)
    if method is None and ("float",) not in formats:
        blocks = _int8_blocks(parts, dtype, device)
        if blocks is not None:
            return blocks
        as_int8 = [p if isinstance(p, Int8Weight) else quantize(_float(p), "int8", None, dtype, device, name)
                   for p in parts]
        return Int8Weight.cat(as_int8, dtype, device)
    w = torch.cat([_float(p) for p in parts]) if len(parts) > 1 else _float(parts[0])
    if method in (None, "dequant"):
        return w.to(device=device, dtype=dtype)
    return quantize(w, method, group_size, dtype, device, name)


def embedding_weight(w, method: str | None, device, dtype: torch.dtype):
    """The embedding table: a tensor in `dtype`, or (method None, a GGUF file) quantized as the
    file stores it, for lookups by `embedding_rows` and as a tied lm_head on the kernels."""
    if method is None and not isinstance(w, torch.Tensor):
        return resident(_fuse([w], dtype, device, "embed_tokens"), dtype, device)
    return _float(w).to(device=device, dtype=dtype)


def embedding_rows(w, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of an embedding table -> [T, hidden] in the model dtype."""
    return w[ids] if isinstance(w, torch.Tensor) else w.rows(ids)
