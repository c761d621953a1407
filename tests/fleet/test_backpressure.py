"""Backpressure through the fleet's front doors (dist/breaker.py): a busy replica -- its
`--max-waiting` queue full, a tenant over its rate limit, a server shutting down -- is passed
over and never taken out. Live: `kvserve router` over two stories260K replicas with
`--max-waiting 2 --max-num-seqs 2` under a 16-request burst keeps both replicas in, and every
answer is a 200 or a 503 with Retry-After, never no_healthy_replica. Scripted: `kvserve proxy`
passes busy prefill and decode instances over the same way."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from kvserve.fleet.pd_proxy import PDProxy, build_proxy_app
from kvserve.fleet.prefix_key import RequestHasher
from kvserve.fleet.replicas import ReplicaSet
from kvserve.fleet.router import Router

from .live import MODEL, LiveRouter, scrape, start_replicas
from .test_router_failover import BODY, Backends


def test_a_burst_over_max_waiting_takes_no_replica_out():
    reps = start_replicas(2, "--max-waiting", "2", "--max-num-seqs", "2")
    router = None
    try:
        router = LiveRouter(reps.urls, "cache-aware")

        def complete(i: int, max_tokens: int):
            body = {"model": MODEL, "prompt": f"Story {i}: once upon a time there was a little dog who "
                    "liked to run in the park", "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(router.url + "/v1/completions", json=body, timeout=60, trust_env=False)
            code = r.json()["error"]["code"] if r.status_code != 200 else None
            return r.status_code, r.headers.get("retry-after"), code

        with ThreadPoolExecutor(20) as pool:
            # long enough that the burst overlaps however fast a step is (the fused decode step
            # made 200-token answers of stories260K short enough to drain between arrivals)
            burst = [pool.submit(complete, i, 400) for i in range(16)]
            time.sleep(0.3)                 # the replicas are full: short requests meanwhile
            short = []
            for k in range(4):
                short.append(complete(100 + k, 4))
                time.sleep(0.1)
            answers = [f.result(timeout=90) for f in burst] + short
        state = router.replicas()["replicas"]
        metrics = scrape(router.url)
    finally:
        if router is not None:
            assert router.stop() == 0, router.log()
        reps.stop()
    for status, retry_after, code in answers:
        assert status == 200 or (status == 503 and retry_after and code == "server_overloaded"), answers
    assert sum(a[0] == 200 for a in answers) >= 8          # both replicas kept serving
    assert metrics["kvserve:router_backpressure_total"] >= 1   # the burst did meet backpressure
    for r in state:                 # no replica taken out, none counted as failing, LRUs kept
        assert r["healthy"] and r["breaker"] == "closed" and r["failures"] == 0, state
        assert r["consecutive_failures"] == 0 and r["cached_blocks"] > 0, state


def test_the_pd_proxy_passes_busy_instances_over_and_keeps_them():
    b = Backends(p1="busy", p2="ok", d1="ok", d2="ok")

    async def main():
        def router(*hosts):
            return Router(ReplicaSet([f"http://{h}" for h in hosts]), RequestHasher(None, 16),
                          health_interval=3600, transport=httpx.MockTransport(b))

        proxy = PDProxy(router("p1", "p2"), router("d1", "d2"))
        await proxy.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(build_proxy_app(proxy)),
                                         base_url="http://proxy") as c:
                ok = [await c.post("/v1/completions", json=BODY) for _ in range(4)]
                b.behaviour["p2"] = "429"           # every prefill instance busy: decode prefills
                fallback = await c.post("/v1/completions", json=BODY)
                b.behaviour.update(d1="busy", d2="shutting")    # every decode instance busy
                busy = await c.post("/v1/completions", json=BODY)
                metrics = (await c.get("/metrics")).text
        finally:
            await proxy.stop()
        return proxy, ok, fallback, busy, metrics

    proxy, ok, fallback, busy, metrics = asyncio.run(main())
    assert [r.status_code for r in ok] == [200] * 4 and fallback.status_code == 200
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] in ("server_overloaded", "shutting_down")
    for rep in proxy.prefill.replicas.replicas + proxy.decode.replicas.replicas:
        assert rep.healthy and rep.failures == 0 and rep.breaker.consecutive_failures == 0
        assert len(rep.lru) == 1
    assert 'kvserve:proxy_prefill_requests_total{instance="http://p2"} 4.0' in metrics
    assert 'kvserve:proxy_prefill_fallbacks_total 2.0' in metrics      # the last two requests
    assert ('kvserve:proxy_prefill_backpressure_total{instance="http://p2",reason="rate_limited"} 2.0'
            in metrics)
    assert 'kvserve:router_backpressure_total{reason="overloaded",replica="http://d1"} 1.0' in metrics
