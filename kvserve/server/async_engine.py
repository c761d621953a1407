"""The server side of the engine: the front that HTTP handlers talk to, in two layouts.

Handlers, on the asyncio event loop, never call the engine. They `add_request` (which returns
once the engine accepted the request, or raises the APIError to send: a 400 for what the
engine's `add_request` rejects, a 503 when overloaded, shutting down or dead) and `abort`;
outputs come back to each handler's `RequestOutputCollector` (server/collector.py), failures as
`RequestFailed`. `EngineFrontend` holds what both layouts share: admission (`--max-waiting`),
the dead flag behind `/health`, metrics, and failing everything in flight when the engine goes.

- `AsyncEngine` (this module): the engine in a thread of the server process. One thread, the
  *engine loop*, is the only one that touches the (not thread-safe) engine: between steps it
  applies the queued adds and aborts, then runs one `engine.step()` over everything in flight
  and hands each output to its collector. Idle, it sleeps on an event; when requests are in
  flight but nothing could be scheduled it backs off (1 ms doubling to 50 ms), and any add or
  abort wakes it at once.
- `ProcessEngine` (server/engine_client.py): the engine in its own process
  (server/engine_core.py), vLLM v1's EngineCore layout, the default of `kvserve serve`.

If the engine ever fails as a whole, every in-flight request fails with that error, `/health`
turns 500, and new requests are refused with 503.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

from kvserve.server.collector import RequestFailed, RequestOutputCollector  # noqa: F401 (re-export)
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import ENGINE_REJECTED, APIError

logger = logging.getLogger("kvserve.server")

# The loop's back-off while requests are in flight but no step can make progress.
BACKOFF_MIN_S = 0.001
BACKOFF_MAX_S = 0.05


class EngineFrontend:
    """Admission, liveness and metrics, shared by both layouts. `config` and `tokenizer` are
    the engine's (the resolved EngineConfig, with its max_model_len)."""

    config = None
    tokenizer = None

    def __init__(self, metrics: ServerMetrics | None = None, max_waiting: int | None = None):
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._ops_lock = threading.Lock()
        self._running = False
        self._accepting = False             # adds may be queued (under _ops_lock)
        self._pending_adds = 0              # adds sent but not yet applied (under _ops_lock)
        self.dead: BaseException | None = None
        self.last_stats = None
        self.num_steps = 0
        self.stall_timeout: float | None = None     # see _deliver

    def bind(self, metrics: ServerMetrics, max_waiting: int | None,
             stall_timeout: float | None = None) -> None:
        """Report to `metrics`, refuse adds beyond `max_waiting` waiting requests, abort
        requests whose reader fell `stall_timeout` s behind."""
        self.metrics, self.max_waiting, self.stall_timeout = metrics, max_waiting, stall_timeout
        if self.last_stats is not None:
            metrics.update_stats(self.last_stats)

    def _refusal(self) -> APIError:
        if self.dead is not None:
            return APIError("the engine has failed and is not serving; see the server log",
                            status_code=503, type="server_error", code="engine_dead")
        return APIError("the server is shutting down", status_code=503, type="server_error",
                        code="shutting_down")

    def _admit(self) -> None:
        """Count one more add in flight, or raise the 503 to send. Call under `_ops_lock`."""
        if not (self._accepting and self._running):
            raise self._refusal()
        if self.max_waiting is not None:
            waiting = self.last_stats.num_waiting + self._pending_adds
            if waiting >= self.max_waiting:
                self.metrics.reject("overloaded")
                raise APIError(
                    f"the server is overloaded: {waiting} requests are already waiting "
                    f"(--max-waiting {self.max_waiting}); retry later",
                    status_code=503, type="server_error", code="server_overloaded",
                    headers={"Retry-After": "1"})
        self._pending_adds += 1

    def fail_in_flight(self, err: APIError) -> None:
        raise NotImplementedError

    def _set_stats(self, stats) -> None:
        self.last_stats = stats
        self.metrics.update_stats(stats)

    def _deliver(self, collector: RequestOutputCollector, out) -> bool:
        """Hand `out` to its reader; False (and a failure instead) when the reader has left an
        output unread for more than `stall_timeout` s: a client that stopped reading its stream
        must not hold a seat and KV blocks for ever. The caller then aborts the request."""
        if out.finished:
            self.metrics.observe_finished(out)
        elif self.stall_timeout is not None and collector.unread_for(out.request_id) > self.stall_timeout:
            logger.warning("request %s: its client has read nothing for over %.0f s; aborting it",
                           out.request_id, self.stall_timeout)
            self.metrics.observe_abort(len(out.outputs) or 1)
            collector.put(RequestFailed(out.request_id, APIError(
                f"aborted: the client read nothing for over {self.stall_timeout:.0f} s "
                "(--stream-stall-timeout)", status_code=408, type="server_error", code="client_too_slow")))
            return False
        collector.put(out)
        return True


