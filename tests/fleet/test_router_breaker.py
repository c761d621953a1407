"""Backpressure is not failure (dist/breaker.py), against scripted backends: a replica that
answers 429, or 503 with Retry-After or kvserve's server_overloaded/shutting_down codes, is passed
over for this request and nothing else -- never taken out, its routing LRU kept -- and when every
replica is busy the client gets the busy answer with its Retry-After, not no_healthy_replica.
Failures open the circuit breaker only at the threshold; after the cool-down one probe goes
through, and its success brings the replica back."""
from __future__ import annotations

import pytest

from kvserve.fleet.breaker import CircuitBreaker, backpressure_reason
from kvserve.fleet.prefix_key import RequestHasher

from .test_router_failover import BODY, Backends, run


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_at_the_threshold_and_a_probe_closes_it():
    clock = Clock()
    br = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, clock=clock)
    assert not br.failure() and not br.failure() and br.state == "closed"
    br.success()                                    # a success resets the count
    assert not br.failure() and not br.failure() and br.allows()
    assert br.failure() and br.state == "open" and not br.allows()
    clock.now += 4.9
    assert not br.allows()
    clock.now += 0.1                                # cool-down over: one probe at a time
    assert br.state == "half-open" and br.allows()
    assert br.begin() and not br.allows()
    br.release_probe()                              # e.g. the probe met backpressure
    assert br.state == "half-open" and br.allows()
    assert br.begin() and br.failure()              # a failed probe opens it again ...
    assert br.state == "open" and not br.allows()
    clock.now += 5.0
    assert br.begin() and br.state == "half-open"
    br.success()                                    # ... and a successful one closes it
    assert br.state == "closed" and br.consecutive_failures == 0 and not br.begin()


def test_breaker_configuration_errors():
    with pytest.raises(ValueError, match="threshold"):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError, match="cool-down"):
        CircuitBreaker(cooldown_s=0)


def test_what_counts_as_backpressure():
    def err(code):
        return ('{"error": {"code": "%s"}}' % code).encode()

    assert backpressure_reason(429, {}, b"") == "rate_limited"
    assert backpressure_reason(503, {"retry-after": "1"}, b"") == "overloaded"
    assert backpressure_reason(503, {}, err("server_overloaded")) == "overloaded"
    assert backpressure_reason(503, {}, err("shutting_down")) == "shutting_down"
    assert backpressure_reason(503, {}, err("engine_dead")) is None      # a dead engine failed
    assert backpressure_reason(500, {"retry-after": "1"}, b"") is None
    assert backpressure_reason(502, {}, b"<html>bad gateway</html>") is None


def run_hashed(b, hosts, go, **replica_kw):
    """`run` with a routing key for BODY (one block of token ids), so the LRUs fill."""
    return run(b, hosts, go, "cache-aware", replica_kw, hasher=RequestHasher(None, 16))


def test_a_busy_replica_is_passed_over_and_kept():
    for busy in ("busy", "429", "shutting"):
        b = Backends(a="ok", b="ok")

        async def go(router, c):
            first = await c.post("/v1/completions", json=BODY)      # BODY's prefix now lives on one
            home = router.replicas.replicas[[r.url for r in router.replicas.replicas]
                                            .index(first.headers["x-kvserve-replica"])]
            b.behaviour[home.url[7:]] = busy
            answers = [await c.post("/v1/completions", json=BODY) for _ in range(6)]
            return home, answers, router

        home, answers, router = run_hashed(b, ["a", "b"], go)
        other = next(r for r in router.replicas.replicas if r is not home)
        assert [a.status_code for a in answers] == [200] * 6
        assert {a.headers["x-kvserve-replica"] for a in answers} == {other.url}
        # still in, breaker closed, its LRU (BODY's block) kept: BODY went there first again
        assert home.healthy and home.breaker.state == "closed" and home.failures == 0
        assert home.breaker.consecutive_failures == 0 and len(home.lru) == 1 and home.in_flight == 0
        assert home.backpressured == b.calls.count(home.url[7:]) - 1 >= 1
        reason = {"busy": "overloaded", "429": "rate_limited", "shutting": "shutting_down"}[busy]
        text = router.metrics.render().decode()
        n = float(home.backpressured)
        assert f'kvserve:router_backpressure_total{{reason="{reason}",replica="{home.url}"}} {n}' in text
        assert f'kvserve:router_retries_total{{replica="{home.url}"}} 0.0' in text


def test_every_replica_busy_is_a_503_with_retry_after_never_no_healthy_replica():
    b = Backends(a="busy", b="shutting")

    async def go(router, c):
        answers = [await c.post("/v1/completions", json=BODY) for _ in range(5)]
        b.behaviour.update(a="ok", b="ok")
        return answers, await c.post("/v1/completions", json=BODY), router

    answers, after, router = run_hashed(b, ["a", "b"], go)
    for a in answers:
        assert a.status_code == 503 and a.headers["retry-after"] == "1"
        assert a.json()["error"]["code"] in ("server_overloaded", "shutting_down")
    assert after.status_code == 200                 # nothing was taken out meanwhile
    assert all(r.healthy and r.breaker.consecutive_failures == 0 and len(r.lru) == 1
               for r in router.replicas.replicas)


def test_an_open_replica_comes_back_through_one_probe_after_the_cool_down():
    clock = Clock()
    b = Backends(a="ok")

    async def go(router, c):
        a = router.replicas.replicas[0]
        b.behaviour["a"] = "500"
        codes = [(await c.post("/v1/completions", json=BODY)).status_code]    # opens (threshold 1)
        b.behaviour["a"] = "ok"
        await router.check_health()                 # /health answers: still out until the probe
        out = await c.post("/v1/completions", json=BODY)
        codes.append(out.json()["error"]["code"])
        states = [a.breaker.state]
        clock.now += 10.0
        states.append(a.breaker.state)
        b.behaviour["a"] = "busy"                   # a probe that meets backpressure: no verdict
        codes.append((await c.post("/v1/completions", json=BODY)).status_code)
        states.append(a.breaker.state)
        b.behaviour["a"] = "ok"
        codes.append((await c.post("/v1/completions", json=BODY)).status_code)    # the probe
        states.append(a.breaker.state)
        return codes, states, a

    codes, states, a = run_hashed(b, ["a"], go, failure_threshold=1, cooldown_s=5.0, clock=clock)
    assert codes == [500, "no_healthy_replica", 503, 200]
    assert states == ["open", "half-open", "half-open", "closed"]
    assert b.calls == ["a"] * 3 and a.failures == 1 and a.in_flight == 0


def test_backpressure_on_an_older_request_leaves_the_probe_slot_taken():
    """A request sent while the breaker was closed meets backpressure while the half-open probe is
    out: only the probe's own `end` frees the slot, so no second probe goes out meanwhile."""
    from kvserve.fleet.replicas import Pick, ReplicaSet

    clock = Clock()
    rs = ReplicaSet(["http://a"], failure_threshold=1, cooldown_s=5.0, clock=clock)
    a = rs.replicas[0]
    assert not rs.begin(Pick(a, 0), [])             # an older request, sent while closed
    rs.failed(a, "boom")                            # another one failed: open
    clock.now += 5.0
    probe = rs.begin(Pick(a, 0), [])
    assert probe and not a.breaker.allows()
    rs.backpressured(a)                             # the older request's answer: busy
    rs.end(a)
    assert not a.breaker.allows() and rs.pick([]) is None
    rs.end(a, probe)                                # the probe ends without a verdict
    assert a.breaker.allows()
