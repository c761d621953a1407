"""Tenants and the answer caches on a live server (kvserve/server/tenants.py, answers.py).

One server with a keys file and `--answer-cache semantic` (exact first, then semantic): keys map to tenants (401 otherwise), a
tenant's rate limit is 429 with Retry-After, the tenant scopes the prefix cache (two tenants
never hit each other's blocks, a tenant hits its own) and the answer cache (tenant B never gets
tenant A's answer), deterministic requests hit and sampled ones never do, any sampling change
misses, streamed hits equal non-streamed answers, a paraphrase hits the semantic layer and a
near-duplicate does not, and /metrics counts per tenant.
"""
from __future__ import annotations

import json

import httpx
import pytest

from tests.server.live import LiveServer

KEYS = {"keys": {"key-a": {"tenant": "alice", "weight": 2}, "key-a2": {"tenant": "alice"},
                 "key-b": {"tenant": "bob"},
                 "key-slow": {"tenant": "slow", "rate_limit": 6, "burst": 2}}}
LONG = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park "
        "with her friends and her dog. One day she saw a big red ball")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    srv = LiveServer("--api-keys", str(path), "--answer-cache", "semantic", "--max-num-seqs", "8",
                     "--metrics-tenant-labels")         # test_per_tenant_metrics reads the names
    yield srv
    srv.stop()


def post(server, key, body, path="/v1/completions"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60, trust_env=False)


def stream_text(server, key, body, path="/v1/completions"):
    text, usage = "", None
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True,
                      "stream_options": {"include_usage": True}},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60, trust_env=False) as r:
        assert r.status_code == 200
        cache = r.headers.get("x-kvserve-cache")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            usage = obj.get("usage") or usage
            for ch in obj["choices"]:
                text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
    return text, cache, usage


def test_keys_map_to_tenants(server):
    assert post(server, None, {"prompt": "Hi", "max_tokens": 2}).status_code == 401
    assert post(server, "nope", {"prompt": "Hi", "max_tokens": 2}).status_code == 401
    assert post(server, "key-b", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
    r = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer key-a"}, trust_env=False)
    assert r.status_code == 200


def test_rate_limit_is_429_with_retry_after(server):
    codes = [post(server, "key-slow", {"prompt": "Hi", "max_tokens": 1, "temperature": 1.0})
             for _ in range(3)]
    assert [r.status_code for r in codes[:2]] == [200, 200]
    assert codes[2].status_code == 429
    assert int(codes[2].headers["retry-after"]) >= 1
    assert codes[2].json()["error"]["code"] == "rate_limit_exceeded"
    assert post(server, "key-b", {"prompt": "Hi", "max_tokens": 1}).status_code == 200   # others go on


def cached_tokens(r):
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenant_scopes_the_prefix_cache(server):
    body = {"prompt": LONG + " in the tree.", "max_tokens": 2, "temperature": 1.0}   # sampled: no answer cache
    first = post(server, "key-a", body)
    assert first.status_code == 200 and first.json()["usage"]["prompt_tokens"] > 32
    assert cached_tokens(post(server, "key-b", body)) == 0          # bob: nothing of alice's
    assert cached_tokens(post(server, "key-a2", body)) > 0          # alice's other key: her blocks
    salted = {**body, "cache_salt": "shared"}           # an explicit salt stays within its tenant
    post(server, "key-a", salted)
    assert cached_tokens(post(server, "key-b", salted)) == 0
    assert cached_tokens(post(server, "key-a2", salted)) > 0


def test_exact_cache_hits_deterministic_requests(server):
    body = {"prompt": "The cat sat on the", "max_tokens": 8, "temperature": 0}
    miss = post(server, "key-a", body)
    assert miss.headers["x-kvserve-cache"] == "miss"
    hit = post(server, "key-a", body)
    assert hit.headers["x-kvserve-cache"] == "hit-exact"
    assert hit.json()["choices"][0]["text"] == miss.json()["choices"][0]["text"]
    assert hit.json()["usage"]["completion_tokens"] == 0
    # Tenant isolation: bob computes his own answer.
    assert post(server, "key-b", body).headers["x-kvserve-cache"] == "miss"
    # Any change to a field that changes the output misses.
    for change in ({"max_tokens": 7}, {"top_p": 0.5}, {"stop": ["z"]}, {"top_k": 3},
                   {"repetition_penalty": 1.2}, {"min_tokens": 2}, {"prompt": "Hello world", "semantic_cache": False}):
        assert post(server, "key-a", {**body, **change}).headers["x-kvserve-cache"] == "miss", change
    # A fixed seed makes a sampled request deterministic: cached; an unseeded one never is.
    seeded = {**body, "temperature": 0.9, "seed": 7}
    assert post(server, "key-a", seeded).headers["x-kvserve-cache"] == "miss"
    assert post(server, "key-a", seeded).headers["x-kvserve-cache"] == "hit-exact"
    assert post(server, "key-a", {**seeded, "seed": 8}).headers["x-kvserve-cache"] == "miss"
    sampled = {**body, "temperature": 0.9}
    assert [post(server, "key-a", sampled).headers["x-kvserve-cache"] for _ in range(2)] == ["bypass"] * 2
    # Opting out: no-cache looks nothing up.
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60, trust_env=False,
                   headers={"Authorization": "Bearer key-a", "Cache-Control": "no-cache"})
    assert r.headers["x-kvserve-cache"] == "miss"