class AsyncEngine(EngineFrontend):
    """The engine loop in a thread of the server process (see the module docstring)."""

    def __init__(self, engine, metrics: ServerMetrics | None = None, max_waiting: int | None = None):
        super().__init__(metrics, max_waiting)
        self.engine = engine
        self.config = getattr(engine, "config", None)
        self.tokenizer = getattr(engine, "tokenizer", None)
        self._ops: deque = deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # request id -> (collector, number of sequences); touched by the loop thread only
        self._streams: dict[str, tuple[RequestOutputCollector, int]] = {}
        self.last_stats = engine.stats()
        if metrics is not None:
            metrics.update_stats(self.last_stats)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        with self._ops_lock:
            self._running = True
            self._accepting = self.dead is None
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; requests still in flight fail with 'server shutting down'."""
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # -- the handler side (event loop) ------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params, collector: RequestOutputCollector,
                          prompt_text: str | None = None) -> None:
        """Queue a request; returns once the engine accepted it, raises APIError otherwise.

        Outputs (cumulative `RequestOutput`s) and failures (`RequestFailed`) go to `collector`.
        """
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        with self._ops_lock:
            # Checked under the lock the loop thread's exit path holds while it stops accepting
            # and drains the queue: once queued, an add is applied or failed, never forgotten.
            self._admit()
            self._ops.append(("add", request_id, prompt, params, collector, loop, accepted,
                              prompt_text, time.monotonic()))
        self._wake.set()
        await accepted

    def abort(self, request_id: str) -> None:
        """Abort a request (safe from any thread, for any id, any number of times)."""
        with self._ops_lock:
            self._ops.append(("abort", request_id))
        self._wake.set()

    # -- the engine side (loop thread) ------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        backoff = 0.0
        try:
            while self._running:
                self._wake.clear()
                if self._apply_ops():
                    backoff = 0.0           # something changed: try a step right away
                if engine.has_unfinished_requests():
                    steps_before = getattr(self.last_stats, "num_steps", None)
                    outputs = engine.step()
                    self.num_steps += 1
                    for out in outputs:
                        self._dispatch(out)
                    self._snapshot()
                    stepped = (steps_before is not None
                               and getattr(self.last_stats, "num_steps", None) != steps_before)
                    if outputs or stepped:
                        backoff = 0.0
                    else:
                        # Nothing could be scheduled (e.g. every request waits for blocks).
                        # Neither spin on the GIL nor sleep unboundedly: wait a little longer
                        # each time, up to BACKOFF_MAX_S; an add or abort wakes us at once.
                        backoff = min(max(2 * backoff, BACKOFF_MIN_S), BACKOFF_MAX_S)
                        self._wake.wait(timeout=backoff)
                else:
                    backoff = 0.0
                    self._wake.wait(timeout=1.0)
        except BaseException as e:  # noqa: BLE001 -- a broken engine must not hang clients
            logger.exception("engine loop failed; failing every in-flight request")
            self.dead = e
        finally:
            err = self.dead or APIError("the server is shutting down", status_code=503,
                                        type="server_error", code="shutting_down")
            self._fail_everything(err)

    def _apply_ops(self) -> bool:
        """Apply the queued adds and aborts; True when there were any."""
        with self._ops_lock:
            ops = list(self._ops)
            self._ops.clear()
        if not ops:
            return False
        for i, op in enumerate(ops):
            try:
                self._apply_op(op)
            except BaseException:
                # The loop dies; put what was not applied back, for _fail_everything to answer.
                with self._ops_lock:
                    self._ops.extendleft(reversed(ops[i:]))
                raise
        self._snapshot()
        return True

    def fail_in_flight(self, err: APIError) -> None:
        """Refuse new requests, and fail and abort every request in flight with `err` (the
        shutdown deadline: their handlers answer with it instead of being cut off)."""
        with self._ops_lock:
            self._accepting = False
            self._ops.append(("fail", err))
        self._wake.set()

    def _apply_op(self, op) -> None:
        if op[0] == "fail":
            streams, self._streams = self._streams, {}
            for rid, (collector, _) in streams.items():
                self.engine.abort_request(rid)
                collector.put(RequestFailed(rid, op[1]))
            return
        if op[0] == "abort":
            _, rid = op
            entry = self._streams.pop(rid, None)
            self.engine.abort_request(rid)
            if entry is not None:
                self.metrics.observe_abort(entry[1])
            return
        _, rid, prompt, params, collector, loop, accepted, prompt_text, arrival = op
        try:
            self.engine.add_request(rid, prompt, params, arrival_time=arrival,
                                    prompt_text=prompt_text)
        except ValueError as e:
            error = APIError(str(e), code=ENGINE_REJECTED)
        except Exception as e:  # noqa: BLE001 -- an engine bug is a 500 for this one request
            logger.exception("add_request failed")
            error = e
        else:
            error = None
            self._streams[rid] = (collector, getattr(params, "n", 1))
        with self._ops_lock:
            self._pending_adds -= 1
        _resolve(loop, accepted, error)

    def _dispatch(self, out) -> None:
        entry = self._streams.get(out.request_id)
        if out.finished:
            self._streams.pop(out.request_id, None)
        if entry is None:
            if out.finished:
                self.metrics.observe_finished(out)
        elif not self._deliver(entry[0], out):
            del self._streams[out.request_id]
            self.engine.abort_request(out.request_id)

    def _snapshot(self) -> None:
        self._set_stats(self.engine.stats())

    def _fail_everything(self, err: BaseException) -> None:
        with self._ops_lock:
            self._accepting = False     # from here on add_request refuses up front
            ops = list(self._ops)
            self._ops.clear()
            self._pending_adds = 0
        refusal = self._refusal()
        for op in ops:
            if op[0] == "add":
                _resolve(op[5], op[6], refusal)
        streams, self._streams = self._streams, {}
        for rid, (collector, _) in streams.items():
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                pass
            collector.put(RequestFailed(rid, err))


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, error: BaseException | None) -> None:
    def set_it():
        if fut.done():
            return          # the handler was cancelled meanwhile; its abort is queued behind us
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)
    try:
        loop.call_soon_threadsafe(set_it)
    except RuntimeError:
        pass
