"""Prefix caches (hash chain, radix tree), copy on write and swapping at the KV-manager level:
what hits, what is copied, what is evicted, and that isolation by cache salt holds."""
from __future__ import annotations

import pytest

from kvserve.engine.request import Request
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix_cache import hash_block
from kvserve.sample.params import SamplingParams

BS = 4


def req(rid, tokens, salt=None):
    return Request(rid, list(tokens), SamplingParams(), cache_salt=salt)


def run_prefill(kv, r):
    """Admit r at its hit, 'compute' the whole prompt, label its blocks. Returns the hit tokens."""
    hit = kv.lookup(r)
    assert kv.allocate_prefill(r, hit, r.num_tokens) == hit
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r)
    kv.take_pending()
    kv.check_integrity()
    return hit.num_tokens


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_shared_prefix_hits_and_the_cap_keeps_the_last_token(kind):
    kv = KVCacheManager(32, BS, prefix_cache=kind)
    a = req("a", range(10, 22))                      # 12 tokens: 3 full blocks
    assert run_prefill(kv, a) == 0
    kv.free("a", a)
    b = req("b", range(10, 22))                      # the same block-aligned prompt
    hit = kv.lookup(b)
    if kind == "hash":
        assert hit.num_tokens == 8                   # the whole last block is recomputed
    else:
        assert hit.num_tokens == 11 and hit.copy_len == 3   # token-granular, last block copied
    assert hit.num_tokens < b.num_tokens
    c = req("c", list(range(10, 18)) + [99, 98, 97, 96, 95])
    assert kv.lookup(c).num_tokens == 8


def test_chained_hashes_commit_to_the_whole_prefix():
    h1 = hash_block(b"", [1, 2, 3, 4])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(hash_block(b"", [9, 2, 3, 4]), [5, 6, 7, 8])
    kv = KVCacheManager(32, BS, prefix_cache="hash")
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prefill(kv, a)
    kv.free("a", a)
    b = req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])         # second block equal, first differs
    assert kv.lookup(b).num_tokens == 0


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_cache_salt_isolates_tenants(kind):
    kv = KVCacheManager(32, BS, prefix_cache=kind)
    a = req("a", range(40, 57), salt="tenant-a")
    run_prefill(kv, a)
    kv.free("a", a)
    assert kv.lookup(req("x", range(40, 57), salt="tenant-b")).num_tokens == 0
    assert kv.lookup(req("y", range(40, 57))).num_tokens == 0
    assert kv.lookup(req("z", range(40, 57), salt="tenant-a")).num_tokens == 16


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_tail_first_release_keeps_shared_heads_longest(kind):
    kv = KVCacheManager(6, BS, prefix_cache=kind)
    a = req("a", range(100, 113))                    # 4 blocks (3 full + 1 token)
    run_prefill(kv, a)
    kv.free("a", a)
    # Four fresh blocks: the two never used, then a's last two blocks (least recently freed).
    other = req("o", range(300, 316))
    run_prefill(kv, other)
    b = req("b", range(100, 113))
    assert kv.lookup(b).num_tokens == 8, "the head blocks must outlive the tail"
    assert kv.pool.num_evictions >= 1


def test_radix_partial_block_is_copied_not_shared():
    kv = KVCacheManager(16, BS, prefix_cache="radix")
    a = req("a", [1, 2, 3, 4, 5, 6])                 # 1 full block + partial [5, 6]
    run_prefill(kv, a)
    kv.free("a", a)                                  # the partial tail stays as a leaf
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hit = kv.lookup(b)
    assert hit.num_tokens == 6 and hit.copy_len == 2 and hit.copy_src is not None
    assert kv.allocate_prefill(b, hit, b.num_tokens) == hit       # the scheduler starts b at 6
    ops = kv.take_pending()
    assert ops.copies == [(hit.copy_src.block_id, kv.block_tables["b"][1].block_id)]
    assert kv.block_tables["b"][0] is hit.blocks[0]
    assert b.num_computed_tokens == 0, "the KV manager never writes a request's fields"
    kv.check_integrity()


def test_radix_exact_fit_drops_the_partial_copy_instead_of_refusing():
    """Defect 5: a prompt needing the whole pool, with a partial-block hit whose source is free,
    was never admitted (the copy's source counted as one block too many)."""
    kv = KVCacheManager(3, BS, prefix_cache="radix")
    a = req("a", [1, 2, 3, 4, 5, 6])                 # block 0 full, partial leaf [5, 6]
    run_prefill(kv, a)
    kv.free("a", a)
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])   # needs all 3 blocks
    hit = kv.lookup(b)
    assert hit.copy_src is not None and hit.num_tokens == 6
    used = kv.allocate_prefill(b, hit, b.num_tokens)
    assert used is not None, "an exact-fit prompt must be admitted into an empty pool"
    assert used.copy_src is None and used.num_tokens == 4 and used.blocks == hit.blocks
    assert not kv.take_pending().copies and kv.num_free_blocks == 0
    kv.check_integrity()


