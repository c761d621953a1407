"""The server's front for the answer caches (kvserve/answer_cache/) and tenants (server/tenants.py):
every /v1 completion request goes through `Front.handle`.

    authenticate (401) -> rate limit (429) -> parse the body -> scope to the tenant
    -> exact cache -> semantic cache -> the model -> store the answer

`--answer-cache exact` keeps the exact layer, `--answer-cache semantic` both (exact first).
Only deterministic requests (temperature 0 or a seed >= 0) without logprobs, echo or tools are
looked up or stored, keyed (and scoped) on the tenant and the request's `cache_salt` -- with a keys
file, the salt derived from both (server/salts.py) -- so neither layer answers across them. A
hit is the stored completion, as JSON or, when the request streams, as SSE chunks (one per
choice, then the usage chunk if asked, then `[DONE]`), with `usage` showing no tokens generated
(`completion_tokens` 0; the prompt counted as cached) and the header
`x-kvserve-cache: hit-exact` or `hit-semantic` (with `x-kvserve-cache-similarity`); other
answers say `miss` or `bypass`. Streamed answers are stored too, once every choice finished.

A request opts out of the semantic layer with `"semantic_cache": false`, of both with
`Cache-Control: no-cache` (no lookup; the answer is still stored) or `no-store` (neither).
Embedding runs on a worker thread of the server process: never on the event loop, never in the
engine loop.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import Counter, Histogram

from kvserve.answer_cache.exact import ExactCache, cacheable, request_key
from kvserve.answer_cache.semantic import DEFAULT_THRESHOLD
from kvserve.server.body import parse_body
from kvserve.server.openai.chat_renderer import template_messages
from kvserve.server.openai.sampling import check_priority
from kvserve.server.openai.protocol import (
    ChatCompletionChoice, ChatCompletionResponse, ChatCompletionStreamChoice, ChatCompletionStreamResponse,
    ChatMessage, CompletionChoice, CompletionResponse, CompletionStreamResponse, DeltaMessage, UsageInfo)

CACHE_HEADER = "x-kvserve-cache"
SIMILARITY_HEADER = "x-kvserve-cache-similarity"
_SIM_BUCKETS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.875, 0.9, 0.925, 0.95, 0.975, 0.99, 1.0)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Plan:
    """What the caches need of one request: its exact key, semantic scope and query."""
    endpoint: str
    tenant: str
    key: str | None = None
    scope: str | None = None
    query: str | None = None
    vec: object = None
    lookup: bool = True                 # False: Cache-Control: no-cache (store only)
    headers: dict = field(default_factory=dict)


def install(state, api_keys=None, answer_cache: dict | None = None) -> None:
    """Give the server state its tenants (`state.tenancy`) and its front (`state.front`);
    `api_keys` is a keys file's path or a loaded `TenantRegistry` (`tenant_registry`)."""
    from kvserve.server.tenants import Tenancy, TenantRegistry

    registry = TenantRegistry.load(api_keys, state.api_key) if isinstance(api_keys, str) else api_keys
    state.tenancy = Tenancy(state, registry)
    state.front = Front(state, **(answer_cache or {}))


