"""`kvserve proxy`: disaggregated prefill and decode (seed 003, "Separating prefill from decode";
seed 000, "Prefill-decode disaggregation") behind one OpenAI-compatible front door.

    kvserve serve --role prefill --kv-tiers redis://H:P --port 8001     (one or more)
    kvserve serve --role decode  --kv-tiers redis://H:P --port 8002     (one or more)
    kvserve proxy --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000

Each request goes first to a prefill instance, as itself with `max_tokens: 1` and no streaming:
the prefill instance computes the prompt's KV (and one token, discarded) and, in its role,
writes every full block of it to the shared KV store by the end of that step
(kv/connector.py: keyed by the engine's chained block hash, checksummed). Then the original
request goes to a decode instance, whose admission finds the prompt's blocks in the store and
loads them instead of computing them (a tier hit: `usage.prompt_tokens_details.cached_tokens`),
computes the prompt's last partial block (fewer than `block_size` tokens) and generates; its
answer, streamed or not, is relayed as it comes. The transport is the shared store -- Redis
across machines, or a disk directory on one -- as LMCache does it for vLLM; it was chosen over
torch.distributed point-to-point because it needs no pairing of processes (any prefill instance
feeds any decode instance, and either side can restart), and on this machine its measured
bandwidth is far above seed 003's break-even (benchmarks/bench_pd.py).

Instances of each role are chosen by the prefix-aware, load-balanced policy of `kvserve router`
(dist/replicas.py), each behind its circuit breaker (dist/breaker.py). Failures: a prefill instance
that fails is counted against its breaker and the next one tried; one that is busy (429, or 503
with `Retry-After`, e.g. its `--max-waiting` queue full) is simply passed over, never taken out;
with none left the decode instance simply computes the whole prompt (a fallback, counted).
A transfer that is lost, cut short or corrupt is a tier miss on the decode side, which then
recomputes those blocks: the answer is the same. A decode instance that fails before its first
byte reached the client is counted as a failure and the request sent to another, and decode
instances that are all busy give the client their 503 with `Retry-After` (dist/router.py). The
prefill instance frees its blocks when its one-token request finishes: the store holds the KV,
so no hand-shake is needed before freeing.
"""
from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvserve.fleet.breaker import DEFAULT_COOLDOWN_S, DEFAULT_FAILURE_THRESHOLD, backpressure_reason
from kvserve.fleet.replicas import ReplicaSet
from kvserve.fleet.router import Router, error_response, forward_headers

logger = logging.getLogger("kvserve.proxy")

# Fields of a request that only matter once generation runs: the prefill request drops them.
_DECODE_ONLY = ("stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs", "echo",
                "min_tokens", "use_beam_search", "prompt_logprobs")


def prefill_body(body: dict) -> dict:
    """The request the prefill instance gets: the same prompt and sampling, one token."""
    out = {k: v for k, v in body.items() if k not in _DECODE_ONLY}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class PDMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.prefills = Counter("kvserve:proxy_prefill_requests", "Requests prefilled on a prefill "
                                "instance.", ["instance"], registry=r)
        self.prefill_backpressure = Counter("kvserve:proxy_prefill_backpressure", "Backpressure "
                                            "answers (429, 503 with Retry-After) from a prefill "
                                            "instance.", ["instance", "reason"], registry=r)
        self.fallbacks = Counter("kvserve:proxy_prefill_fallbacks", "Requests whose prompt the decode "
                                 "instance computed because no prefill instance could.", registry=r)
        self.prefill_time = Histogram("kvserve:proxy_prefill_time_seconds", "Prefill request time, "
                                      "the KV written to the shared store included.", registry=r,
                                      buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PDProxy:
    def __init__(self, prefill: Router, decode: Router, prefill_timeout: float = 600.0):
        self.prefill, self.decode = prefill, decode
        self.prefill_timeout = prefill_timeout
        self.metrics = PDMetrics()

    async def start(self) -> None:
        await self.prefill.start()
        await self.decode.start()

    async def stop(self) -> None:
        await self.prefill.stop()
        await self.decode.stop()

    async def handle(self, request: Request, path: str) -> Response:
        body = await self.decode.read_body(request)
        if body is None:
            return error_response(413, f"the request body is over {self.decode.max_body_bytes} bytes",
                                  "request_too_large", "invalid_request_error")
        hashes = await self.decode.routing_key(path, body)
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            await self._prefill(request, path, parsed, hashes)
        return await self.decode.forward(request, path, body, hashes)

    async def _prefill(self, request: Request, path: str, parsed: dict, hashes: list[bytes]) -> None:
        """Prefill on some prefill instance; on failure of all, leave the prompt to decode."""
        content = json.dumps(prefill_body(parsed)).encode()
        headers = forward_headers(request)
        tried = []
        while (pick := self.prefill.replicas.pick(hashes, exclude=tried)) is not None:
            r = pick.replica
            tried.append(r)
            probe = self.prefill.replicas.begin(pick, hashes)
            t0 = time.perf_counter()
            try:
                resp = await self.prefill.client.post(r.url + path, content=content, headers=headers,
                                                      timeout=self.prefill_timeout)
                reason = backpressure_reason(resp.status_code, resp.headers, resp.content)
                if reason is not None:
                    self.prefill._busy(r, reason)
                    self.metrics.prefill_backpressure.labels(r.url, reason).inc()
                    continue
                if resp.status_code >= 500:
                    self.prefill._fail(r, f"{path} answered {resp.status_code}")
                    continue
                self.prefill.replicas.succeeded(r)
            except httpx.HTTPError as e:
                self.prefill._fail(r, f"{type(e).__name__}: {e}")
                continue
            finally:
                self.prefill.replicas.end(r, probe)
            # 2xx: the KV is in the store. 4xx: the request is bad; decode will say so itself.
            self.metrics.prefills.labels(r.url).inc()
            self.metrics.prefill_time.observe(time.perf_counter() - t0)
            return
        self.metrics.fallbacks.inc()
        logger.warning("no prefill instance could take a request: the decode instance computes its prompt")


def build_proxy_app(proxy: PDProxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    app = FastAPI(title="kvserve proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await proxy.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        return await proxy.decode.proxy_get("/v1/models", request)

    @app.get("/health")
    async def health():
        roles = {name: [r.state() for r in router.replicas.replicas]
                 for name, router in (("prefill", proxy.prefill), ("decode", proxy.decode))}
        ok = any(s["healthy"] for s in roles["decode"])     # prefill down: decode computes prompts
        return JSONResponse({"status": "ok" if ok else "error", **roles}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        # the decode routers' series (the prefill side is counted per instance in the proxy's own)
        text = proxy.metrics.render() + proxy.decode.metrics.render()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def make_proxy(prefill_urls: list[str], decode_urls: list[str], hasher, policy: str = "cache-aware",
               health_interval: float = 2.0, cb_failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
               cb_timeout_s: float = DEFAULT_COOLDOWN_S) -> PDProxy:
    def router(urls):
        replicas = ReplicaSet(urls, policy, failure_threshold=cb_failure_threshold, cooldown_s=cb_timeout_s)
        return Router(replicas, hasher, health_interval)

    return PDProxy(router(prefill_urls), router(decode_urls))
