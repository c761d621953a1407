"""The exact-match answer cache (seed 000, "Semantic caching": the cheap first layer).

The key is a SHA-256 of everything that decides the answer: the model, the endpoint, the full
prompt (or the chat messages after the chat template), every sampling field that changes the
output, and who may see the answer: the scope, the tenant and the request's `cache_salt`
(`request_key`). Only deterministic requests are cached (`cacheable`: temperature 0, or a seed
>= 0; -1 is vLLM's "no seed"), so a hit is the answer the model would give again. Entries
expire after `ttl` seconds and the least recently used go first past `max_entries`.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from typing import Any

# Request fields that never change the answer's content (how it is delivered, who asks, the
# prefix-cache salt -- which scopes the key instead: `request_key`'s `scope` --, the per-request
# cache switch).
NON_OUTPUT_FIELDS = frozenset({"stream", "stream_options", "user", "cache_salt", "model",
                               "priority", "semantic_cache"})


def cacheable(fields: dict) -> bool:
    """Deterministic: greedy (temperature 0) or a fixed seed (>= 0: -1 means unseeded)."""
    t, seed = fields.get("temperature"), fields.get("seed")
    return (t is not None and t == 0) or (isinstance(seed, int) and seed >= 0)


def output_fields(fields: dict) -> dict:
    """The request's fields that can change its output (everything but NON_OUTPUT_FIELDS)."""
    return {k: v for k, v in fields.items() if k not in NON_OUTPUT_FIELDS}


def request_key(model: str, endpoint: str, prompt: Any, fields: dict, scope: Any) -> str:
    """SHA-256 over the canonical JSON of (model, endpoint, prompt, output fields, scope);
    `scope` is who may see the answer (the server passes [tenant, cache_salt])."""
    blob = json.dumps([model, endpoint, prompt, output_fields(fields), scope], sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


class ExactCache:
    """key -> value with a TTL and an LRU size bound; thread-safe."""

    def __init__(self, max_entries: int = 10000, ttl: float | None = 3600.0, clock=time.monotonic):
        if max_entries < 1:
            raise ValueError(f"the answer cache needs max_entries >= 1, got {max_entries}.")
        self.max_entries = max_entries
        self.ttl = ttl
        self.clock = clock
        self._data: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = self.expirations = 0

    def get(self, key: str):
        with self._lock:
            item = self._data.get(key)
            if item is not None and item[0] <= self.clock():
                del self._data[key]
                self.expirations += 1
                item = None
            if item is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return item[1]

    def put(self, key: str, value) -> None:
        expiry = self.clock() + self.ttl if self.ttl else float("inf")
        with self._lock:
            self._data[key] = (expiry, value)
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._data)
