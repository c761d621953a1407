"""The shared pool of KV blocks (seed 003, "Why the cache needs pages").

The pool knows nothing about requests: it hands out physical block ids, counts how many
block tables hold each block (`ref_cnt`), and keeps the free blocks in a queue. The queue
is a doubly linked list so that a block can leave it from the middle in O(1) (a prefix-cache
hit on a freed-but-still-labelled block), and so that eviction takes the least recently
freed block first.

Block 0 is the null block: every layer's cache has one row more than the pool has blocks, and
row 0 is never handed out (the usable ids are 1..num_blocks), so padding in a block table
(kvserve/worker/input_batch.py) points at a block no request owns, whose K/V stay zero.
`num_blocks` counts the usable blocks; the KV tensors hold `num_blocks + 1`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

NULL_BLOCK = 0        # the block id that block-table padding points to; never allocated


@dataclass(eq=False)
class KVBlock:
    """One physical block of `block_size` token slots in every layer's cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block holds a full, cacheable block
    prev: "KVBlock | None" = field(default=None, repr=False)
    next: "KVBlock | None" = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks: popleft, append and remove are O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        if self.num_free == 0:
            raise RuntimeError("no free KV blocks")
        block = self._head.next
        self.remove(block)
        return block

    def __iter__(self):
        node = self._head.next
        while node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    """All usable KV blocks (ids 1..num_blocks), their reference counts and the free queue."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(NULL_BLOCK + 1, num_blocks + 1)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # Called with a block that is about to be reused for new contents, so that a prefix
        # cache can forget its label. Set by the prefix cache, None without one.
        self.on_evict = None
        self.num_evictions = 0  # labelled (cached) blocks reused for new contents

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks held by at least one request (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` blocks off the free queue (oldest first), each with ref_cnt 1."""
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(block)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, block: KVBlock) -> None:
        """Take one more reference on `block`, pulling it off the free queue if it was free."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue's tail
        in the order given (callers pass tail blocks first so that shared heads live longest)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def check_integrity(self) -> None:
        """free + used == total, the free queue holds exactly the unreferenced blocks."""
        free_ids = [b.block_id for b in self.free_queue]
        assert len(free_ids) == self.free_queue.num_free, "free queue length out of sync"
        assert len(set(free_ids)) == len(free_ids), "a block is in the free queue twice"
        unreferenced = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert set(free_ids) == unreferenced, "free queue != blocks with ref_cnt 0"
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref_cnt"
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
