"""The server side of the engine: one thread runs the step loop for every HTTP client.

The engine is single-threaded and not thread-safe, so exactly one thread (the *engine loop*)
ever touches it. HTTP handlers, on the asyncio event loop, never call the engine: they put
`add` and `abort` operations on a queue and wake the loop thread. Between steps the loop thread
applies the queued operations, then runs one `engine.step()` over *everything* in flight -- all
clients' requests share each forward pass (continuous batching across clients) -- and hands each
`RequestOutput` to its handler's `RequestOutputCollector`. When nothing is in flight the thread
sleeps on an event; when requests are in flight but nothing could be scheduled it backs off
(1 ms doubling to 50 ms), and any add or abort wakes it at once.

The collector holds the *latest* output of each request, not a backlog: outputs are cumulative,
so a newer one says everything an older unread one did, and a client that reads slowly costs one
output per request however far behind it is (a queue of every step's output would hold O(n^2)
token ids for n tokens). To let a late reader still send one chunk per engine step, the collector
notes, per step, how far each sequence's tokens and text had got (a few integers, no token lists).
A failure or a finished output is never replaced or dropped.

A handler learns whether its request was accepted (the engine's `ValueError`s become HTTP 400)
before it sends a status line, by awaiting the future its `add` operation resolves. That future
always resolves: the liveness check and the queueing happen under the lock that the loop
thread's exit path takes to stop accepting and drain the queue, so an add is either refused at
once (503) or drained and answered. A handler that stops listening (client disconnect,
cancellation) queues an `abort`; the engine frees the request's KV blocks at the next loop
iteration, before the next step.

If `engine.step()` ever raises, the engine state can no longer be trusted: every in-flight
request fails with that error, `/health` turns 500, and new requests are refused with 503.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass

from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import APIError

logger = logging.getLogger("kvserve.server")

# The loop's back-off while requests are in flight but no step can make progress.
BACKOFF_MIN_S = 0.001
BACKOFF_MAX_S = 0.05


@dataclass
class RequestFailed:
    """Handed to a collector instead of an output when its request cannot go on."""
    request_id: str
    error: BaseException


class _Slot:
    """What one request has waiting for its reader."""
    __slots__ = ("output", "steps", "failure")

    def __init__(self):
        self.output = None              # the latest unread RequestOutput
        self.steps = array("q")         # (index, num tokens, text length, finished) per change
        self.failure: RequestFailed | None = None


class RequestOutputCollector:
    """The outputs of one handler's engine requests, coalesced: the latest output per request.

    `put` may be called from any thread (the engine loop calls it); `get` is awaited on the
    event loop the collector was made on. Several engine requests may share a collector (one
    HTTP request with several prompts); they are coalesced separately and read in turn.

    Rules, per request id: an unread output is replaced by the next one (they are cumulative);
    a finished output or a `RequestFailed` is terminal: nothing replaces it and later puts are
    ignored; a failure arriving while an output is unread is read after that output.

    Alongside the latest output the collector keeps the *steps* it stands for: for every put
    in which a sequence changed, `(index, len(token_ids), len(text), finished)` of that
    sequence at that time. A reader that sends one chunk per step can then send from the
    latest output exactly the chunks it would have sent reading every output, at the cost of
    four integers per sequence per step instead of a copy of the output.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}                       # ready to read, oldest first
        self._seen: dict[str, dict[int, tuple[int, int, bool]]] = {}  # per request: last step noted
        self._closed: set[str] = set()                           # requests with a terminal item
        self._event = asyncio.Event()
        self._wake_scheduled = False

    # -- producer side (any thread) ----------------------------------------------------------
    def put(self, item) -> None:
        rid = item.request_id
        with self._lock:
            if rid in self._closed:
                return
            slot = self._slots.get(rid)
            if slot is None:
                slot = self._slots[rid] = _Slot()
            if isinstance(item, RequestFailed):
                slot.failure = item
                self._closed.add(rid)
                self._seen.pop(rid, None)
            else:
                self._note_steps(rid, item, slot.steps)
                slot.output = item
                if item.finished:
                    self._closed.add(rid)
                    self._seen.pop(rid, None)
            wake = not self._wake_scheduled
            self._wake_scheduled = True
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:
                pass        # that event loop is closed: nobody is listening any more

    def _note_steps(self, rid: str, out, steps: array) -> None:
        seen = self._seen.setdefault(rid, {})
        for c in out.outputs:
            n, t, fin = len(c.token_ids), len(c.text), c.finish_reason is not None
            n0, t0, fin0 = seen.get(c.index, (0, 0, False))
            if fin0 or (n <= n0 and t <= t0 and not fin):
                continue
            seen[c.index] = (n, t, fin)
            steps.extend((c.index, n, t, int(fin)))

    # -- consumer side (the collector's event loop) ----------------------------------------
    def get_nowait(self):
        """(item, steps) for the oldest waiting request, or None when nothing waits. `steps`
        are `(index, num_tokens, text_len, finished)` tuples, empty for a failure."""
        with self._lock:
            for rid, slot in self._slots.items():
                break
            else:
                return None
            if slot.output is not None:
                out, flat = slot.output, slot.steps
                slot.output, slot.steps = None, array("q")
                if slot.failure is None:
                    del self._slots[rid]
                steps = [tuple(flat[i:i + 4]) for i in range(0, len(flat), 4)]
                return out, steps
            del self._slots[rid]
            return slot.failure, []

    async def get_with_steps(self):
        """Wait for the next (item, steps); see `get_nowait`."""
        while True:
            got = self.get_nowait()
            if got is not None:
                return got
            with self._lock:
                if self._slots:
                    continue
                self._wake_scheduled = False
                self._event.clear()
            await self._event.wait()

    async def get(self):
        """Wait for the next item: the latest `RequestOutput` of a request, or a
        `RequestFailed`."""
        return (await self.get_with_steps())[0]

    @property
    def num_held_outputs(self) -> int:
        """RequestOutputs held unread (at most one per request)."""
        with self._lock:
            return sum(s.output is not None for s in self._slots.values())

    @property
    def num_held_steps(self) -> int:
        with self._lock:
            return sum(len(s.steps) // 4 for s in self._slots.values())

    def empty(self) -> bool:
        with self._lock:
            return not self._slots


class AsyncEngine:
    def __init__(self, engine, metrics: ServerMetrics, max_waiting: int | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._ops: deque = deque()
        self._ops_lock = threading.Lock()
        self._wake = threading.Event()
        self._running = False
        self._accepting = False             # adds may be queued (under _ops_lock)
        self._thread: threading.Thread | None = None
        # request id -> (collector, number of sequences); touched by the loop thread only
        self._streams: dict[str, tuple[RequestOutputCollector, int]] = {}
        self._pending_adds = 0              # adds queued but not yet applied (under _ops_lock)
        self.dead: BaseException | None = None
        self.last_stats = engine.stats()
        self.num_steps = 0
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

    def _refusal(self) -> APIError:
        if self.dead is not None:
            return APIError(f"the engine has failed and is not serving: {self.dead!r}",
                            status_code=503, type="server_error", code="engine_dead")
        return APIError("the server is shutting down", status_code=503, type="server_error",
                        code="shutting_down")

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

    def _apply_op(self, op) -> None:
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
            error = APIError(str(e))
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
            self.metrics.observe_finished(out)
        if entry is not None:
            entry[0].put(out)

    def _snapshot(self) -> None:
        self.last_stats = self.engine.stats()
        self.metrics.update_stats(self.last_stats)

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
