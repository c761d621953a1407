"""The Responses API's store per tenant (server/openai/responses/store.py), in process: one tenant's
burst past its quota of entries or of bytes, or past the global bound, evicts only its own
entries; the global bound holds; over it the tenant holding the most loses its oldest (ties: the
oldest entry), a put whose one entry the rule would evict is refused with nothing evicted; and,
over random puts and deletes of many tenants, no tenant within its fair share loses an entry to
another's put. The same through `kvserve serve`'s flags and HTTP: test_responses_api.py."""
from __future__ import annotations

import argparse
import random

import pytest

from kvserve.server.openai.responses.protocol import MessageItem
from kvserve.server.openai.responses.store import MAX_STORED_RESPONSES, ResponseStore, entry_size

ITEMS = [MessageItem(role="user", content="hello")]


def resp(rid: str, text: str = "x") -> dict:
    return {"id": rid, "text": text}


def size(rid: str, text: str = "x") -> int:
    return entry_size(resp(rid, text), ITEMS)


def kept(store: ResponseStore, tenant: str, rids) -> list[str]:
    return [r for r in rids if store.get(r, tenant) is not None]


def test_a_burst_past_the_tenants_entry_quota_evicts_only_its_own():
    store = ResponseStore(max_entries=10, max_bytes=1 << 20, tenant_entries=6)
    bobs = [f"b{i}" for i in range(3)]
    for r in bobs:
        assert store.put("bob", resp(r), ITEMS)
    alices = [f"a{i}" for i in range(50)]
    for r in alices:
        assert store.put("alice", resp(r), ITEMS)
        assert store.held("alice")[0] <= 6 and len(store) <= 10
    assert kept(store, "bob", bobs) == bobs
    assert kept(store, "alice", alices) == alices[-6:]          # its newest, within its quota
    assert store.held("bob") == (3, sum(size(r) for r in bobs))
    assert store.nbytes == sum(size(r) for r in bobs + alices[-6:])


def test_the_reported_burst_of_1030_leaves_the_other_tenants_response():
    """The review's case at the default bounds: one tenant's 1,030 responses, then the other's."""
    store = ResponseStore()
    assert store.put("bob", resp("resp_bob"), ITEMS)
    for i in range(1030):
        assert store.put("alice", resp(f"resp_{i}"), ITEMS)
    assert len(store) == MAX_STORED_RESPONSES
    assert store.get("resp_bob", "bob") is not None
    assert store.held("alice")[0] == MAX_STORED_RESPONSES - 1 and store.get("resp_6", "alice") is None
    assert store.get("resp_7", "alice") is not None


def test_a_burst_past_the_tenants_byte_quota_evicts_only_its_own():
    text = "y" * 300
    one = size("a00", text)
    store = ResponseStore(max_entries=100, max_bytes=10 * one, tenant_bytes=4 * one)
    bobs = ["b00", "b01"]
    for r in bobs:
        assert store.put("bob", resp(r, text), ITEMS)
    alices = [f"a{i:02}" for i in range(30)]
    for r in alices:
        assert store.put("alice", resp(r, text), ITEMS)
        assert store.held("alice")[1] <= 4 * one and store.nbytes <= 10 * one
    assert kept(store, "bob", bobs) == bobs
    assert kept(store, "alice", alices) == alices[-4:]
    # one entry over the tenant's byte quota is not kept, and evicts nothing
    assert not store.put("alice", resp("huge", "z" * (4 * one)), ITEMS)
    assert store.get("huge", "alice") is None and kept(store, "alice", alices) == alices[-4:]


def test_over_the_global_bound_the_tenant_holding_the_most_loses_its_oldest():
    """Every tenant under its quota (the default: the global bound), the store full."""
    text = "y" * 200
    one = size("a00", text)
    store = ResponseStore(max_entries=1000, max_bytes=10 * one)
    others = {t: [f"{t[0]}{i:02}" for i in range(2)] for t in ("bob", "carol")}
    for t, rids in others.items():
        for r in rids:
            assert store.put(t, resp(r, text), ITEMS)
    alices = [f"a{i:02}" for i in range(40)]
    for r in alices:
        assert store.put("alice", resp(r, text), ITEMS)
        assert store.nbytes <= 10 * one
    for t, rids in others.items():
        assert kept(store, t, rids) == rids
    assert kept(store, "alice", alices) == alices[-6:]
    # a newcomer gets in: it evicts from the tenant over its fair share, not from bob or carol
    assert store.put("dave", resp("d00", text), ITEMS)
    assert kept(store, "alice", alices) == alices[-5:]
    for t, rids in others.items():
        assert kept(store, t, rids) == rids


