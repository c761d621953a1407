"""KV cache manager: per-request block tables over the shared pool (seed 003, paging).

`allocate_slots` grows a request's block table so that its next `num_new_tokens` tokens have
slots; `free` returns the request's blocks, tail first. The slot of token position `p` of a
request is `block_table[p // block_size] * block_size + p % block_size`.
"""
from __future__ import annotations

from kvserve.kv.block_pool import BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[KVBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks required for the request to hold `num_tokens` tokens in all."""
        held = len(self.block_tables.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def allocate_slots(self, request_id: str, num_tokens: int, reserve: int = 0) -> bool:
        """Make room for `num_tokens` tokens in all; False (and no change) if the pool is short.
        `reserve` free blocks must remain afterwards (the admission watermark)."""
        need = self.blocks_needed(request_id, num_tokens)
        if need + reserve > self.pool.num_free_blocks:
            return False
        if need:
            self.block_tables.setdefault(request_id, []).extend(self.pool.allocate(need))
        else:
            self.block_tables.setdefault(request_id, [])
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, ())]

    def free(self, request_id: str) -> None:
        """Return every block of the request, tail first, so that shared heads live longest."""
        blocks = self.block_tables.pop(request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        counts: dict[int, int] = {}
        for blocks in self.block_tables.values():
            for b in blocks:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == counts.get(b.block_id, 0), (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {counts.get(b.block_id, 0)} tables")
