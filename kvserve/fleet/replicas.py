"""The router's view of its replicas, and the routing policies (seed 003, "Radix trees": route a
request to the replica that holds its prefix; Mooncake's cache-centric scheduling, balanced
against load).

Each `Replica` keeps what the router knows of it: its circuit breaker (dist/breaker.py), the
requests it has in flight through this router, and a bounded LRU of the block hashes the router
has sent it (`BlockLRU`: the router's estimate of the replica's prefix cache; what a replica
evicted on its own, the LRU forgets later or never -- a stale entry costs one mis-routed
request, never a wrong answer).

Policies (`ReplicaSet.pick`):

    round-robin    the next healthy replica in turn
    least-loaded   the healthy replica with the fewest requests in flight (ties: in turn)
    cache-aware    the replica whose LRU matches the longest run of the request's leading block
                   hashes, among the replicas whose in-flight count exceeds the least-loaded one's
                   by at most `balance_threshold` (so a hot prefix spreads out once its replica
                   queues up); ties, and requests that match nowhere, go to the least loaded.

Only replicas whose breaker lets a request through are candidates (`CircuitBreaker.allows`).
A replica whose breaker opens loses its LRU (it may come back restarted, its cache empty);
backpressure (`backpressured`) touches neither. The set is touched only from the router's event
loop: no locks.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvserve.fleet.breaker import (DEFAULT_COOLDOWN_S, DEFAULT_FAILURE_THRESHOLD, OPEN,
                                  CircuitBreaker)

POLICIES = ("cache-aware", "round-robin", "least-loaded")
DEFAULT_LRU_BLOCKS = 1 << 16
DEFAULT_BALANCE_THRESHOLD = 4


class BlockLRU:
    """A bounded set of block hashes, least recently routed evicted first."""

    def __init__(self, capacity: int = DEFAULT_LRU_BLOCKS):
        if capacity < 1:
            raise ValueError(f"the router's per-replica LRU needs at least 1 block, got {capacity}.")
        self.capacity = capacity
        self._d: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, h: bytes) -> bool:
        return h in self._d

    def match(self, hashes: list[bytes]) -> int:
        """How many leading hashes are present (a chained hash commits to its whole prefix, so
        the walk stops at the first miss, as the engine's lookup does)."""
        n = 0
        for h in hashes:
            if h not in self._d:
                break
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        """Record (or refresh) hashes; the prefix's head is touched last, so it is evicted last."""
        d = self._d
        for h in reversed(hashes):
            if h in d:
                d.move_to_end(h)
            else:
                d[h] = None
        while len(d) > self.capacity:
            d.popitem(last=False)

    def clear(self) -> None:
        self._d.clear()


@dataclass
class Replica:
    url: str
    lru: BlockLRU = field(default_factory=BlockLRU)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    in_flight: int = 0
    routed: int = 0
    failures: int = 0           # times the breaker opened
    backpressured: int = 0      # answers that said "not now" (429, 503 with Retry-After, ...)
    last_error: str | None = None
    kv_stream: str | None = None  # a decode instance's KV stream address (its /health says)

    @property
    def healthy(self) -> bool:
        """Not taken out: the breaker is closed or half-open."""
        return self.breaker.state != OPEN

    def state(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "breaker": self.breaker.state,
                "consecutive_failures": self.breaker.consecutive_failures,
                "in_flight": self.in_flight, "routed": self.routed, "failures": self.failures,
                "backpressured": self.backpressured, "cached_blocks": len(self.lru),
                "last_error": self.last_error, **({"kv_stream": self.kv_stream} if self.kv_stream else {})}


@dataclass
class Pick:
    replica: Replica
    matched_blocks: int        # the chosen replica's match: the routing prefix hit


class ReplicaSet:
    def __init__(self, urls: list[str], policy: str = "cache-aware",
                 balance_threshold: int = DEFAULT_BALANCE_THRESHOLD,
                 lru_blocks: int = DEFAULT_LRU_BLOCKS,
                 failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
                 cooldown_s: float = DEFAULT_COOLDOWN_S, clock=time.monotonic):
        if not urls:
            raise ValueError("the router needs at least one backend: pass --backends URL1,URL2,...")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}.")
        if balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {balance_threshold}.")
        urls = [u.rstrip("/") for u in urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a backend is listed twice: {urls}")
        self.replicas = [Replica(u, BlockLRU(lru_blocks),
                                 CircuitBreaker(failure_threshold, cooldown_s, clock)) for u in urls]
        self.policy = policy
        self.balance_threshold = balance_threshold
        self._turn = itertools.count()

    def healthy(self, exclude=()) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r not in exclude]

    def available(self, exclude=()) -> list[Replica]:
        """The replicas a request may be sent to now (a half-open one while no probe is out)."""
        return [r for r in self.replicas if r.breaker.allows() and r not in exclude]

    def _in_turn(self, candidates: list[Replica]) -> Replica:
        """Round-robin among equals, so ties never pile onto the first replica."""
        return candidates[next(self._turn) % len(candidates)]

    def pick(self, hashes: list[bytes], exclude=()) -> Pick | None:
        """The replica for a request with leading block hashes `hashes` (None: none available)."""
        candidates = self.available(exclude)
        if not candidates:
            return None
        if self.policy == "round-robin":
            r = self._in_turn(candidates)
            return Pick(r, r.lru.match(hashes))
        least = min(r.in_flight for r in candidates)
        if self.policy == "least-loaded":
            r = self._in_turn([r for r in candidates if r.in_flight == least])
            return Pick(r, r.lru.match(hashes))
        eligible = [r for r in candidates if r.in_flight - least <= self.balance_threshold]
        matches = [(r.lru.match(hashes), r) for r in eligible]
        best = max(m for m, _ in matches)
        tied = [r for m, r in matches if m == best]
        fewest = min(r.in_flight for r in tied)
        return Pick(self._in_turn([r for r in tied if r.in_flight == fewest]), best)

    def begin(self, pick: Pick, hashes: list[bytes]) -> bool:
        """The request is on its way to the replica: count it and remember its prefix there.
        True when it is the replica's half-open probe (pass it to `end`)."""
        r = pick.replica
        r.in_flight += 1
        r.routed += 1
        r.lru.add(hashes)
        return r.breaker.begin()

    @staticmethod
    def end(replica: Replica, probe: bool = False) -> None:
        """The request is done with the replica; a probe that got no verdict frees its slot."""
        replica.in_flight -= 1
        if probe:
            replica.breaker.release_probe()

    @staticmethod
    def succeeded(replica: Replica) -> None:
        replica.breaker.success()

    @staticmethod
    def failed(replica: Replica, why: str) -> bool:
        """Count a failure; True when it takes the replica out (its breaker opens)."""
        replica.last_error = why
        if not replica.breaker.failure():
            return False
        replica.failures += 1
        replica.lru.clear()
        return True

    @staticmethod
    def backpressured(replica: Replica) -> None:
        """The replica answered "not now": counted; its breaker and LRU are left as they are
        (a probe that met it is freed by `end`)."""
        replica.backpressured += 1

    @staticmethod
    def mark_down(replica: Replica, why: str) -> None:
        """Take a replica out now (its breaker opens, whatever its count)."""
        if replica.healthy:
            replica.failures += 1
        replica.breaker.trip()
        replica.last_error = why
        replica.lru.clear()

    @staticmethod
    def mark_up(replica: Replica) -> None:
        replica.breaker.success()