class Front:
    def __init__(self, state, mode: str = "none", threshold: float = DEFAULT_THRESHOLD, ttl: float = 3600.0,
                 max_entries: int = 10000, embedder=None):
        if mode not in ("none", "exact", "semantic"):
            raise ValueError(f"--answer-cache must be none, exact or semantic, got {mode!r}.")
        self.state, self.mode = state, mode
        self.exact = ExactCache(max_entries, ttl) if mode != "none" else None
        self.semantic = self._embedder = None
        r, m = state.metrics.registry, state.metrics
        self.model_name = m.model_name
        self.lookups = Counter("kvserve:answer_cache_lookups", "Answer-cache lookups by cache and result.",
                               ["model_name", "tenant", "cache", "result"], registry=r)
        if mode == "semantic":
            from kvserve.answer_cache.semantic import SemanticCache

            self.semantic = SemanticCache(threshold, max_entries, ttl)
            self.similarity = Histogram("kvserve:semantic_cache_similarity",
                                        "Cosine similarity of semantic-cache hits.", ["model_name"],
                                        buckets=_SIM_BUCKETS, registry=r)
            self.embed_time = Histogram("kvserve:semantic_cache_embedding_seconds",
                                        "Time to embed one query.", ["model_name"], registry=r)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-embed")
            self._embedder = self._pool.submit(_load_embedder, embedder)     # loads in the background

    def shutdown(self) -> None:
        if self._embedder is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def handle(self, request, model_cls, endpoint: str, handler):
        tenancy = self.state.tenancy
        tenant = tenancy.authenticate(request)
        req = await parse_body(self.state, request, model_cls)
        check_priority(self.state, req)
        tenancy.begin(tenant, req)
        plan = await self._plan(req, endpoint, tenant.name, request)
        if plan is None:
            resp = await handler(self.state, req, request)
            return _with_headers(resp, {CACHE_HEADER: "bypass"} if self.mode != "none" else {})
        hit = await self._lookup(plan)
        if hit is not None:
            return _replay(self.state, req, endpoint, hit, plan.headers)
        resp = await handler(self.state, req, request)
        plan.headers[CACHE_HEADER] = "miss"
        if isinstance(resp, StreamingResponse):
            resp.body_iterator = self._capture(plan, resp.body_iterator)
            return _with_headers(resp, plan.headers)
        if isinstance(resp, dict):
            answer = _answer_of(endpoint, resp)
            if answer is not None:
                self._store(plan, answer)
        return _with_headers(resp, plan.headers)

    # -- keys ---------------------------------------------------------------------------------
    async def _plan(self, req, endpoint: str, tenant: str, request) -> Plan | None:
        if self.mode == "none":
            return None
        cc = request.headers.get("cache-control", "").lower()
        if "no-store" in cc:
            return None
        fields = req.model_dump(exclude={"prompt", "messages"})
        logprobs = req.logprobs is not None and req.logprobs is not False    # completions' 0 asks too
        if not cacheable(fields) or getattr(req, "echo", False) or logprobs or getattr(req, "tools", None) \
                or getattr(req, "prompt_logprobs", None) is not None:
            return None             # (an answer with tool calls is not kept: the store holds text)
        plan = Plan(endpoint, tenant)
        scope = [tenant, req.cache_salt]        # who may see the answer (after Tenancy.begin)
        if endpoint == "chat":
            if self.state.chat is None:
                return None
            messages = template_messages(req)
            size = sum(len(m["content"]) for m in messages)
            text = await self.state.tokenization.call(size, self.state.chat.render, messages,
                                                      req.add_generation_prompt)
            plan.key = request_key(self.model_name, endpoint, text, fields, scope)
            if messages[-1]["role"] == "user" and messages[-1]["content"]:
                plan.query = messages[-1]["content"]
                plan.scope = request_key(self.model_name, endpoint, messages[:-1], fields, scope)
        else:
            plan.key = request_key(self.model_name, endpoint, req.prompt, fields, scope)
            if isinstance(req.prompt, str) and req.prompt:
                plan.query = req.prompt
                plan.scope = request_key(self.model_name, endpoint, None, fields, scope)
        if self.semantic is None or not req.semantic_cache:
            plan.scope = plan.query = None
        if "no-cache" in cc:
            plan.headers[CACHE_HEADER] = "miss"
            plan.lookup = False
        return plan

    async def _lookup(self, plan: Plan):
        if plan.lookup:
            answer = self.exact.get(plan.key)
            self.lookups.labels(self.model_name, plan.tenant, "exact", "hit" if answer else "miss").inc()
            if answer is not None:
                plan.headers[CACHE_HEADER] = "hit-exact"
                return answer
        if plan.query is None:
            return None
        embedder = await asyncio.wrap_future(self._embedder)     # loaded once, at startup
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        plan.vec = (await loop.run_in_executor(self._pool, embedder, [plan.query]))[0]
        self.embed_time.labels(self.model_name).observe(time.perf_counter() - t0)
        if not plan.lookup:
            return None
        match = self.semantic.lookup(plan.scope, plan.vec, plan.query)
        self.lookups.labels(self.model_name, plan.tenant, "semantic", "hit" if match else "miss").inc()
        if match is None:
            return None
        self.similarity.labels(self.model_name).observe(match.similarity)
        plan.headers[CACHE_HEADER] = "hit-semantic"
        plan.headers[SIMILARITY_HEADER] = f"{match.similarity:.4f}"
        return match.value

    def _store(self, plan: Plan, answer: dict) -> None:
        if any(c["finish_reason"] not in ("stop", "length") for c in answer["choices"]):
            return                              # aborted or failed: not an answer to keep
        self.exact.put(plan.key, answer)
        if plan.vec is not None and self.semantic is not None:
            self.semantic.insert(plan.scope, plan.vec, answer, plan.query)

    async def _capture(self, plan: Plan, body):
        """Pass the SSE stream through, rebuilding the answer from its chunks; store it once
        the stream ended with every choice finished."""
        choices: dict[int, dict] = {}
        usage = None
        ok = True
        async for chunk in body:
            yield chunk
            for line in (chunk if isinstance(chunk, str) else chunk.decode()).split("\n"):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                try:
                    obj = json.loads(line[6:])
                except ValueError:
                    ok = False
                    continue
                if "error" in obj:
                    ok = False
                usage = obj.get("usage") or usage
                for ch in obj.get("choices", ()):
                    c = choices.setdefault(ch["index"], {"index": ch["index"], "text": "",
                                                         "finish_reason": None, "stop_reason": None})
                    piece = (ch.get("delta") or {}).get("content") if plan.endpoint == "chat" else ch.get("text")
                    c["text"] += piece or ""
                    if ch.get("finish_reason") is not None:
                        c["finish_reason"], c["stop_reason"] = ch["finish_reason"], ch.get("stop_reason")
        if ok and choices:
            self._store(plan, {"choices": [choices[i] for i in sorted(choices)],
                               "prompt_tokens": (usage or {}).get("prompt_tokens")})


