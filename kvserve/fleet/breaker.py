"""A replica's circuit breaker, and what counts against it: failure is not backpressure.

    closed     requests flow; `failure_threshold` consecutive failures open the breaker (a
               success resets the count)
    open       no requests, for `cooldown_s` seconds (a failure meanwhile restarts the cool-down)
    half-open  after the cool-down: one probe request at a time; its success closes the breaker,
               its failure opens it again

Failures are connection errors, timeouts, broken streams and 5xx answers. Backpressure is a
replica saying "not now" -- 429, or 503 with `Retry-After`, or kvserve's `server_overloaded` /
`shutting_down` codes -- and it is neither a failure nor a success: the router sends the request
to another replica, the breaker and the replica's routing state stay as they are, and a probe
that meets backpressure ends without a verdict (the next request probes again).
"""
from __future__ import annotations

import json
import time

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"
DEFAULT_FAILURE_THRESHOLD = 3
DEFAULT_COOLDOWN_S = 5.0
BACKPRESSURE_CODES = {"server_overloaded": "overloaded", "shutting_down": "shutting_down"}
BACKPRESSURE_REASONS = ("overloaded", "rate_limited", "shutting_down")


def backpressure_reason(status: int, headers, body: bytes) -> str | None:
    """'overloaded', 'rate_limited' or 'shutting_down' when an answer is backpressure, else None."""
    if status == 429:
        return "rate_limited"
    if status != 503:
        return None
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    if code in BACKPRESSURE_CODES:
        return BACKPRESSURE_CODES[code]
    return "overloaded" if "retry-after" in headers else None


class CircuitBreaker:
    def __init__(self, failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
                 cooldown_s: float = DEFAULT_COOLDOWN_S, clock=time.monotonic):
        if failure_threshold < 1:
            raise ValueError("the circuit breaker's failure threshold (--cb-failure-threshold) must "
                             f"be >= 1, got {failure_threshold}.")
        if not cooldown_s > 0:
            raise ValueError("the circuit breaker's cool-down (--cb-timeout-duration-secs) must be "
                             f"> 0 seconds, got {cooldown_s}.")
        self.failure_threshold, self.cooldown_s, self.clock = failure_threshold, cooldown_s, clock
        self._state = CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self.probing = False        # half-open: the probe is in flight

    @property
    def state(self) -> str:
        if self._state == OPEN and self.clock() - self.opened_at >= self.cooldown_s:
            return HALF_OPEN
        return self._state

    def allows(self) -> bool:
        """Whether a request may be sent now."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self.probing)

    def begin(self) -> bool:
        """A request is sent (after `allows()`); True when it is the half-open probe."""
        if self.state != HALF_OPEN:
            return False
        self._state, self.probing = HALF_OPEN, True
        return True

    def success(self) -> None:
        self._state, self.consecutive_failures, self.probing = CLOSED, 0, False

    def failure(self) -> bool:
        """Count a failure; True when it opens the breaker (from closed or half-open)."""
        self.consecutive_failures += 1
        state = self.state
        if state == CLOSED and self.consecutive_failures < self.failure_threshold:
            return False
        self.trip()
        return state != OPEN

    def trip(self) -> None:
        """Open now (the cool-down starts again)."""
        self._state, self.opened_at, self.probing = OPEN, self.clock(), False

    def release_probe(self) -> None:
        """The probe ended without a verdict (backpressure, or the client left)."""
        self.probing = False
