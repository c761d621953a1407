"""The router's routes beyond completions and chat (fleet/router_app.py), against scripted
replicas (httpx.MockTransport): the tokenizer, embeddings, version and model-card routes are
relayed; a Responses API continuation (`previous_response_id`) and GET/DELETE of a stored
response reach the replica that made it, whatever the policy, and elsewhere once it is down."""
from __future__ import annotations

import json

import httpx

from kvserve.fleet.response_holders import ResponseHolders
from kvserve.server.openai.responses.store import RESPONSE_ID_HEADER

from .test_router_failover import run


def answer(status: int, obj: dict, headers: dict | None = None) -> httpx.Response:
    """A JSON answer whose body arrives as a stream, as from the network."""
    async def body():
        yield json.dumps(obj).encode()
    return httpx.Response(status, headers={"content-type": "application/json", **(headers or {})}, content=body())


class Replicas:
    """Scripted kvserve replicas: each names its responses `resp_<host>_<n>` and stores them."""

    def __init__(self, down=()):
        self.calls: list[tuple[str, str, str]] = []         # (host, method, path)
        self.stored: dict[str, set[str]] = {}
        self.down = set(down)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        self.calls.append((host, request.method, path))
        if path == "/v1/responses":
            body = json.loads(request.content)
            prev = body.get("previous_response_id")
            if prev is not None and prev not in self.stored.get(host, ()):
                return answer(400, {"error": {"message": "unknown previous_response_id",
                                              "code": "previous_response_not_found"}})
            rid = f"resp_{host}_{len(self.calls)}"
            self.stored.setdefault(host, set()).add(rid)
            return answer(200, {"id": rid, "object": "response"}, {RESPONSE_ID_HEADER: rid})
        if path.startswith("/v1/responses/"):
            rid = path.rsplit("/", 1)[1]
            if rid in self.stored.get(host, ()):
                return httpx.Response(200, json={"id": rid})
            return httpx.Response(404, json={"error": {"message": "no such response", "code": "response_not_found"}})
        return answer(200, {"host": host, "path": path})


HOSTS = ["a", "b", "c"]


def test_stateless_routes_are_relayed():
    b = Replicas()

    async def go(router, c):
        out = {}
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]}),
                           ("/v1/embeddings", {"input": "hi"})):
            out[path] = await c.post(path, json=body)
        for path in ("/tokenizer_info", "/version", "/v1/models/stories"):
            out[path] = await c.get(path)
        return out

    out = run(b, HOSTS, go)
    assert all(r.status_code == 200 and r.json()["path"] == p for p, r in out.items()), out
    assert {h for h, m, p in b.calls if m == "POST"} == set(HOSTS)       # spread by load (round-robin)


def test_continuations_and_lookups_reach_the_replica_that_made_the_response():
    for policy in ("round-robin", "least-loaded", "cache-aware"):
        b = Replicas()

        async def go(router, c):
            first = (await c.post("/v1/responses", json={"input": "hi"})).json()["id"]
            turns = [first]
            for _ in range(5):          # each turn continues the last: always on the first's replica
                r = await c.post("/v1/responses", json={"input": "more", "previous_response_id": turns[-1]})
                assert r.status_code == 200, r.text
                turns.append(r.json()["id"])
            got = await c.get(f"/v1/responses/{turns[2]}")
            gone = await c.delete(f"/v1/responses/{turns[3]}")
            missing = await c.get("/v1/responses/resp_nowhere")
            return turns, got, gone, missing

        turns, got, gone, missing = run(b, HOSTS, go, policy=policy)
        host = turns[0].split("_")[1]
        assert all(t.split("_")[1] == host for t in turns), (policy, turns)
        assert got.status_code == 200 and got.json()["id"] == turns[2]
        assert gone.status_code == 200
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"
        assert [h for h, m, p in b.calls if p == "/v1/responses/resp_nowhere"] == HOSTS    # each asked once


def test_a_continuation_whose_replica_is_down_goes_elsewhere():
    b = Replicas()

    async def go(router, c):
        rid = (await c.post("/v1/responses", json={"input": "hi"})).json()["id"]
        b.down.add(rid.split("_")[1])
        return rid, await c.post("/v1/responses", json={"input": "more", "previous_response_id": rid})

    rid, r = run(b, HOSTS, go)
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"


def test_the_holders_are_bounded_and_least_recently_used_first_out():
    holders = ResponseHolders(max_held=3)
    for i in range(4):
        holders.learn({RESPONSE_ID_HEADER: f"r{i}"}, f"replica{i}")
    assert holders.holder("r0") is None and holders.holder("r1") == "replica1"
    holders.learn({RESPONSE_ID_HEADER: "r4"}, "replica4")       # r2 is now the least recently used
    assert holders.holder("r2") is None and holders.holder("r1") == "replica1"
    assert holders.holder_of_previous(b'{"previous_response_id": "r3"}') == "replica3"
    assert holders.holder_of_previous(b'not json previous_response_id') is None
    assert holders.holder_of_previous(b'{"input": "no continuation"}') is None
