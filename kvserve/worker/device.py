"""What the configuration's names mean to torch on this machine: a dtype name as torch's dtype,
and whether device "auto" finds a GPU. The configuration keeps names (config/names.py); the
worker, which owns the tensors, maps them."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

from kvserve.config.names import DTYPE_NAMES

logger = logging.getLogger(__name__)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4     # glibc's mallopt parameters
STEP_MMAP_THRESHOLD = 32 << 20           # glibc's largest: what a step allocates comes from the heap
STEP_TRIM_THRESHOLD = 256 << 20          # and stays there, up to this much free at the heap's top


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


def keep_step_memory(device) -> bool:
    """On a CPU `device`: glibc's malloc set to keep the memory a step frees (CPU tensors are
    malloc'd). With its defaults, a bfloat16 SmolLM2 step of 64 decode rows took ~6,000 fresh
    pages from the kernel (logits and scratch freed at the heap's top, trimmed, faulted in again):
    620-780 thousand minor faults in 132 steps, 1.1-1.3 s of system time. With a 32 MB mmap
    threshold and a 256 MB trim threshold: 400-3,400 faults and 7% less time (what preloading
    tcmalloc does for vLLM-CPU). Nor does a block past the 32 MB threshold get its own mapping
    (M_MMAP_MAX 0): a float32 prefill of 8,192 tokens allocates 50 MB gate_up and SwiGLU rows a
    layer, each mapped, faulted in page by page and unmapped (a bfloat16 [7,744, 3,072] GEMM 19.6
    ms into a fresh tensor, 7.2 into a kept one): the default model's 64 x 128 prefill took
    340-530 thousand faults, 70 thousand from the heap; 1.14-1.18x the tokens/s. (Keeping 512 MB
    at the top took the faults to a few dozen for no measurable speed and 0.28 GB more resident
    at 64 served streams.) Called once the runner holds the model and KV pools; what loading
    freed is returned first (malloc_trim), so the memory a load leaves behind does not grow.
    Returns False off the CPU, or where the C library has no mallopt (not glibc)."""
    if torch.device(device).type != "cpu":
        return False
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    malloc_trim(0)
    ok = (mallopt(M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD) == 1
          and mallopt(M_MMAP_MAX, 0) == 1)
    logger.debug("malloc keeps step memory: %s", ok)
    return ok


def cuda_memory(device) -> tuple[int, int]:
    """(total bytes of `device`, bytes torch's allocator holds on it now)."""
    _, total = torch.cuda.mem_get_info(device)
    return total, torch.cuda.memory_reserved(device)
