"""`kvserve router`: an OpenAI-compatible front door over data-parallel `kvserve serve` replicas
that sends each request to the replica most likely to hold its prefix (seed 003, "Radix trees":
a prefix-aware router; Mooncake's cache-centric scheduling), balanced against load.

Its routes are fleet/router_app.py's: completions and chat routed by prefix, the other POST
routes by load (a Responses API continuation to the replica that holds its response), the GET
routes from a healthy replica.

A request's routing key is its leading block hashes, computed with the engine's own hash
function and its `cache_salt` (dist/prefix_key.py). The key is matched against the block hashes
the router has sent each replica; after routing, the chosen replica's LRU records the key.

Failures and backpressure (dist/breaker.py): a replica that refuses the connection, breaks it,
times out or answers 5xx before the router has relayed anything has failed, and the request is
sent to another one; `--cb-failure-threshold` consecutive failures open the replica's circuit
breaker (it is taken out and its LRU dropped) and after `--cb-timeout-duration-secs` one probe
request is let through, whose success brings it back. A replica that answers 429, or 503 with
`Retry-After` or the code `server_overloaded`/`shutting_down`, is busy, not failing: the request
goes to another replica, and when none takes it the last busy answer (with its `Retry-After`)
is the client's; the busy replica stays in, its breaker and LRU untouched. The router relays nothing
until the replica's first body bytes are in hand, so a request that dies on its replica before
its first SSE chunk -- or, unstreamed, before its answer -- is retried and never lost. A stream
that breaks after its first chunk cannot be replayed: it ends with an SSE error event and
`[DONE]` (and counts as a failure). A health check every `health_interval` seconds counts a
failed /health as a failure too. Each response names its replica and routing match in
`x-kvserve-replica` and `x-kvserve-prefix-blocks` (hit/query).

HTTP goes through httpx (one pooled `AsyncClient`) and FastAPI/uvicorn: no RPC layer of our own.
"""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import suppress

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.fleet.breaker import backpressure_reason
from kvserve.fleet.prefix_key import RequestHasher
from kvserve.fleet.replicas import Pick, Replica, ReplicaSet
from kvserve.fleet.response_holders import ResponseHolders
from kvserve.fleet.router_metrics import RouterMetrics

logger = logging.getLogger("kvserve.router")

DEFAULT_MAX_BODY_BYTES = 32 << 20
HEALTH_TIMEOUT_S = 5.0
INLINE_HASH_BYTES = 2048        # bodies up to this size are hashed on the event loop
_FORWARD_REQUEST_HEADERS = ("authorization", "content-type", "accept", "user-agent")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server",
               "upgrade", "proxy-authenticate", "proxy-authorization", "te", "trailer"}


class ClientGone(Exception):
    """The client disconnected while the router waited for a replica's first bytes."""


def error_response(status: int, message: str, code: str, type_: str = "server_error",
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}},
                        status, headers=headers)


