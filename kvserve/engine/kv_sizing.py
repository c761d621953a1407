"""How many KV blocks the pool gets (seed 003's memory budget): `num_kv_blocks` when given,
else the byte budget over the bytes of one block of this rank's KV heads -- 1 GiB on CPU, on
CUDA vLLM's `gpu_memory_utilization` rule -- never more than every seat at max_model_len needs."""
from __future__ import annotations

import torch

from kvserve.worker.model_runner import ModelRunner
from kvserve.kv.manager import cdiv

DEFAULT_CPU_KV_BYTES = 1 << 30


def num_kv_blocks(cfg, rank_model_cfg, model_cfg, device: torch.device) -> int:
    """`rank_model_cfg`: the slice of the model this process holds (its KV heads)."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    per_block = ModelRunner.kv_bytes_per_block(rank_model_cfg, cfg.block_size, cfg.torch_dtype,
                                               cfg.kv_cache_dtype)
    budget = cfg.kv_cache_memory
    if budget is None:
        budget = cuda_kv_budget(cfg, model_cfg, device) if device.type == "cuda" else DEFAULT_CPU_KV_BYTES
    cap = cfg.max_num_seqs * cdiv(cfg.max_model_len, cfg.block_size) + 1
    n = min(budget // per_block, cap)
    if n < 1:
        raise ValueError(f"kv_cache_memory={budget} bytes holds no block of {per_block} bytes.")
    return int(n)


def cuda_kv_budget(cfg, m, device: torch.device) -> int:
    """vLLM's rule, as `kvserve plan kv` assumes: gpu_memory_utilization x total device
    memory, less what is in use (weights) and an activation reserve for one full step."""
    _, total = torch.cuda.mem_get_info(device)
    used = torch.cuda.memory_reserved(device)
    width = 3 * m.hidden_size + 2 * m.intermediate_size + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    activations = 4 * (cfg.max_num_batched_tokens * width + cfg.max_num_seqs * m.vocab_size)
    budget = int(cfg.gpu_memory_utilization * total) - used - activations
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={cfg.gpu_memory_utilization} of {total / 2**30:.1f} GiB "
                         f"leaves no room for the KV cache after {used / 2**30:.1f} GiB of weights and "
                         f"{activations / 2**30:.1f} GiB of activations: raise it, or lower "
                         "max_num_batched_tokens / max_num_seqs.")
    return budget
