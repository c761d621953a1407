"""Property tests for the block pool: no leak, no double free, refcounts == holders."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.block_pool import NULL_BLOCK, BlockPool
from kvserve.kv.manager import KVCacheManager


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(1, 40)),
                max_size=60), st.integers(1, 30), st.sampled_from([1, 4, 16]))
def test_manager_never_leaks(ops, num_blocks, block_size):
    kv = KVCacheManager(num_blocks, block_size)
    sizes: dict[str, int] = {}
    for op, who, n in ops:
        rid = f"r{who}"
        if op == "grow":
            target = sizes.get(rid, 0) + n
            before = kv.num_free_blocks
            if kv.allocate_slots(rid, target):
                sizes[rid] = target
                assert len(kv.block_tables[rid]) * block_size >= target
            else:
                assert kv.num_free_blocks == before
        else:
            kv.free(rid)
            sizes.pop(rid, None)
        kv.check_integrity()
    for rid in list(kv.block_tables):
        kv.free(rid)
    kv.check_integrity()
    assert kv.num_free_blocks == num_blocks


def test_double_free_is_caught():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])


def test_free_queue_reuses_oldest_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.free([c, a, b])
    assert [x.block_id for x in pool.allocate(3)] == [c.block_id, a.block_id, b.block_id]


def test_the_pool_never_hands_out_the_null_block():
    """Block 0 is the null block (block-table padding points at it): usable ids are 1..num_blocks."""
    kv = KVCacheManager(6, 4)
    assert kv.allocate_slots("r", 6 * 4)
    assert sorted(kv.block_ids("r")) == [1, 2, 3, 4, 5, 6]
    assert not kv.allocate_slots("s", 1)
    kv.free("r")
    kv.check_integrity()
    assert kv.num_free_blocks == 6 and NULL_BLOCK not in {b.block_id for b in kv.pool.free_queue}
