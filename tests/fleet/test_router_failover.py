"""The router's failure handling against scripted backends (httpx.MockTransport): a 5xx or a
refused connection before anything was relayed is retried elsewhere, and --cb-failure-threshold
of them in a row take the replica out,
a stream that breaks after its first chunk ends with an SSE error event, /health checks bring
count too, and nothing healthy is a 503 in OpenAI's error shape. (Backpressure and the breaker's
half-open probe: test_router_breaker.py.)"""
from __future__ import annotations

import asyncio
import json

import httpx

from kvserve.fleet.replicas import ReplicaSet
from kvserve.fleet.router import Router
from kvserve.fleet.router_app import build_router_app

BODY = {"model": "m", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]}


def streamed(status: int, obj: dict) -> httpx.Response:
    """A response whose body arrives as a stream, as from the network (not pre-read bytes)."""
    async def body():
        yield json.dumps(obj).encode()
    return httpx.Response(status, headers={"content-type": "application/json"}, content=body())


BUSY = {  # what a busy kvserve serve answers: --max-waiting full, a tenant's rate limit, shutdown
    "busy": (503, {"Retry-After": "1"}, "server_overloaded"),
    "429": (429, {"Retry-After": "2"}, "rate_limit_exceeded"),
    "shutting": (503, {}, "shutting_down"),
}


class Backends:
    """Scripted replicas by host: 'ok', '500', 'refuse', 'break' (SSE that dies after one chunk),
    and the busy answers of BUSY."""

    def __init__(self, **behaviour):
        self.behaviour = behaviour
        self.calls: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        mode = self.behaviour[host]
        if path == "/health":
            if mode == "refuse":
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(200 if mode != "500" else 500, json={"status": "ok"})
        self.calls.append(host)
        if mode == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if mode == "500":
            return streamed(500, {"error": {"message": "boom"}})
        if mode in BUSY:
            status, headers, code = BUSY[mode]
            return httpx.Response(status, headers=headers, json={"error": {
                "message": f"{host} is busy", "type": "server_error", "param": None, "code": code}})
        if mode == "break":
            async def chunks():
                yield b'data: {"choices":[{"text":"a"}]}\n\n'
                raise httpx.ReadError("connection reset", request=request)
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())
        return streamed(200, {"choices": [{"text": f"from {host}"}]})


def run(backends: Backends, hosts: list[str], fn, policy="round-robin", replica_kw=None, hasher=None, **kw):
    async def main():
        replicas = ReplicaSet([f"http://{h}" for h in hosts], policy, **(replica_kw or {}))
        router = Router(replicas, hasher, health_interval=3600,
                        transport=httpx.MockTransport(backends), **kw)
        app = build_router_app(router)
        await router.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as c:
                return await fn(router, c)
        finally:
            await router.stop()

    return asyncio.run(main())


def test_a_5xx_or_refused_replica_is_retried_elsewhere_and_taken_out_at_the_threshold():
    for bad in ("500", "refuse"):
        b = Backends(bad="ok", good="ok")              # healthy at the start-up check ...

        async def go(router, c):
            b.behaviour["bad"] = bad                    # ... failing when the requests come
            answers = [await c.post("/v1/completions", json=BODY) for _ in range(8)]
            return answers, router

        answers, router = run(b, ["bad", "good"], go)
        assert [a.status_code for a in answers] == [200] * 8
        assert all(a.json()["choices"][0]["text"] == "from good" for a in answers)
        assert b.calls.count("bad") == 3                # tried --cb-failure-threshold times, then out
        bad_rep = router.replicas.replicas[0]
        assert not bad_rep.healthy and bad_rep.failures == 1 and bad_rep.breaker.state == "open"
        text = router.metrics.render().decode()
        assert 'kvserve:router_retries_total{replica="http://bad"} 3.0' in text
        assert 'kvserve:router_replica_breaker_state{replica="http://bad"} 2.0' in text


def test_failed_health_checks_count_as_failures():
    b = Backends(a="refuse", b="ok")

    async def go(router, c):
        a = router.replicas.replicas[0]
        states = [a.healthy]                            # the start-up check: one failure of two
        await router.check_health()
        states.append(a.healthy)
        health = await c.get("/health")
        return states, health

    states, health = run(b, ["a", "b"], go, replica_kw={"failure_threshold": 2})
    assert states == [True, False] and health.status_code == 200      # b is still in


def test_every_replica_failing_is_the_last_5xx_or_a_503():
    b = Backends(a="500", b="500")

    async def go(router, c):
        for r in router.replicas.replicas:
            router.replicas.mark_up(r)
        first = await c.post("/v1/completions", json=BODY)      # both tried, both 500
        second = await c.post("/v1/completions", json=BODY)     # none healthy left
        return first, second

    first, second = run(b, ["a", "b"], go, replica_kw={"failure_threshold": 1})
    assert first.status_code == 500 and first.json()["error"]["message"] == "boom"
    assert second.status_code == 503 and second.json()["error"]["code"] == "no_healthy_replica"
    assert second.headers["retry-after"] == "1"


def test_a_stream_broken_after_its_first_chunk_ends_with_an_error_event():
    b = Backends(a="break")

    async def go(router, c):
        r = await c.post("/v1/completions", json={**BODY, "stream": True})
        return r, router.replicas.replicas[0]

    r, rep = run(b, ["a"], go, replica_kw={"failure_threshold": 1})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert json.loads(events[1])["error"]["code"] == "replica_failed" and events[-1] == "[DONE]"
    assert not rep.healthy and rep.in_flight == 0


def test_an_oversized_body_is_413_before_any_routing():
    b = Backends(a="ok")

    async def go(router, c):
        return await c.post("/v1/completions", content=b"x" * 2048,
                            headers={"content-type": "application/json"})

    r = run(b, ["a"], go, max_body_bytes=1024)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large" and b.calls == []