class Router:
    def __init__(self, replicas: ReplicaSet, hasher: RequestHasher | None,
                 health_interval: float = 2.0, connect_timeout: float = 5.0,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.transport = transport          # tests: an httpx.MockTransport in place of the network
        self.replicas = replicas
        self.hasher = hasher
        self.health_interval = health_interval
        self.connect_timeout = connect_timeout
        self.max_body_bytes = max_body_bytes
        self.metrics = RouterMetrics(replicas)
        self.responses = ResponseHolders()     # Responses API id -> the replica that stores it
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        # Generations run as long as they run: no read timeout; connecting must be quick.
        timeout = httpx.Timeout(None, connect=self.connect_timeout)
        self.client = httpx.AsyncClient(timeout=timeout, trust_env=False, transport=self.transport,
                                        limits=httpx.Limits(max_connections=None,
                                                            max_keepalive_connections=256))
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with suppress(asyncio.CancelledError):
                await self._health_task
        if self.client is not None:
            await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_health()
            except Exception:   # noqa: BLE001  (a broken check must not end the loop)
                logger.exception("health check failed")

    async def check_health(self) -> None:
        """GET /health of every replica at once: anything but 200 counts as a failure (a
        replica comes back through its breaker's half-open probe, not through /health)."""
        timeout = HEALTH_TIMEOUT_S      # a busy replica answers late, not never

        async def one(r: Replica) -> None:
            try:
                resp = await self.client.get(r.url + "/health", timeout=timeout)
                if resp.status_code == 200:
                    try:
                        r.kv_stream = resp.json().get("kv_stream")    # PD decode side (fleet/pd_proxy.py)
                    except (ValueError, AttributeError):
                        r.kv_stream = None
                    return
                why = f"/health answered {resp.status_code}"
            except httpx.HTTPError as e:
                why = f"/health: {type(e).__name__}: {e}"
            if self.replicas.failed(r, why):
                logger.warning("replica %s taken out (%s)", r.url, why)

        await asyncio.gather(*(one(r) for r in self.replicas.replicas))

    def _fail(self, r: Replica, why: str) -> None:
        """A request failed on `r` before anything was relayed (it is retried elsewhere)."""
        if self.replicas.failed(r, why):
            logger.warning("replica %s taken out after %d consecutive failures (%s)", r.url,
                           r.breaker.consecutive_failures, why)
        self.metrics.retried(r.url)

    def _busy(self, r: Replica, reason: str) -> None:
        """`r` answered backpressure: counted, and nothing else changes."""
        self.replicas.backpressured(r)
        self.metrics.backpressure(r.url, reason)

    # ------------------------------------------------------------------ routing

    async def routing_key(self, path: str, body: bytes) -> list[bytes]:
        if self.hasher is None:
            return []
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return []           # the replica answers the 400
        if not isinstance(parsed, dict):
            return []
        try:
            if len(body) <= INLINE_HASH_BYTES:
                return self.hasher.request_hashes(path, parsed)
            return await anyio.to_thread.run_sync(self.hasher.request_hashes, path, parsed)
        except Exception:   # noqa: BLE001  (a key we cannot compute routes by load alone)
            logger.exception("no routing key for a request to %s", path)
            return []

    async def read_body(self, request: Request) -> bytes | None:
        """The request body, or None once it grows past max_body_bytes (nothing more is read)."""
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                return None
            parts.append(part)
        return b"".join(parts)

    async def proxy_post(self, request: Request, path: str, by_prefix: bool = True) -> Response:
        """Relay a POST: routed by its prefix (`by_prefix`), else by load alone; a Responses API
        request continuing a response goes first to the replica that holds it."""
        body = await self.read_body(request)
        if body is None:
            return error_response(413, f"the request body is over {self.max_body_bytes} bytes",
                                  "request_too_large", "invalid_request_error")
        hashes = await self.routing_key(path, body) if by_prefix else []
        pin = self.responses.holder_of_previous(body) if path == "/v1/responses" else None
        return await self.forward(request, path, body, hashes, pin)

    async def forward(self, request: Request, path: str, body: bytes, hashes: list[bytes],
                      pin: Replica | None = None) -> Response:
        """Send `body` to `pin` (while it is available), else the replica `hashes` pick, and
        relay its answer; retried elsewhere while nothing has been relayed (see the module
        docstring)."""
        headers = forward_headers(request)
        tried: list[Replica] = []
        last_busy = last_5xx = None         # the last answers that said "not now" / failed
        while True:
            pinned = pin is not None and not tried and pin in self.replicas.available()
            pick = Pick(pin, pin.lru.match(hashes)) if pinned else self.replicas.pick(hashes, exclude=tried)
            if pick is None:
                if last_busy is not None:
                    return last_busy        # none took it, some were busy: retry later
                if last_5xx is not None:
                    return last_5xx
                return error_response(503, "no healthy replica can take the request; retry later",
                                      "no_healthy_replica", headers={"Retry-After": "1"})
            r = pick.replica
            tried.append(r)
            probe = self.replicas.begin(pick, hashes)
            self.metrics.routed(r.url, len(hashes), pick.matched_blocks, len(tried) == 1)
            relaying = False
            try:
                upstream = await self.client.send(
                    self.client.build_request("POST", r.url + path, content=body, headers=headers),
                    stream=True)
                status = upstream.status_code
                if status >= 500 or status == 429:
                    content = await upstream.aread()
                    await upstream.aclose()
                    answer = Response(content, status, _response_headers(upstream))
                    reason = backpressure_reason(status, upstream.headers, content)
                    if reason is None:
                        last_5xx = answer
                        self._fail(r, f"{path} answered {status}")
                    else:
                        answer.headers.setdefault("retry-after", "1")
                        last_busy = answer
                        self._busy(r, reason)
                    continue
                chunks = upstream.aiter_raw()
                try:
                    first = await _first_chunk(chunks, request)
                except BaseException:
                    await upstream.aclose()
                    raise
                relaying = True
                self.replicas.succeeded(r)
                self.responses.learn(upstream.headers, r)
            except httpx.HTTPError as e:
                self._fail(r, f"{type(e).__name__}: {e}")
                continue
            except ClientGone:
                return Response(status_code=499)
            finally:
                if not relaying:
                    self.replicas.end(r, probe)
            out_headers = _response_headers(upstream)
            out_headers["x-kvserve-replica"] = r.url
            out_headers["x-kvserve-prefix-blocks"] = f"{pick.matched_blocks}/{len(hashes)}"
            # Cleanup runs once, from the relay's end or -- if the client left before the relay
            # even started -- from the response's background task.
            done = _Once(self._release, r, upstream)
            return StreamingResponse(self._relay(r, upstream, first, chunks, done),
                                     status_code=upstream.status_code, headers=out_headers,
                                     background=BackgroundTask(done))

    async def _release(self, r: Replica, upstream: httpx.Response) -> None:
        self.replicas.end(r)
        await upstream.aclose()

    async def _relay(self, r: Replica, upstream: httpx.Response, first: bytes, chunks, done):
        sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as e:
            # Bytes already reached the client: no replay. Say so in the stream's own terms.
            self.replicas.failed(r, f"stream broke: {type(e).__name__}: {e}")
            logger.warning("replica %s broke a stream (%s)", r.url, e)
            if sse:
                err = {"error": {"message": "the replica serving this stream failed; retry the "
                                 "request", "type": "server_error", "param": None,
                                 "code": "replica_failed"}}
                yield f"\n\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await done()

    async def proxy_get(self, path: str, request: Request, method: str = "GET",
                        first: Replica | None = None, past_404: bool = False) -> Response:
        """A bodiless request, answered by the first healthy replica (`first` tried first) that
        answers below 500 -- and, with `past_404`, not 404 (a stored response on another one)."""
        headers = forward_headers(request)
        healthy = self.replicas.healthy()
        order = ([first] if first in healthy else []) + [r for r in healthy if r is not first]
        not_found = None
        for r in order:
            try:
                resp = await self.client.request(method, r.url + path, headers=headers)
            except httpx.HTTPError as e:
                self._fail(r, f"{type(e).__name__}: {e}")
                continue
            if resp.status_code == 404 and past_404:
                not_found = resp
                continue
            if resp.status_code < 500:
                return Response(resp.content, resp.status_code, _response_headers(resp))
        if not_found is not None:
            return Response(not_found.content, 404, _response_headers(not_found))
        return error_response(503, "no healthy replica", "no_healthy_replica", headers={"Retry-After": "1"})


class _Once:
    """An async callable that runs `fn(*args)` on its first call only."""

    def __init__(self, fn, *args):
        self.fn, self.args, self.called = fn, args, False

    async def __call__(self) -> None:
        if not self.called:
            self.called = True
            await self.fn(*self.args)


async def _first_chunk(chunks, request: Request) -> bytes:
    """The replica's first body bytes, or ClientGone if the client leaves first."""
    nxt = asyncio.ensure_future(chunks.__anext__())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not nxt.done():
            nxt.cancel()
            with suppress(BaseException):
                await nxt
    if not nxt.done() or nxt.cancelled():
        raise ClientGone
    try:
        return nxt.result()
    except StopAsyncIteration:
        return b""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def forward_headers(request: Request) -> dict:
    return {k: v for k in _FORWARD_REQUEST_HEADERS if (v := request.headers.get(k)) is not None}


def _response_headers(resp: httpx.Response) -> dict:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP}
