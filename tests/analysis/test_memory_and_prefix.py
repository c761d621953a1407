"""Paging policies, the block allocator, and prefix-cache hit rates (seed 003)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.analysis.kvmath import kv_budget, kv_bytes_per_token
from kvserve.analysis.paging import BlockAllocator, batch_capacity, simulate_paging, widget_trace
from kvserve.analysis.prefix import (HashChainCache, RadixCache, block_hashes, chat_trace, prefix_hit_rate,
                                     trace_hashes)
from kvserve.analysis.simulate import exponential_lengths
from kvserve.analysis.specs import HARDWARE, MODELS


# -- BlockAllocator ----------------------------------------------------------------------------------
def test_allocator_copy_on_write_of_shared_partial_block():
    a = BlockAllocator(8, 4)
    a.allocate("p", 6)                 # 2 blocks, the second half full
    a.fork("p", "s")                   # the sample shares both
    assert a.n_free == 6
    a.allocate("s", 7)                 # writing into the shared partial block copies it
    assert len(a.copies) == 1 and a.tables["s"][0] == a.tables["p"][0] and a.tables["s"][1] != a.tables["p"][1]
    a.allocate("s", 9)                 # a fresh block, no copy
    assert len(a.copies) == 1 and a.n_free == 4
    a.free("p"); a.free("s")
    assert a.n_free == 8


def test_allocator_out_of_blocks_leaves_state_unchanged():
    a = BlockAllocator(2, 4)
    a.allocate("x", 5)
    with pytest.raises(MemoryError):
        a.allocate("y", 5)
    assert "y" not in a.tables and a.n_free == 0


@given(st.lists(st.tuples(st.sampled_from("alloc fork free".split()), st.integers(0, 5), st.integers(1, 40)),
                max_size=60))
@settings(max_examples=80, deadline=None, derandomize=True)
def test_allocator_refcounts_stay_consistent(ops):
    a = BlockAllocator(16, 4)
    for op, s, n in ops:
        try:
            if op == "alloc":
                a.allocate(s, max(n, a.lengths.get(s, 0)))
            elif op == "fork" and s in a.tables and (s + 1) % 6 not in a.tables:
                a.fork(s, (s + 1) % 6)
            elif op == "free":
                a.free(s)
        except MemoryError:
            pass
        held = {}
        for t in a.tables.values():
            for b in t:
                held[b] = held.get(b, 0) + 1
        assert all(a.refcount[b] == c for b, c in held.items())
        assert len(held) + a.n_free == a.n_blocks
        assert all(a.lengths[s] <= len(t) * a.block_size for s, t in a.tables.items())


# -- the allocator widget (seed 003) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def widget_runs():
    out = {}
    for seed in range(10):
        tr = widget_trace(seed)
        for pol in ("reserve", "paged", "shared"):
            out[(seed, pol, 1)] = simulate_paging(tr, pol, 1, n_steps=160)
            out[(seed, pol, 4)] = simulate_paging(tr, pol, 4, n_steps=320)
    return out


def _avg(runs, pol, n, key):
    return np.mean([runs[(s, pol, n)][key] for s in range(10)])


def test_paging_fits_about_twice_the_sequences(widget_runs):
    # seed 003 widget at step 160, one sample: reserving runs 3 sequences and has finished 3, paging runs
    # 6 and has finished 9. Ours (mean of 10 traces; the widget's random draws are not given):
    run_r, run_p = _avg(widget_runs, "reserve", 1, "running_sequences"), _avg(widget_runs, "paged", 1,
                                                                              "running_sequences")
    assert 2 <= run_r <= 4 and 4.5 <= run_p <= 7
    assert run_p >= 1.5 * run_r
    assert _avg(widget_runs, "paged", 1, "finished") > 1.4 * _avg(widget_runs, "reserve", 1, "finished")


def test_four_samples_reserve_one_at_a_time_and_sharing_finishes_most(widget_runs):
    # seed 003: with 4 samples, reserving runs one request at a time and turns some away; paging without
    # sharing turns nobody away; sharing runs more and finishes most (2, 4, 7 by step 320 in the seed).
    for s in range(10):
        r = widget_runs[(s, "reserve", 4)]
        assert max(h["running_requests"] for h in r["history"]) <= 1
        assert widget_runs[(s, "paged", 4)]["rejected"] == 0 == widget_runs[(s, "shared", 4)]["rejected"]
    assert sum(widget_runs[(s, "reserve", 4)]["rejected"] for s in range(10)) > 0
    f = {p: _avg(widget_runs, p, 4, "finished") for p in ("reserve", "paged", "shared")}
    assert f["shared"] > f["paged"] >= f["reserve"] and f["shared"] >= 1.5 * f["paged"]


def test_batch_capacity_paging_vs_reservation():
    # seed 003's paging cell: Llama 3.1 8B, bf16, H100, 90% memory; 5,000 mid-decode sequences, prompts
    # of mean 1,000, outputs of mean 250 and at most 1,024 (we draw each one's progress uniformly).
    rng = np.random.default_rng(0)
    m = MODELS["llama-3.1-8b"]
    budget = kv_budget(HARDWARE["h100"].memory, m)
    P = exponential_lengths(5000, 1000, rng)
    O = exponential_lengths(5000, 250, rng, maximum=1024)
    so_far = (rng.random(5000) * O).astype(int)
    cap = batch_capacity(budget, kv_bytes_per_token(m), P, so_far, 1024, 8192)
    assert cap["reserve-context"][0] < cap["reserve-max"][0] < cap["paged"][0] <= cap["exact"][0]
    assert cap["paged"][1] > 0.98                        # paging wastes under one block per sequence
    assert cap["paged"][0] >= 1.5 * cap["reserve-max"][0]


# -- prefix caching (seed 003) ------------------------------------------------------------------------
def test_block_hashes_chain_and_extra_keys():
    a = list(range(48))
    b = [999] + list(range(1, 48))
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 3 and len(block_hashes(a[:47], 16)) == 2         # no hash for a partial block
    assert ha[1] != hb[1] and a[16:32] == b[16:32]                     # same block, different prefix
    assert block_hashes(a, 16, extra=("salt",))[2] != ha[2]            # a salt changes every hash
    assert block_hashes(a, 16) == ha


def test_radix_matches_to_the_token_hash_to_the_block():
    r, h = RadixCache(), HashChainCache(1e9, 16)
    seq = list(range(100))
    r.insert(seq); h.insert(seq)
    q = list(range(40)) + [7777] * 10
    assert r.match(q) == 40 and h.lookup(q) == 32
    assert r.match(seq) == 99 and h.lookup(seq) == 96                  # capped one token short


@pytest.fixture(scope="module")
def trace():
    tr = chat_trace(seed=0)
    return tr, trace_hashes(tr)


def test_unlimited_cache_hits_more_than_nine_in_ten(trace):
    # seed 003: 120 interleaved conversations, 3 system prompts of 600-2,000 tokens, 1-6 turns:
    # "With an unlimited cache, more than nine in ten prompt tokens are hits"
    tr, hs = trace
    hc = prefix_hit_rate(tr, HashChainCache(float("inf")), hs)["hit_rate"]
    rx = prefix_hit_rate(tr, RadixCache())["hit_rate"]
    assert hc > 0.9 and rx >= hc


def test_smaller_pools_hit_less(trace):
    tr, hs = trace
    rates = [prefix_hit_rate(tr, HashChainCache(cap / 16), hs)["hit_rate"] for cap in (4000, 20000, 100000)]
    assert rates[0] < rates[1] < rates[2]
    r = RadixCache(20000)
    prefix_hit_rate(tr, r)
    assert r.size <= 20000


@given(st.integers(1, 2000), st.integers(1, 2000))
@settings(max_examples=25, deadline=None, derandomize=True)
def test_hash_chain_lru_is_monotone_in_pool_size(a, b):
    # LRU over a reference string that does not depend on the pool is a stack algorithm: a bigger pool
    # holds a superset of blocks at every moment, so its chained-hash hits can only be longer.
    tr = _small_trace()
    lo, hi = sorted((a, b))
    h_lo = prefix_hit_rate(tr[0], HashChainCache(lo), tr[1])["hit_tokens"]
    h_hi = prefix_hit_rate(tr[0], HashChainCache(hi), tr[1])["hit_tokens"]
    assert h_lo <= h_hi


_SMALL = []


def _small_trace():
    if not _SMALL:
        tr = chat_trace(n_conversations=20, seed=3)
        _SMALL.append((tr, trace_hashes(tr)))
    return _SMALL[0]