def _load_embedder(embedder):
    if embedder is not None:
        return embedder
    from kvserve.answer_cache.semantic import Embedder

    return Embedder()


def _answer_of(endpoint: str, resp: dict) -> dict | None:
    choices = []
    for c in resp.get("choices", ()):
        text = c["message"]["content"] if endpoint == "chat" else c["text"]
        choices.append({"index": c["index"], "text": text or "", "finish_reason": c.get("finish_reason"),
                        "stop_reason": c.get("stop_reason")})
    return {"choices": choices, "prompt_tokens": (resp.get("usage") or {}).get("prompt_tokens")}


def _with_headers(resp, headers: dict):
    if isinstance(resp, dict):
        return JSONResponse(resp, headers=headers)
    for k, v in headers.items():
        resp.headers[k] = v
    return resp


def _cached_usage(answer: dict) -> UsageInfo:
    p = answer.get("prompt_tokens") or 0
    return UsageInfo(prompt_tokens=p, completion_tokens=0, total_tokens=p,
                     prompt_tokens_details={"cached_tokens": p})


def _replay(state, req, endpoint: str, answer: dict, headers: dict):
    """The stored answer as this request's response (JSON, or SSE when it streams)."""
    created, usage, model = int(time.time()), _cached_usage(answer), state.model_name
    chat = endpoint == "chat"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if not req.stream:
        if chat:
            body = ChatCompletionResponse(id=rid, created=created, model=model, usage=usage, choices=[
                ChatCompletionChoice(index=c["index"], message=ChatMessage(content=c["text"]),
                                     finish_reason=c["finish_reason"], stop_reason=c["stop_reason"])
                for c in answer["choices"]])
        else:
            body = CompletionResponse(id=rid, created=created, model=model, usage=usage, choices=[
                CompletionChoice(index=c["index"], text=c["text"], finish_reason=c["finish_reason"],
                                 stop_reason=c["stop_reason"]) for c in answer["choices"]])
        return JSONResponse(body.model_dump(), headers=headers)

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def stream():
        for c in answer["choices"]:
            if chat:
                obj = ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[
                    ChatCompletionStreamChoice(index=c["index"], delta=DeltaMessage(role="assistant", content=c["text"]),
                                               finish_reason=c["finish_reason"], stop_reason=c["stop_reason"])]).model_dump()
                obj["choices"][0]["delta"] = {k: v for k, v in obj["choices"][0]["delta"].items() if v is not None}
            else:
                obj = CompletionStreamResponse(id=rid, created=created, model=model, choices=[
                    CompletionChoice(index=c["index"], text=c["text"], finish_reason=c["finish_reason"],
                                     stop_reason=c["stop_reason"])]).model_dump()
            obj.pop("usage")
            yield sse(obj)
        if include_usage:
            cls = ChatCompletionStreamResponse if chat else CompletionStreamResponse
            yield sse(cls(id=rid, created=created, model=model, choices=[], usage=usage).model_dump())
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={**_SSE_HEADERS, **headers})


def add_cli_args(g) -> None:
    """`kvserve serve` flags of tenants and answer caches."""
    g.add_argument("--api-keys", default=None, metavar="FILE",
                   help="JSON or TOML file mapping API keys to tenants (weight, priority, "
                        "rate_limit per minute, burst): see kvserve/server/tenants.py")
    g.add_argument("--salt-secret-file", default=None, metavar="PATH",
                   help="the secret keying tenants' cache salts, the same file for every instance "
                        "of a deployment (created, mode 0600, if absent; default: $KVSERVE_SALT_SECRET, "
                        "else FILE.salt-secret beside --api-keys FILE): see kvserve/server/salts.py")
    g.add_argument("--answer-cache", default="none", choices=["none", "exact", "semantic"],
                   help="answer deterministic requests from a cache: exact (same request) or "
                        "semantic (exact, then the nearest past query above --semantic-threshold)")
    g.add_argument("--semantic-threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="cosine similarity a semantic-cache hit needs (all-MiniLM-L6-v2)")
    g.add_argument("--answer-cache-ttl", type=float, default=3600.0, help="seconds an answer stays cached")
    g.add_argument("--answer-cache-size", type=int, default=10000, help="most answers cached (LRU)")


def tenant_registry(args):
    """The tenants of `--api-keys` with the deployment's salt secret, or None without a keys file."""
    from kvserve.server.tenants import TenantRegistry

    if not args.api_keys:
        if args.salt_secret_file:
            raise ValueError("--salt-secret-file keys tenants' salts: it needs --api-keys FILE "
                             "(without tenants a cache_salt is used as it is)")
        return None
    return TenantRegistry.load(args.api_keys, args.api_key or None, args.salt_secret_file)


def answer_cache_options(args) -> dict:
    return {"mode": args.answer_cache, "threshold": args.semantic_threshold,
            "ttl": args.answer_cache_ttl, "max_entries": args.answer_cache_size}
