"""Tenants: API keys, per-tenant rate limits, cache scope and fair-scheduling inputs (seed 003:
"a prefix cache is a timing side channel: scope it to a trust group"; "one tenant's burst
delays everyone").

`kvserve serve --api-keys FILE` maps keys to tenants. The file is JSON or TOML (by extension;
JSON otherwise), a table of keys, each naming its tenant and optionally its VTC weight, its
priority level and a rate limit in requests per minute (with a burst, default a tenth of it):

    {"keys": {"sk-alice": {"tenant": "alice", "weight": 2, "priority": 0,
                           "rate_limit": 600, "burst": 20},
              "sk-bob":   {"tenant": "bob"}}}

    [keys."sk-alice"]          # the same in TOML
    tenant = "alice"
    weight = 2.0

Several keys may name one tenant (its settings come from the first). `--api-key KEY` keeps
working alone (no tenants: everyone shares one scope, as before) or beside a keys file (then it
is the key of tenant "default").

A tenant scopes everything cache-like: the prefix-cache salt is derived from the tenant and the
request's own `cache_salt`, if any, keyed with the deployment's salt secret (server/salts.py), so
no request can name another tenant's salt and one `cache_salt` never crosses tenants; the answer
caches (kvserve/answer_cache/) key on that salt too. Its weight and priority go to the engine's
scheduler with each request (engine/fairness.py).
Per-tenant requests, tokens, rate-limit refusals and answer-cache hits are /metrics counters
labelled `tenant`.
"""
from __future__ import annotations

import contextvars
import hashlib
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter

from kvserve.server.body import check_auth
from kvserve.server.openai.protocol import APIError
from kvserve.server.salts import derive_salt, load_secret

# The tenant of the HTTP request being handled (for the per-tenant token counters).
current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvserve_tenant", default=None)
# The request's `user` field, for its log line (server/request_log.py).
current_user: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvserve_user", default=None)
# What the scheduler needs of it (tenant, weight, priority), added to each engine prompt.
current_fields: contextvars.ContextVar[dict | None] = contextvars.ContextVar("kvserve_fields", default=None)


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0             # VTC: service is counted as tokens / weight
    priority: int = 0               # the most urgent level its requests may ask for (lower first)
    rate_limit: float | None = None  # requests per minute (None: unlimited)
    burst: float | None = None      # bucket size (default max(1, rate_limit / 10))


DEFAULT_TENANT = Tenant("default")