def test_streamed_hits_equal_non_streamed(server):
    body = {"prompt": "Lily and Ben went to the", "max_tokens": 12, "temperature": 0}
    text, cache, _ = stream_text(server, "key-a", body)              # a streamed miss is stored
    assert cache == "miss"
    hit = post(server, "key-a", body)
    assert hit.headers["x-kvserve-cache"] == "hit-exact"
    assert hit.json()["choices"][0]["text"] == text
    text2, cache2, usage = stream_text(server, "key-a", body)
    assert (text2, cache2) == (text, "hit-exact")
    assert usage["completion_tokens"] == 0


def test_chat_exact_cache(server):
    body = {"messages": [{"role": "user", "content": "Tell me about a dog."}], "max_tokens": 10,
            "temperature": 0}
    miss = post(server, "key-a", body, "/v1/chat/completions")
    assert miss.status_code == 200 and miss.headers["x-kvserve-cache"] == "miss"
    hit = post(server, "key-a", body, "/v1/chat/completions")
    assert hit.headers["x-kvserve-cache"] == "hit-exact"
    want = miss.json()["choices"][0]["message"]["content"]
    assert hit.json()["choices"][0]["message"]["content"] == want
    text, cache, _ = stream_text(server, "key-a", body, "/v1/chat/completions")
    assert (text, cache) == (want, "hit-exact")
    assert post(server, "key-b", body, "/v1/chat/completions").headers["x-kvserve-cache"] == "miss"


def test_semantic_cache(server):
    body = {"prompt": "How do I delete a file?", "max_tokens": 6, "temperature": 0}
    first = post(server, "key-a", body)
    assert first.headers["x-kvserve-cache"] == "miss"
    para = post(server, "key-a", {**body, "prompt": "How can I remove a file?"})
    assert para.headers["x-kvserve-cache"] == "hit-semantic"
    assert 0.85 <= float(para.headers["x-kvserve-cache-similarity"]) < 1.0
    assert para.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert para.json()["usage"]["completion_tokens"] == 0
    assert post(server, "key-a", {**body, "prompt": "How do I delete a folder?"}).headers["x-kvserve-cache"] == "miss"
    assert post(server, "key-b", {**body, "prompt": "How can I remove a file?"}).headers["x-kvserve-cache"] == "miss"
    opt_out = {**body, "prompt": "How could I remove a file?", "semantic_cache": False}
    assert post(server, "key-a", opt_out).headers["x-kvserve-cache"] == "miss"
    assert post(server, "key-a", {**body, "max_tokens": 5, "prompt": "How can I remove a file?"}
                ).headers["x-kvserve-cache"] == "miss"          # other sampling fields: other scope
    m = server.metrics()
    assert m["kvserve:semantic_cache_similarity_count"] >= 1


def test_per_tenant_metrics(server):
    post(server, "key-b", {"prompt": "Hi there", "max_tokens": 3, "temperature": 1.0})
    m = server.wait_for("bob's tokens", lambda m: any(
        k.startswith("kvserve:tenant_generation_tokens_total{") and 'tenant="bob"' in k and v > 0
        for k, v in m.items()))
    assert any('tenant="alice"' in k for k in m if k.startswith("kvserve:tenant_requests_total"))
    assert any('tenant="slow"' in k for k in m if k.startswith("kvserve:tenant_rate_limited_total"))
    assert any('cache="exact"' in k and 'result="hit"' in k for k in m
               if k.startswith("kvserve:answer_cache_lookups_total"))
