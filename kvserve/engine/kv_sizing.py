"""How many KV blocks the pool gets (seed 003's memory budget): `num_kv_blocks` when given,
else the byte budget over the bytes of one block of this rank's KV heads -- 1 GiB on CPU, on
CUDA vLLM's `gpu_memory_utilization` rule -- never more than every seat at max_model_len needs.

A draft model (speculative decoding, spec_decode/draft.py) keeps its own pool inside the same
budget: both pools get the same number of blocks, so both hold the same number of tokens, and
the budget splits between them in proportion to their bytes per token (target + draft per
block). On CUDA the draft's weights, loaded after the budget is measured, are taken off it."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING


from kvserve.worker.device import cuda_memory
from kvserve.worker.model_runner import ModelRunner
from kvserve.kv.manager import cdiv

if TYPE_CHECKING:
    from kvserve.config.resolved import Config

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class KVPoolSizes:
    """The KV pools of one rank: `num_blocks` each for the target and (when there is one) the draft."""
    num_blocks: int
    block_size: int
    target_bytes_per_block: int
    draft_bytes_per_block: int = 0       # 0: no draft model
    budget: int | None = None            # the bytes split between the pools (None: num_kv_blocks given)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        target = self.num_blocks * self.target_bytes_per_block
        text = f"KV pools: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens"
        if not self.draft_bytes_per_block:
            return f"{text}, {target / 2**20:.1f} MiB"
        draft = self.num_blocks * self.draft_bytes_per_block
        share = target / (target + draft)
        return (f"{text} for the target ({target / 2**20:.1f} MiB, {share:.0%}) and as many for the "
                f"draft model ({draft / 2**20:.1f} MiB, {1 - share:.0%})"
                + (f" of a {self.budget / 2**20:.1f} MiB budget" if self.budget is not None else ""))


def kv_pool_sizes(r: "Config", rank_model_cfg, model_cfg, device) -> KVPoolSizes:
    """`r`: the engine's resolved Config (config/resolved.py); `rank_model_cfg`: the slice of the
    model this process holds (its KV heads); `model_cfg` the whole target (a "self" draft's shape)."""
    from kvserve.spec_decode.draft import draft_footprint

    c = r.cache
    per_block = ModelRunner.kv_bytes_per_block(rank_model_cfg, c.block_size, r.model.dtype, c.kv_cache_dtype)
    draft_per_block, draft_weights = draft_footprint(r, model_cfg)
    if c.num_kv_blocks is not None:
        return KVPoolSizes(c.num_kv_blocks, c.block_size, per_block, draft_per_block)
    budget = c.kv_cache_memory
    if budget is None:
        budget = (cuda_kv_budget(r, model_cfg, device) - draft_weights if str(device).startswith("cuda")
                  else DEFAULT_CPU_KV_BYTES)
    cap = r.scheduler.max_num_seqs * cdiv(r.model.max_model_len, c.block_size) + 1
    both = per_block + draft_per_block
    n = min(budget // both - 1, cap)     # each pool also holds its null block (kv/block_pool.py)
    if n < 1:
        raise ValueError(f"kv_cache_memory={budget} bytes holds no block of {both} bytes"
                         + (f" ({per_block} for the target, {draft_per_block} for the draft model)"
                            if draft_per_block else "") + ".")
    return KVPoolSizes(int(n), c.block_size, per_block, draft_per_block, budget)


def served_context(r: "Config", num_blocks: int) -> int:
    """The served context, one number for the frontend's checks, the scheduler and the server:
    the model's max_model_len, or what the pool holds if that is less (a sequence of n tokens
    needs KV slots for n - 1 of them; blocks x block_size always fits an empty pool)."""
    held = num_blocks * r.cache.block_size
    if held < r.model.max_model_len:
        logger.warning("the KV cache holds %d tokens, fewer than max_model_len %d: serving with "
                       "max_model_len %d (raise --num-kv-blocks / --kv-cache-memory, or set "
                       "--max-model-len, to say so yourself)", held, r.model.max_model_len, held)
        return held
    return r.model.max_model_len


def num_kv_blocks(r: "Config", rank_model_cfg, model_cfg, device) -> int:
    """The number of blocks of the target's pool (`kv_pool_sizes`); logs the split with a draft."""
    sizes = kv_pool_sizes(r, rank_model_cfg, model_cfg, device)
    if sizes.draft_bytes_per_block:
        logger.info(sizes.describe())
    return sizes.num_blocks


def cuda_kv_budget(r: "Config", m, device) -> int:
    """vLLM's rule, as `kvserve plan kv` assumes: gpu_memory_utilization x total device
    memory, less what is in use (weights) and an activation reserve for one full step."""
    total, used = cuda_memory(device)
    width = 3 * m.hidden_size + 2 * m.intermediate_size + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    activations = 4 * (r.scheduler.max_num_batched_tokens * width + r.scheduler.max_num_seqs * m.vocab_size)
    budget = int(r.cache.gpu_memory_utilization * total) - used - activations
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={r.cache.gpu_memory_utilization} of {total / 2**30:.1f} GiB "
                         f"leaves no room for the KV cache after {used / 2**30:.1f} GiB of weights and "
                         f"{activations / 2**30:.1f} GiB of activations: raise it, or lower "
                         "max_num_batched_tokens / max_num_seqs.")
    return budget
