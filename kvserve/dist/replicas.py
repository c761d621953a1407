"""The router's view of its replicas, and the routing policies (seed 003, "Radix trees": route a
request to the replica that holds its prefix; Mooncake's cache-centric scheduling, balanced
against load).

Each `Replica` keeps what the router knows of it: health, the requests it has in flight through
this router, and a bounded LRU of the block hashes the router has sent it (`BlockLRU`: the
router's estimate of the replica's prefix cache; what a replica evicted on its own, the LRU
forgets later or never -- a stale entry costs one mis-routed request, never a wrong answer).

Policies (`ReplicaSet.pick`):

    round-robin    the next healthy replica in turn
    least-loaded   the healthy replica with the fewest requests in flight (ties: in turn)
    cache-aware    the replica whose LRU matches the longest run of the request's leading block
                   hashes, among the replicas whose in-flight count exceeds the least-loaded one's
                   by at most `balance_threshold` (so a hot prefix spreads out once its replica
                   queues up); ties, and requests that match nowhere, go to the least loaded.

The set is touched only from the router's event loop: no locks.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

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
    healthy: bool = True
    in_flight: int = 0
    routed: int = 0
    failures: int = 0
    last_error: str | None = None

    def state(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "routed": self.routed, "failures": self.failures, "cached_blocks": len(self.lru),
                "last_error": self.last_error}


@dataclass
class Pick:
    replica: Replica
    matched_blocks: int        # the chosen replica's match: the routing prefix hit


class ReplicaSet:
    def __init__(self, urls: list[str], policy: str = "cache-aware",
                 balance_threshold: int = DEFAULT_BALANCE_THRESHOLD,
                 lru_blocks: int = DEFAULT_LRU_BLOCKS):
        if not urls:
            raise ValueError("the router needs at least one backend: pass --backends URL1,URL2,...")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}.")
        if balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {balance_threshold}.")
        urls = [u.rstrip("/") for u in urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a backend is listed twice: {urls}")
        self.replicas = [Replica(u, BlockLRU(lru_blocks)) for u in urls]
        self.policy = policy
        self.balance_threshold = balance_threshold
        self._turn = itertools.count()

    def healthy(self, exclude=()) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r not in exclude]

    def _in_turn(self, candidates: list[Replica]) -> Replica:
        """Round-robin among equals, so ties never pile onto the first replica."""
        return candidates[next(self._turn) % len(candidates)]

    def pick(self, hashes: list[bytes], exclude=()) -> Pick | None:
        """The replica for a request with leading block hashes `hashes` (None: none healthy)."""
        candidates = self.healthy(exclude)
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

    def begin(self, pick: Pick, hashes: list[bytes]) -> None:
        """The request is on its way to the replica: count it and remember its prefix there."""
        r = pick.replica
        r.in_flight += 1
        r.routed += 1
        r.lru.add(hashes)

    @staticmethod
    def end(replica: Replica) -> None:
        replica.in_flight -= 1

    @staticmethod
    def mark_down(replica: Replica, why: str) -> None:
        """Take a replica out: new requests go elsewhere until a health check brings it back.
        Its LRU is dropped: a replica that comes back may have restarted with an empty cache."""
        if replica.healthy:
            replica.failures += 1
        replica.healthy = False
        replica.last_error = why
        replica.lru.clear()

    @staticmethod
    def mark_up(replica: Replica) -> None:
        replica.healthy = True
