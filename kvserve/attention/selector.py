"""The one selection point for attention (`--attention-backend`, vLLM's flag): a name -> a backend
class, and "auto" decided once per model against its heads, device, dtype and cache dtype.

    select_attention_backend("auto", cfg, device, dtype, kv_cache_dtype) -> FusedCpuAttention | ...

"auto" takes the first of AUTO_ORDER that runs there; a backend asked for by name that cannot run
there is a ValueError naming why, as is a name not in BACKENDS. A new backend is one module and
one line in BACKENDS.
"""
from __future__ import annotations

import logging

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.cpu_fused import FusedCpuAttention
from kvserve.attention.mla import MlaAttention
from kvserve.attention.torch_paged import TorchPagedAttention

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchPagedAttention,        # portable: CPU and CUDA
    "cpu_fused": FusedCpuAttention,      # kvserve's C++ decode kernels, CPU
    "mla": MlaAttention,                 # multi-head latent attention (DeepSeek-V2), CPU and CUDA
}
AUTO_ORDER = ("cpu_fused", "torch", "mla")


def select_attention_backend(name: str, cfg, device, dtype: torch.dtype, kv_cache_dtype: str,
                             log: bool = True) -> type[AttentionBackend]:
    """The backend class `name` means for `cfg` (a ModelConfig, one rank's heads) here."""
    device = torch.device(device)
    if name == "auto":
        skipped = []
        for candidate in AUTO_ORDER:
            why = BACKENDS[candidate].unsupported(cfg, device, dtype, kv_cache_dtype)
            if why is None:
                if log:
                    logger.info("attention backend: %s (auto%s)", candidate,
                                "".join(f"; {s}" for s in skipped))
                return BACKENDS[candidate]
            skipped.append(f"not {candidate}: {why}")
        raise ValueError("no attention backend runs here: " + "; ".join(skipped))
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be auto or one of {', '.join(BACKENDS)}, got {name!r}.")
    why = BACKENDS[name].unsupported(cfg, device, dtype, kv_cache_dtype)
    if why is not None:
        raise ValueError(f"attention backend {name} cannot run this model here ({why}): use "
                         f"--attention-backend auto or torch.")
    if log:
        logger.info("attention backend: %s", name)
    return BACKENDS[name]
