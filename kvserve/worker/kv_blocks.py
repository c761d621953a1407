"""KV blocks' bytes out of and into the runner's pools (kv/connector.py's tiers, a KV stream):
a block is every pool tensor's slice at its id (K, V; values then scales when quantized), in
the order of `ModelRunner.kv_cache_tensors()`, concatenated as raw bytes. kv/block_io.py wraps
these bytes in a checksummed envelope; the copies are the worker's, since it owns the pools."""
from __future__ import annotations

import numpy as np
import torch


def read_blocks(tensors: list[torch.Tensor], block_ids: list[int]) -> np.ndarray:
    """[n, block_bytes] uint8 on the CPU: the blocks' slices of every tensor, concatenated."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
    parts = [t.index_select(0, idx).reshape(len(block_ids), -1).view(torch.uint8) for t in tensors]
    return torch.cat(parts, dim=1).cpu().numpy()


def write_blocks(tensors: list[torch.Tensor], block_ids: list[int], data) -> None:
    """data: n x block_bytes bytes (any buffer: bytes, bytearray, a uint8 array) -> the blocks
    `block_ids` of every tensor."""
    n = len(block_ids)
    data = torch.frombuffer(data, dtype=torch.uint8).view(n, -1) if not isinstance(data, torch.Tensor) else data
    device = tensors[0].device
    idx = torch.tensor(block_ids, dtype=torch.long, device=device)
    data = data.to(device, non_blocking=True)
    off = 0
    for t in tensors:
        per = t[0].numel() * t.element_size()
        chunk = data[:, off:off + per]
        if off % t.element_size() or data.shape[1] % t.element_size():     # not aligned to the dtype
            chunk = chunk.contiguous()
        t.index_copy_(0, idx, chunk.view(t.dtype).view((n,) + tuple(t.shape[1:])))    # else a view: no copy
        off += per


def block_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in tensors)