class RateLimiter:
    """A token bucket per tenant: `burst` requests at once, refilled at rate_limit / 60 per s."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}     # tenant -> (tokens, last time)
        self._lock = threading.Lock()

    def acquire(self, tenant: Tenant) -> float:
        """0 when the request may go now, else the seconds until it could (nothing taken)."""
        if not tenant.rate_limit:
            return 0.0
        rate = tenant.rate_limit / 60.0
        cap = tenant.burst if tenant.burst is not None else max(1.0, tenant.rate_limit / 10.0)
        now = self.clock()
        with self._lock:
            tokens, last = self._buckets.get(tenant.name, (cap, now))
            tokens = min(cap, tokens + (now - last) * rate)
            if tokens >= 1.0:
                self._buckets[tenant.name] = (tokens - 1.0, now)
                return 0.0
            self._buckets[tenant.name] = (tokens, now)
            return (1.0 - tokens) / rate


def _parse_tenant(key: str, entry) -> Tenant:
    if isinstance(entry, str):
        entry = {"tenant": entry}
    if not isinstance(entry, dict) or not isinstance(entry.get("tenant"), str) or not entry["tenant"]:
        raise ValueError(f"api keys file: the entry of a key must be a table with a non-empty "
                         f"'tenant' name (key {key[:4]}...)")
    unknown = set(entry) - {"tenant", "weight", "priority", "rate_limit", "burst"}
    if unknown:
        raise ValueError(f"api keys file: unknown field(s) {sorted(unknown)} for tenant "
                         f"{entry['tenant']!r} (known: tenant, weight, priority, rate_limit, burst)")
    t = Tenant(entry["tenant"], float(entry.get("weight", 1.0)), int(entry.get("priority", 0)),
               float(entry["rate_limit"]) if entry.get("rate_limit") is not None else None,
               float(entry["burst"]) if entry.get("burst") is not None else None)
    if not (t.weight > 0 and math.isfinite(t.weight)):
        raise ValueError(f"api keys file: tenant {t.name!r}: weight must be a positive number")
    if t.rate_limit is not None and not t.rate_limit > 0:
        raise ValueError(f"api keys file: tenant {t.name!r}: rate_limit (requests per minute) must be > 0")
    if t.burst is not None and not t.burst >= 1:
        raise ValueError(f"api keys file: tenant {t.name!r}: burst must be >= 1")
    return t


class TenantRegistry:
    """API key -> Tenant. Keys are looked up by their SHA-256 (no timing on the key itself).
    `secret` keys the tenants' salts (server/salts.py; random when None: this process only)."""

    def __init__(self, keys: dict[str, Tenant], secret: bytes | None = None):
        self.tenants: dict[str, Tenant] = {}
        self._by_digest: dict[bytes, Tenant] = {}
        for key, t in keys.items():
            t = self.tenants.setdefault(t.name, t)          # a tenant's first entry wins
            self._by_digest[_digest(key.encode("utf-8", "surrogateescape"))] = t
        self._secret = secret if secret is not None else os.urandom(32)

    @classmethod
    def load(cls, path: str, api_key: str | None = None,
             salt_secret_file: str | None = None) -> "TenantRegistry":
        """The keys file at `path`, with the deployment's salt secret (`salt_secret_file`, else
        $KVSERVE_SALT_SECRET, else `<path>.salt-secret`; created if absent)."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read the api keys file {path!r}: {e.strerror}") from None
        try:
            if p.suffix.lower() == ".toml":
                import tomllib

                data = tomllib.loads(text)
            else:
                data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"the api keys file {path!r} is not valid {p.suffix[1:] or 'JSON'}: {e}") from None
        secret = load_secret(salt_secret_file, str(p.with_name(p.name + ".salt-secret")))
        return cls.from_dict(data, api_key, secret)

    @classmethod
    def from_dict(cls, data, api_key: str | None = None, secret: bytes | None = None) -> "TenantRegistry":
        if isinstance(data, dict) and isinstance(data.get("keys"), dict):
            data = data["keys"]
        if not isinstance(data, dict) or not data:
            raise ValueError("api keys file: expected a non-empty table of keys, "
                             "{\"keys\": {\"KEY\": {\"tenant\": NAME, ...}}}")
        keys = {str(k): _parse_tenant(str(k), v) for k, v in data.items()}
        if api_key:
            keys.setdefault(api_key, DEFAULT_TENANT)
        return cls(keys, secret)

    def resolve(self, token: bytes) -> Tenant | None:
        return self._by_digest.get(_digest(token))

    def salt(self, tenant: Tenant, cache_salt: str | None = None) -> str:
        """The engine salt of a tenant's request: unguessable without the deployment's secret."""
        return derive_salt(self._secret, tenant.name, cache_salt)


def _digest(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


class TenantMetrics:
    """Per-tenant counters in the server's registry. Tokens are counted when an engine request
    finishes: its id is tied to the tenant of the HTTP request that added it."""

    def __init__(self, metrics):
        r, labels = metrics.registry, ["model_name", "tenant"]
        self.model_name = metrics.model_name
        self.requests = Counter("kvserve:tenant_requests", "HTTP requests accepted, by tenant.",
                                labels, registry=r)
        self.prompt_tokens = Counter("kvserve:tenant_prompt_tokens",
                                     "Prompt tokens of finished engine requests, by tenant.", labels, registry=r)
        self.generation_tokens = Counter("kvserve:tenant_generation_tokens",
                                         "Tokens generated, by tenant.", labels, registry=r)
        self.rate_limited = Counter("kvserve:tenant_rate_limited",
                                    "Requests refused with 429 by the tenant's rate limit.", labels, registry=r)
        self._tenant_of: dict[str, str] = {}       # engine request id -> tenant name
        self._lock = threading.Lock()

    def install(self, state) -> None:
        """Tie engine request ids to tenants (when added) and count tokens (when finished)."""
        engine, metrics = state.core_client, state.metrics
        add, finished, abort = engine.add_request, metrics.observe_finished, engine.abort

        # Under fcfs the engine needs none of them: its prompts stay as they were.
        fair = engine.config.scheduler.scheduling_policy != "fcfs"      # the resolved Config

        async def add_request(request_id, prompt, *args, **kwargs):
            tenant, fields = current_tenant.get(), current_fields.get()
            if tenant is not None:
                with self._lock:
                    self._tenant_of[request_id] = tenant
            if fair and fields and isinstance(prompt, dict):      # engine/fairness.py reads them
                prompt = {**prompt, **fields}
            try:
                return await add(request_id, prompt, *args, **kwargs)
            except BaseException:
                self._forget(request_id)
                raise

        def observe_finished(output):
            finished(output)
            tenant = self._forget(output.request_id)
            if tenant is not None:
                self.prompt_tokens.labels(self.model_name, tenant).inc(len(output.prompt_token_ids or ()))
                self.generation_tokens.labels(self.model_name, tenant).inc(
                    sum(len(c.token_ids) for c in output.outputs))

        def abort_request(request_id):
            abort(request_id)
            self._forget(request_id)

        engine.add_request, metrics.observe_finished, engine.abort = add_request, observe_finished, abort_request

    def _forget(self, request_id: str) -> str | None:
        with self._lock:
            return self._tenant_of.pop(request_id, None)


class Tenancy:
    """The server's tenants: who a request is, whether it may go now, and its cache scope."""

    def __init__(self, state, registry: TenantRegistry | None):
        self.state = state
        self.registry = registry
        self.limiter = RateLimiter()
        self.metrics = TenantMetrics(state.metrics)
        self.metrics.install(state)

    def authenticate(self, request, limit: bool = True) -> Tenant:
        """The request's tenant, or 401; then its rate limit (429 with Retry-After)."""
        if self.registry is None:
            check_auth(self.state, request)         # --api-key alone, or no key: as before
            tenant = DEFAULT_TENANT
        else:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            tenant = self.registry.resolve(token.strip().encode("latin-1", "replace")) \
                if scheme.lower() == "bearer" else None
            if tenant is None:
                self.state.metrics.reject("unauthorized")
                raise APIError("invalid or missing API key: send 'Authorization: Bearer <key>'", 401,
                               code="invalid_api_key")
        wait = self.limiter.acquire(tenant) if limit else 0.0
        if wait > 0:
            self.metrics.rate_limited.labels(self.metrics.model_name, tenant.name).inc()
            raise APIError(f"rate limit reached for tenant {tenant.name!r} "
                           f"({tenant.rate_limit:g} requests per minute); retry after {wait:.1f} s",
                           429, type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(max(1, math.ceil(wait)))})
        return tenant

    def begin(self, tenant: Tenant, req) -> None:
        """Scope `req` to its tenant (prefix-cache salt, priority) and count it. With a keys
        file, `req.cache_salt` becomes the salt derived from (tenant, cache_salt)."""
        current_tenant.set(tenant.name)
        user = getattr(req, "user", None)
        current_user.set(user if isinstance(user, str) and user else None)
        current_fields.set(self.engine_fields(tenant, req))
        self.metrics.requests.labels(self.metrics.model_name, tenant.name).inc()
        if self.registry is not None:
            req.cache_salt = self.registry.salt(tenant, req.cache_salt)

    def engine_fields(self, tenant: Tenant, req) -> dict:
        """What the scheduler needs of the request (engine/fairness.py): tenant, weight and
        priority; with a keys file, never more urgent than the tenant's own level."""
        priority = getattr(req, "priority", 0) or 0
        if self.registry is not None:
            priority = max(tenant.priority, priority)
        return {"tenant": tenant.name, "tenant_weight": tenant.weight, "priority": priority}