def test_radix_salt_roots_are_made_by_labelling_and_pruned_with_their_last_block():
    """Defect 7: a lookup made a root per cache_salt, and roots were never dropped."""
    kv = KVCacheManager(4, BS, prefix_cache="radix")
    for i in range(50):
        assert kv.lookup(req(f"q{i}", range(10, 19), salt=f"s{i}")).num_tokens == 0
    assert not kv.cache.roots, "a pure lookup must not create a root"
    for i in range(6):                               # 6 salts through a 4-block pool
        r = req(f"r{i}", range(10, 15), salt=f"t{i}")    # one full block + a partial tail
        run_prefill(kv, r)
        kv.free(r.request_id, r)
        kv.check_integrity()                         # includes: no root without children
    assert len(kv.cache.roots) <= 4 < 6, "roots of evicted salts must be dropped"
    assert all(root.children for root in kv.cache.roots.values())


def test_copy_on_write_copies_a_shared_partial_block_once():
    kv = KVCacheManager(16, BS)
    p = req("p", range(10, 16))                      # 6 tokens: block 1 half full
    kv.allocate_prefill(p, kv.lookup(p), 6)
    p.num_computed_tokens = 6
    kv.fork("p", "c")
    assert all(b.ref_cnt == 2 for b in kv.block_tables["p"])
    kv.check_integrity()
    assert kv.allocate_slots("c", 7, num_computed=6)   # c writes position 6: copy block 1
    ops = kv.take_pending()
    assert len(ops.copies) == 1 and kv.stats.cow_copies == 1
    assert kv.block_tables["c"][0] is kv.block_tables["p"][0]
    assert kv.block_tables["c"][1] is not kv.block_tables["p"][1]
    assert kv.allocate_slots("p", 7, num_computed=6)   # p is now the only holder: no copy
    assert kv.stats.cow_copies == 1
    kv.check_integrity()
    kv.free("p"), kv.free("c")
    kv.check_integrity()
    assert kv.num_free_blocks == 16


def test_swap_keeps_sharing_and_frees_the_gpu():
    kv = KVCacheManager(16, BS, num_cpu_blocks=8)
    p = req("p", range(10, 16))
    kv.allocate_prefill(p, kv.lookup(p), 6)
    kv.fork("p", "c")
    c = req("c", range(10, 16))
    assert kv.swap_out([p, c])
    ops = kv.take_pending()
    assert len(ops.swap_out) == 2                    # two distinct blocks, shared ones once
    assert kv.num_free_blocks == 16 and kv.swap_space.num_free_blocks == 6
    kv.check_integrity()
    assert kv.swap_in([p, c])
    ops = kv.take_pending()
    assert len(ops.swap_in) == 2
    assert [b.block_id for b in kv.block_tables["p"]] == [b.block_id for b in kv.block_tables["c"]]
    assert all(b.ref_cnt == 2 for b in kv.block_tables["p"])
    kv.check_integrity()
    kv.free("p"), kv.free("c")
    kv.take_pending()
    kv.check_integrity()
    assert kv.num_free_blocks == 16 and kv.swap_space.num_free_blocks == 8


def test_pending_moves_never_read_a_block_the_same_batch_wrote():
    """Defect 1's invariant: a swap-in that reads a CPU block a swap-out of the same batch
    reused would read the wrong K/V; such a batch is refused with a message, not run."""
    from kvserve.kv.manager import PendingKVOps
    PendingKVOps(swap_out=[(3, 0)], swap_in=[(1, 5)], copies=[(2, 6)]).check()
    with pytest.raises(AssertionError, match="swap in reads cpu block 0"):
        PendingKVOps(swap_out=[(3, 0)], swap_in=[(0, 5)]).check()
    with pytest.raises(AssertionError, match="copy reads gpu block 5"):
        PendingKVOps(swap_in=[(1, 5)], copies=[(5, 6)]).check()
    with pytest.raises(AssertionError, match="writes gpu block 6 twice"):
        PendingKVOps(swap_in=[(1, 6)], copies=[(2, 6)]).check()


def test_swap_out_refuses_without_space_and_changes_nothing():
    kv = KVCacheManager(16, BS, num_cpu_blocks=1)
    p = req("p", range(10, 20))
    kv.allocate_prefill(p, kv.lookup(p), 10)
    assert not kv.swap_out([p])
    assert len(kv.block_tables["p"]) == 3 and not kv.take_pending()
    kv.check_integrity()


def test_lookup_and_labelling_are_incremental():
    """No pool scans: a request's hashes are computed once per block and kept by the manager."""
    kv = KVCacheManager(64, BS, prefix_cache="hash")
    a = req("a", range(200, 240))
    run_prefill(kv, a)
    assert len(kv.cache_state["a"].block_hashes) == 10
    calls = []
    import kvserve.kv.prefix_cache as pc
    orig = pc.hash_block
    pc.hash_block = lambda *args: calls.append(1) or orig(*args)
    try:
        kv.cache_blocks(a)
        b = req("b", range(200, 240))
        kv.lookup(b)
        kv.lookup(b)
    finally:
        pc.hash_block = orig
    assert len(calls) == 9, "a's hashes are not recomputed; b's 9 are computed once"
    kv.free("a", a)
    assert "a" not in kv.cache_state
