"""The log lines a person reads: one INFO line per finished engine request, a stats line every
`--log-stats-interval` s, and the `/metrics` names (`--metrics-prefix`, server/metrics.py).

Per request, on the `kvserve.requests` logger, written where the core client sees it end
(server/core_client.py `_log_end`: finished, aborted, stalled or failed -- once each):

    request cmpl-1f0c-0 finished: reason=length, prompt_tokens=7, output_tokens=16,
        ttft=12.3ms, e2e=85.1ms, user='alice', tenant=acme

`user` is the request's `user` field (when given), `tenant` its tenant (with an API keys file);
both come from the handler's context, which each output collector keeps. No text is logged.
`--disable-log-requests` turns it off.

The stats line (`kvserve.server`), vLLM's quantities: prompt and generation throughput over the
interval, running / waiting / swapped requests, KV-cache use, the interval's prefix-cache hit
rate (plus preemptions and the draft acceptance rate when there were any). Like vLLM, an idle
engine's line (no throughput in this interval or the one before, nothing running, waiting or
swapped) goes at DEBUG, so an idle server's INFO log stays quiet.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time

from kvserve.server.tenants import current_tenant, current_user

request_logger = logging.getLogger("kvserve.requests")
stats_logger = logging.getLogger("kvserve.server")

_MAX_USER_CHARS = 64


def install(app, state) -> None:
    """Log each request's end unless `state.log_requests` is off, and run the stats line with
    the app (every `state.log_stats_interval` s; 0: never)."""
    interval = state.log_stats_interval
    if interval is None or not math.isfinite(interval) or interval < 0:
        raise ValueError(f"log_stats_interval must be a number of seconds >= 0 (0: off), got {interval!r}")
    if state.log_requests:
        state.core_client.request_log = RequestLog(tenants=state.tenancy.registry is not None)
    if interval > 0:
        state.background.append(lambda: _stats_loop(StatsLine(state.core_client), interval))


# ---------------------------------------------------------------------- one line per request


class RequestLog:
    """Writes the line of each engine request that ended (called by the core client)."""

    def __init__(self, tenants: bool = False):
        self.tenants = tenants          # name the tenant: only when there is a keys file

    def ended(self, collector, request_id: str, output, reason: str | None = None, error=None) -> None:
        """`output`: the request's whole RequestOutput (or None when it made nothing); `reason`
        overrides its finish reasons ("abort", "error"); `error` says why it failed."""
        if not request_logger.isEnabledFor(logging.INFO):
            return
        parts = [f"reason={reason or _finish_reasons(output)}"]
        if output is not None:
            parts.append(f"prompt_tokens={len(output.prompt_token_ids or ())}")
            parts.append(f"output_tokens={sum(len(c.token_ids) for c in output.outputs)}")
            if len(output.outputs) > 1:
                parts.append(f"n={len(output.outputs)}")
            m = output.metrics
            if m is not None:
                parts.append(f"ttft={_ms(m.ttft)}")
                end = m.finished_time if m.finished_time is not None else time.monotonic()
                parts.append(f"e2e={_ms(end - m.arrival_time)}")
        context = getattr(collector, "context", None)
        if context is not None:
            user = context.get(current_user)
            if user:
                parts.append(f"user={user[:_MAX_USER_CHARS]!r}")
            tenant = context.get(current_tenant)
            if self.tenants and tenant is not None:
                parts.append(f"tenant={tenant!r}")
        if error is not None:
            parts.append(f"error={getattr(error, 'message', None) or str(error)!r}")
        request_logger.info("request %s finished: %s", request_id, ", ".join(parts))


def _finish_reasons(output) -> str:
    """The finish reason, or the samples' reasons in order when they differ ("stop,length")."""
    reasons = [c.finish_reason or "abort" for c in (output.outputs if output is not None else ())]
    return ",".join(dict.fromkeys(reasons)) or "abort"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1000:.1f}ms"


# ---------------------------------------------------------------------- the stats line


class StatsLine:
    """The periodic line, from the core client's latest engine-stats snapshot (engine/stats.py)."""

    def __init__(self, core_client, clock=time.monotonic):
        self.core_client, self.clock = core_client, clock
        self.last_time = clock()
        self.last = core_client.last_stats
        self.last_busy = False          # the previous interval had throughput

    def log(self) -> str:
        """Write the line (INFO, or DEBUG when idle) and return it."""
        now, s, p = self.clock(), self.core_client.last_stats, self.last
        dt = max(now - self.last_time, 1e-9)
        prompt = _delta(s, p, "prompt_tokens_total") / dt
        generation = _delta(s, p, "generation_tokens_total") / dt
        queries = _delta(s, p, "prefix_cache_queries_total")
        hit_rate = _delta(s, p, "prefix_cache_hits_total") / queries if queries else 0.0
        line = (f"Avg prompt throughput: {prompt:.1f} tokens/s, "
                f"Avg generation throughput: {generation:.1f} tokens/s, "
                f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
                f"Swapped: {getattr(s, 'num_swapped', 0)} reqs, "
                f"KV cache usage: {s.kv_cache_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {hit_rate * 100:.1f}%")
        preempted = _delta(s, p, "num_preemptions_total")
        if preempted:
            line += f", Preempted: {preempted:.0f} reqs"
        drafts = _delta(s, p, "spec_decode_num_draft_tokens")
        if drafts:
            line += f", Draft acceptance rate: {_delta(s, p, 'spec_decode_num_accepted_tokens') / drafts * 100:.1f}%"
        busy = bool(prompt or generation)
        active = busy or self.last_busy or s.num_running or s.num_waiting or getattr(s, "num_swapped", 0)
        stats_logger.log(logging.INFO if active else logging.DEBUG, "%s", line)
        self.last_time, self.last, self.last_busy = now, s, busy
        return line


def _delta(now, before, attr: str) -> float:
    return float(getattr(now, attr, 0) or 0) - float(getattr(before, attr, 0) or 0)


async def _stats_loop(line: StatsLine, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            line.log()
        except Exception:  # noqa: BLE001 -- a bad snapshot must not end the line for good
            stats_logger.exception("the stats line failed")
