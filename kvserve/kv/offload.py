"""CPU swap space for preemption by swapping (seed 003, "When memory runs out": "Swap. Copy its
blocks to CPU memory over PCIe, and copy them back when there is room").

Bookkeeping only: which CPU block ids are free and how many swapped block tables hold each one
(blocks shared by the samples or beams of one request are swapped once). The tensors live in
the model runner (`ModelRunner.init_swap_space`), which performs the copies the KV cache
manager queues.
"""
from __future__ import annotations


class CpuSwapSpace:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))   # pop() hands out 0, 1, 2, ...
        self.ref_cnt = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise RuntimeError(f"asked for {n} CPU swap blocks, {len(self.free_ids)} free")
        out = [self.free_ids.pop() for _ in range(n)]
        for i in out:
            self.ref_cnt[i] = 1
        return out

    def incref(self, i: int) -> None:
        self.ref_cnt[i] += 1

    def decref(self, i: int) -> None:
        if self.ref_cnt[i] <= 0:
            raise RuntimeError(f"double free of CPU swap block {i}")
        self.ref_cnt[i] -= 1
        if self.ref_cnt[i] == 0:
            self.free_ids.append(i)

    def check_integrity(self, holders: dict[int, int]) -> None:
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a CPU block is free twice"
        for i in range(self.num_blocks):
            assert self.ref_cnt[i] == holders.get(i, 0), f"CPU block {i}: ref_cnt != holders"
            assert (self.ref_cnt[i] == 0) == (i in free), f"CPU block {i}: free list out of sync"
