"""What the configuration's names mean to torch on this machine: a dtype name as torch's dtype,
and whether device "auto" finds a GPU. The configuration keeps names (config/names.py); the
worker, which owns the tensors, maps them."""
from __future__ import annotations

import torch

from kvserve.config.names import DTYPE_NAMES


def torch_dtype(name: str) -> torch.dtype:
    """"bfloat16" (or any EngineConfig.dtype spelling: "bf16", "half", ...) -> torch.bfloat16;
    "auto" not yet decided against a checkpoint: float32."""
    return torch.float32 if name == "auto" else getattr(torch, DTYPE_NAMES[name])


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(name: str) -> str:
    """The device a name means: "auto" is cuda when torch sees a GPU, else cpu."""
    return ("cuda" if cuda_available() else "cpu") if name == "auto" else name


def set_num_threads(num_threads: int | None) -> int:
    """torch's intra-op thread count for this process (left as it is for None or 0); returns it."""
    if num_threads:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def cuda_memory(device) -> tuple[int, int]:
    """(total bytes of `device`, bytes torch's allocator holds on it now)."""
    _, total = torch.cuda.mem_get_info(device)
    return total, torch.cuda.memory_reserved(device)