def test_equal_holders_evict_their_own_and_a_tie_takes_the_oldest_entry():
    store = ResponseStore(max_entries=4)
    for r in ("a0", "b0", "a1", "b1"):
        assert store.put(r[0], resp(r), ITEMS)
    assert store.put("a", resp("a2"), ITEMS)        # a holds 3 with it: a's oldest goes
    assert kept(store, "a", ["a0", "a1", "a2"]) == ["a1", "a2"] and kept(store, "b", ["b0", "b1"]) == ["b0", "b1"]
    assert store.put("b", resp("b2"), ITEMS)
    assert kept(store, "b", ["b0", "b1", "b2"]) == ["b1", "b2"]
    # c's first: a and b hold 2 each, and a1 is older than b1
    assert store.put("c", resp("c0"), ITEMS)
    assert kept(store, "a", ["a1", "a2"]) == ["a2"] and kept(store, "b", ["b1", "b2"]) == ["b1", "b2"]
    assert len(store) == 4


def test_a_put_the_rule_would_evict_is_refused_and_evicts_nothing():
    small, big = "y" * 100, "z" * 700
    store = ResponseStore(max_entries=100, max_bytes=3 * size("b", small) + size("a", big) - 1)
    for t in ("b", "c", "d"):
        assert store.put(t, resp(t, small), ITEMS)
    before = store.nbytes
    # alice's one entry, over every other tenant's holding, cannot fit without evicting itself
    assert not store.put("a", resp("a", big), ITEMS)
    assert store.get("a", "a") is None and store.nbytes == before and len(store) == 3
    # one that fits beside them is kept
    assert store.put("a", resp("a", small), ITEMS) and len(store) == 4


def test_delete_and_replace_keep_the_counts():
    store = ResponseStore(max_entries=3, tenant_entries=2)
    assert store.put("a", resp("r", "x"), ITEMS) and store.put("a", resp("r", "longer"), ITEMS)
    assert store.held("a") == (1, size("r", "longer")) and store.get("r", "a").response["text"] == "longer"
    assert not store.delete("r", "b") and store.delete("r", "a") and not store.delete("r", "a")
    assert (len(store), store.nbytes, store.held("a")) == (0, 0, (0, 0))


@pytest.mark.parametrize("bounds", [dict(max_entries=0), dict(max_bytes=0), dict(tenant_entries=0),
                                    dict(max_entries=4, tenant_entries=5), dict(max_bytes=10, tenant_bytes=11)])
def test_bounds_are_refused_when_they_hold_nothing_or_a_quota_is_over_the_global(bounds):
    with pytest.raises(ValueError):
        ResponseStore(**bounds)


@pytest.mark.parametrize("seed", range(4))
def test_random_puts_keep_the_bounds_and_spare_tenants_within_their_fair_share(seed):
    rng = random.Random(seed)
    store = ResponseStore(max_entries=30, max_bytes=6000, tenant_entries=rng.choice([12, 30]),
                          tenant_bytes=rng.choice([2500, 6000]))
    tenants = [f"t{i}" for i in range(rng.randint(2, 8))]
    mine = {t: [] for t in tenants}
    for n in range(1500):
        t = rng.choice(tenants)
        if mine[t] and rng.random() < 0.1:
            assert store.delete(mine[t].pop(rng.randrange(len(mine[t]))), t)
            continue
        rid = f"r{n}"
        before = {u: store.held(u) for u in tenants}
        holders = sum(1 for u in tenants if before[u][0] or u == t)
        stored = store.put(t, resp(rid, "w" * rng.choice([10, 50, 300, 900, 3000])), ITEMS)
        if stored:
            mine[t].append(rid)
        else:
            assert {u: store.held(u) for u in tenants} == before     # nothing evicted
        after = store.held(t)
        for u in tenants:
            alive = kept(store, u, mine[u])
            if u != t and alive != mine[u]:     # u lost entries to t's put: it held more than its share
                share = (before[u][0] > store.max_entries / holders or before[u][1] > store.max_bytes / holders)
                assert share, (u, before[u], t, before[t])
                assert before[u][0] >= after[0] or before[u][1] >= after[1], (u, before[u], t, after)
            mine[u] = alive
        assert len(store) <= store.max_entries and store.nbytes <= store.max_bytes
        assert len(store) == sum(store.held(u)[0] for u in tenants)
        for u in tenants:
            assert store.held(u)[0] <= store.tenant_entries and store.held(u)[1] <= store.tenant_bytes


def test_serve_flags_make_the_store():
    from kvserve.server.cli import add_cli_args, response_store

    p = argparse.ArgumentParser()
    add_cli_args(p)
    default = response_store(p.parse_args([]))
    assert (default.max_entries, default.max_bytes, default.tenant_entries, default.tenant_bytes) == (
        1024, 64 << 20, 1024, 64 << 20)
    s = response_store(p.parse_args(["--max-stored-responses", "50", "--max-stored-response-bytes", "9000",
                                     "--max-stored-responses-per-tenant", "10",
                                     "--max-stored-response-bytes-per-tenant", "3000"]))
    assert (s.max_entries, s.max_bytes, s.tenant_entries, s.tenant_bytes) == (50, 9000, 10, 3000)
    with pytest.raises(ValueError, match="quota"):
        response_store(p.parse_args(["--max-stored-responses", "8", "--max-stored-responses-per-tenant", "9"]))
