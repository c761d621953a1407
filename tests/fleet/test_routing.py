"""The router's routing key and policies, without servers: the key is the engine's own block hash
chain (salted as the engine salts it), and each policy picks as its docstring says."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from kvserve.fleet.launcher import replica_argv
from kvserve.fleet.prefix_key import RequestHasher, load_tokenizer
from kvserve.fleet.replicas import BlockLRU, ReplicaSet
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.prefix_cache import HashPrefixCache, SeqCacheState
from kvserve.server.openai.chat_renderer import ChatRenderer

from .live import STORIES_HF

NS = "stories|float32|auto"


@pytest.fixture(scope="module")
def hasher():
    return RequestHasher(load_tokenizer(str(STORIES_HF)), block_size=4, namespace=NS)


def engine_hashes(token_ids, salt, block_size=4):
    """What the engine's hash prefix cache labels the same tokens with."""
    cache = HashPrefixCache(BlockPool(8), block_size, NS)
    req = SimpleNamespace(token_ids=list(token_ids), cache_salt=salt, num_tokens=len(token_ids))
    return cache.hashes(req, SeqCacheState(), (len(token_ids) - 1) // block_size)


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_key_is_the_engines_hash_chain(hasher, salt):
    ids = hasher.tokenizer.encode("Once upon a time there was a little dog named Max.")
    key = hasher.request_hashes("/v1/completions", {"prompt": ids, "cache_salt": salt})
    assert key and key == engine_hashes(ids, salt)
    # a text prompt is tokenized as the server tokenizes it
    text = hasher.request_hashes("/v1/completions", {"prompt": "Once upon a time there was a "
                                                     "little dog named Max.", "cache_salt": salt})
    assert text == key


def test_chat_key_uses_the_servers_template(hasher):
    msgs = [{"role": "system", "content": "You tell short stories."},
            {"role": "user", "content": "Tell me about a cat and a ball."}]
    r = ChatRenderer(hasher.tokenizer)
    want = r.encode(r.render(msgs, True))
    assert hasher.prompt_ids("/v1/chat/completions", {"messages": msgs}) == want
    first = hasher.request_hashes("/v1/chat/completions", {"messages": msgs})
    follow = hasher.request_hashes("/v1/chat/completions", {"messages": msgs + [
        {"role": "assistant", "content": "The cat played."}, {"role": "user", "content": "And then?"}]})
    assert len(follow) > len(first) and BlockLRU().match(first) == 0
    lru = BlockLRU()
    lru.add(first)
    # the follow-up turn shares all but (at most) the block where the generation prompt ended
    assert lru.match(follow) >= len(first) - 1 > 0


def test_salts_never_match_each_other(hasher):
    body = {"prompt": "The sun was hot and the children went to the lake to swim."}
    plain = hasher.request_hashes("/v1/completions", body)
    a = hasher.request_hashes("/v1/completions", {**body, "cache_salt": "a"})
    b = hasher.request_hashes("/v1/completions", {**body, "cache_salt": "b"})
    assert not (set(plain) & set(a)) and not (set(a) & set(b)) and not (set(plain) & set(b))
    lru = BlockLRU()
    lru.add(a)
    assert lru.match(a) == len(a) and lru.match(b) == 0 and lru.match(plain) == 0


def test_unroutable_bodies_have_no_key(hasher):
    for body in ({}, {"prompt": 3}, {"messages": "x"}, {"messages": [{"content": "no role"}]},
                 {"prompt": "Once upon a time", "cache_salt": ""}, {"prompt": [5, 6, 7]}):
        assert hasher.request_hashes("/v1/chat/completions" if "messages" in body else
                                     "/v1/completions", body) == []


def test_lru_is_bounded_and_evicts_the_tail_first():
    lru = BlockLRU(capacity=4)
    lru.add([b"a", b"b", b"c"])
    lru.add([b"x", b"y"])
    assert len(lru) == 4 and lru.match([b"x", b"y"]) == 2
    assert lru.match([b"a", b"b"]) == 2 and b"c" not in lru     # the head outlives its tail


def key(*names):
    return [n.encode() for n in names]


def test_cache_aware_prefers_the_longest_match_within_the_balance_threshold():
    rs = ReplicaSet(["http://a", "http://b", "http://c"], "cache-aware", balance_threshold=2)
    a, b, c = rs.replicas
    a.lru.add(key("p1"))
    b.lru.add(key("p1", "p2", "p3"))
    pick = rs.pick(key("p1", "p2", "p3", "p4"))
    assert pick.replica is b and pick.matched_blocks == 3
    b.in_flight = 2                       # 2 over the least loaded: still allowed
    assert rs.pick(key("p1", "p2")).replica is b
    b.in_flight = 3                       # 3 over: skipped, the next best match takes it
    pick = rs.pick(key("p1", "p2"))
    assert pick.replica is a and pick.matched_blocks == 1
    assert rs.pick(key("zz")).replica in (a, c)            # no match: the least loaded


def test_a_hot_prefix_spreads_once_its_replica_queues_up():
    rs = ReplicaSet(["http://a", "http://b"], "cache-aware", balance_threshold=3)
    hot = key("sys", "prompt")
    for _ in range(40):
        p = rs.pick(hot)
        rs.begin(p, hot)                  # none finishes: load only grows
    loads = sorted(r.in_flight for r in rs.replicas)
    assert loads[1] - loads[0] <= 4 and sum(loads) == 40


def test_round_robin_and_least_loaded():
    rs = ReplicaSet(["http://a", "http://b"], "round-robin")
    rs.replicas[0].lru.add(key("p"))
    assert [rs.pick(key("p")).replica.url for _ in range(4)] == ["http://a", "http://b"] * 2
    rs = ReplicaSet(["http://a", "http://b", "http://c"], "least-loaded")
    rs.replicas[0].in_flight, rs.replicas[1].in_flight = 3, 1
    assert rs.pick([]).replica.url == "http://c"


def test_a_replica_taken_out_gets_nothing_until_it_is_back():
    rs = ReplicaSet(["http://a", "http://b"], "cache-aware")
    a, b = rs.replicas
    a.lru.add(key("p"))
    rs.mark_down(a, "connection refused")
    assert a.failures == 1 and len(a.lru) == 0
    assert all(rs.pick(key("p")).replica is b for _ in range(3))
    assert rs.pick(key("p"), exclude=[b]) is None
    rs.mark_up(a)
    assert rs.pick(key("p"), exclude=[b]).replica is a


def test_bad_router_configuration_is_a_value_error():
    with pytest.raises(ValueError, match="at least one backend"):
        ReplicaSet([])
    with pytest.raises(ValueError, match="policy"):
        ReplicaSet(["http://a"], "random")
    with pytest.raises(ValueError, match="twice"):
        ReplicaSet(["http://a/", "http://a"])


def test_replicas_get_the_engine_flags_and_not_the_launchers():
    from kvserve.entrypoints.serve import add_serve_args
    from kvserve.server.cli import add_cli_args

    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    args = serve.parse_args(["--model", "/m", "--block-size", "8", "--no-enable-prefix-caching",
                             "--data-parallel-size", "2", "--port", "9000", "--router-policy", "round-robin",
                             "--max-num-seqs", "4"])
    p = argparse.ArgumentParser()       # one server's flags: what a replica takes
    add_cli_args(p)
    argv = replica_argv(args, p)
    assert argv[:2] == ["--model", "/m"]
    assert {"--block-size", "8", "--no-enable-prefix-caching", "--max-num-seqs", "4"} <= set(argv)
    assert not {"--port", "--data-parallel-size", "--router-policy", "9000"} & set(argv)
    assert p.parse_args(argv + ["--port", "1"]).block_size == 8
