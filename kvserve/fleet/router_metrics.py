"""Prometheus metrics of `kvserve router` (`GET /metrics`), under the `kvserve:router_` prefix.

    kvserve:router_requests_total{replica}           requests sent to a replica (retries included)
    kvserve:router_retries_total{replica}            requests that failed there before anything was
                                                     streamed, and were sent elsewhere
    kvserve:router_replica_failures_total{replica}   times the replica was taken out (its breaker opened)
    kvserve:router_backpressure_total{replica,reason}
                                                     answers that said "not now" -- reason overloaded
                                                     (503 with Retry-After), rate_limited (429) or
                                                     shutting_down -- sent elsewhere, the replica kept
    kvserve:router_prefix_query_blocks_total         leading block hashes of routed requests
    kvserve:router_prefix_hit_blocks_total           of those, found in the chosen replica's LRU
    kvserve:router_prefix_hit_rate                   hit blocks / query blocks (gauge)
    kvserve:router_replica_in_flight{replica}        requests in flight through this router (gauge)
    kvserve:router_replica_healthy{replica}          1 while the replica takes requests (gauge)
    kvserve:router_replica_breaker_state{replica}    0 closed, 1 half-open, 2 open (gauge)
    kvserve:router_replica_cached_blocks{replica}    block hashes in the router's LRU (gauge)

The routing hit rate is the router's estimate (what it sent where); the replicas' own
`kvserve:prefix_cache_hits_total` / `kvserve:prefix_cache_queries_total` say what the engines hit.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvserve.fleet.breaker import BACKPRESSURE_REASONS, CLOSED, HALF_OPEN, OPEN
from kvserve.fleet.replicas import ReplicaSet

_BREAKER_STATE = {CLOSED: 0.0, HALF_OPEN: 1.0, OPEN: 2.0}


class RouterMetrics:
    def __init__(self, replicas: ReplicaSet):
        self.replicas = replicas
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvserve:router_requests", "Requests sent to a replica.", ["replica"],
                                registry=r)
        self.retries = Counter("kvserve:router_retries",
                               "Requests that failed on a replica before streaming and were retried.",
                               ["replica"], registry=r)
        self.backpressured = Counter("kvserve:router_backpressure",
                                     "Backpressure answers (429, 503 with Retry-After) from a replica.",
                                     ["replica", "reason"], registry=r)
        self.query_blocks = Counter("kvserve:router_prefix_query_blocks",
                                    "Leading block hashes of routed requests.", registry=r)
        self.hit_blocks = Counter("kvserve:router_prefix_hit_blocks",
                                  "Leading block hashes found in the chosen replica's LRU.", registry=r)
        self.num_query_blocks = self.num_hit_blocks = 0
        r.register(_ReplicaCollector(self))
        for rep in replicas.replicas:        # every replica's series exists from the start
            self.requests.labels(rep.url)
            self.retries.labels(rep.url)
            for reason in BACKPRESSURE_REASONS:
                self.backpressured.labels(rep.url, reason)

    def routed(self, replica_url: str, query: int, hit: int, first_attempt: bool) -> None:
        self.requests.labels(replica_url).inc()
        if first_attempt:
            self.query_blocks.inc(query)
            self.hit_blocks.inc(hit)
            self.num_query_blocks += query
            self.num_hit_blocks += hit

    def retried(self, replica_url: str) -> None:
        self.retries.labels(replica_url).inc()

    def backpressure(self, replica_url: str, reason: str) -> None:
        self.backpressured.labels(replica_url, reason).inc()

    def hit_rate(self) -> float:
        q = self.num_query_blocks
        return self.num_hit_blocks / q if q else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ReplicaCollector:
    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics

    def collect(self):
        reps = self.metrics.replicas.replicas
        fams = [
            ("kvserve:router_replica_in_flight", "Requests in flight through this router.",
             lambda r: r.in_flight),
            ("kvserve:router_replica_healthy", "1 while the replica takes requests.",
             lambda r: 1.0 if r.healthy else 0.0),
            ("kvserve:router_replica_breaker_state", "The replica's circuit breaker: 0 closed, "
             "1 half-open, 2 open.", lambda r: _BREAKER_STATE[r.breaker.state]),
            ("kvserve:router_replica_cached_blocks", "Block hashes in the router's LRU of the replica.",
             lambda r: len(r.lru)),
        ]
        for name, doc, value in fams:
            g = GaugeMetricFamily(name, doc, labels=["replica"])
            for r in reps:
                g.add_metric([r.url], value(r))
            yield g
        failures = CounterMetricFamily("kvserve:router_replica_failures",
                                     "Times the replica was taken out.", labels=["replica"])
        for r in reps:
            failures.add_metric([r.url], r.failures)
        yield failures
        yield GaugeMetricFamily("kvserve:router_prefix_hit_rate",
                                "Routing prefix hit rate: hit blocks / query blocks.",
                                value=self.metrics.hit_rate())
