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

Layer-wise streaming (`--kv-transfer stream` on both instances; kv/stream_*.py): when the chosen
decode instance names a KV stream address in its /health, the proxy first reserves room for the
prompt's KV there (a TCP exchange; a full decode instance refuses, and the proxy tries another,
then answers 503 with Retry-After: backpressure before any prefill work), then sends the two
requests at once: the prefill instance gets `kv_transfer_params: {"transfer_id", "stream_to"}` and
sends each layer's KV as it is written, the decode instance gets `{"transfer_id"}` and waits
(WAITING_FOR_REMOTE_KV) until the last layer lands, so only the last layer's transfer is left on
TTFT. A prefill that fails everywhere cancels the transfer: the decode instance computes the
prompt at once. A transfer that fails or stalls is a fallback the decode instance counts
(`kvserve:kv_stream_events`) and recomputes: the answer is the same.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvserve.fleet.breaker import DEFAULT_COOLDOWN_S, DEFAULT_FAILURE_THRESHOLD, backpressure_reason
from kvserve.fleet.replicas import ReplicaSet
from kvserve.fleet.router import Router, error_response, forward_headers
from kvserve.kv.stream_wire import cancel, reserve

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
        self.streamed = Counter("kvserve:proxy_kv_streams", "Requests whose prompt's KV streamed layer by "
                                "layer from a prefill to a decode instance.", registry=r)
        self.stream_refused = Counter("kvserve:proxy_kv_stream_refused", "KV stream reservations a decode "
                                      "instance refused (its stream buffer full).", ["instance"], registry=r)
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
        self._prefills: set[asyncio.Task] = set()      # streamed requests' prefills, running beside their decode

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
        if isinstance(parsed, dict) and not parsed.get("use_beam_search") and "kv_transfer_params" not in parsed:
            answer = await self._streamed(request, path, parsed, hashes, len(body))
            if answer is not None:
                return answer
        if isinstance(parsed, dict):
            await self._prefill(request, path, parsed, hashes)
        return await self.decode.forward(request, path, body, hashes)

    async def _streamed(self, request: Request, path: str, parsed: dict, hashes: list[bytes],
                        body_bytes: int) -> Response | None:
        """Layer-wise streaming to a decode instance that offers it (the module docstring), or
        None where none does (the shared store's path)."""
        streams = [r for r in self.decode.replicas.available() if r.kv_stream]
        if not streams:
            return None
        # an upper bound on the prompt's tokens: the routing key's blocks plus one, else the body's bytes
        bs = getattr(self.decode.hasher, "block_size", 0)
        tokens = (len(hashes) + 1) * bs + 1 if hashes and bs else body_bytes
        tried, refused = [r for r in self.decode.replicas.replicas if not r.kv_stream], None
        while (pick := self.decode.replicas.pick(hashes, exclude=tried)) is not None:
            r = pick.replica
            tried.append(r)
            tid = uuid.uuid4().hex
            try:
                ok, why = await asyncio.to_thread(reserve, r.kv_stream, tid, tokens)
            except OSError as e:
                self.decode._fail(r, f"KV stream reservation: {type(e).__name__}: {e}")
                continue
            if not ok:
                refused = why
                self.decode._busy(r, "kv_stream_full")
                self.metrics.stream_refused.labels(r.url).inc()
                continue
            self.metrics.streamed.inc()
            task = asyncio.create_task(self._prefill(request, path, parsed, hashes,
                                                     {"transfer_id": tid, "stream_to": r.kv_stream}))
            self._prefills.add(task)
            task.add_done_callback(lambda t, r=r, tid=tid: self._prefill_ended(t, r, tid))
            decode_body = json.dumps({**parsed, "kv_transfer_params": {"transfer_id": tid}}).encode()
            return await self.decode.forward(request, path, decode_body, hashes, pin=r)
        if refused is not None:
            return error_response(503, f"no decode instance has room for this prompt's KV ({refused}); "
                                  "retry later", "kv_stream_full", headers={"Retry-After": "1"})
        return None

    def _prefill_ended(self, task: asyncio.Task, r, tid: str) -> None:
        """A streamed request's prefill that reached no prefill instance cancels its transfer."""
        self._prefills.discard(task)
        if task.cancelled() or task.exception() is not None or not task.result():
            asyncio.get_running_loop().run_in_executor(None, self._cancel, r.kv_stream, tid)

    @staticmethod
    def _cancel(addr: str, tid: str) -> None:
        try:
            cancel(addr, tid, "no prefill instance took the request")
        except OSError as e:
            logger.warning("could not cancel KV stream %s at %s: %s", tid, addr, e)

    async def _prefill(self, request: Request, path: str, parsed: dict, hashes: list[bytes],
                       kv_transfer_params: dict | None = None) -> bool:
        """Prefill on some prefill instance (True); on failure of all, leave the prompt to decode."""
        body = prefill_body(parsed)
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        content = json.dumps(body).encode()
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
            # 2xx: the KV is in the store (or streamed). 4xx: the request is bad; decode will say so itself.
            self.metrics.prefills.labels(r.url).inc()
            self.metrics.prefill_time.observe(time.perf_counter() - t0)
            return resp.status_code < 400
        self.metrics.fallbacks.inc()
        logger.warning("no prefill instance could take a request: the decode instance computes its prompt")
        return False


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
