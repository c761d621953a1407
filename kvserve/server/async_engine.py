"""The server side of the engine: one thread runs the step loop for every HTTP client.

The engine is single-threaded and not thread-safe, so exactly one thread (the *engine loop*)
ever touches it. HTTP handlers, on the asyncio event loop, never call the engine: they put
`add` and `abort` operations on a queue and wake the loop thread. Between steps the loop thread
applies the queued operations, then runs one `engine.step()` over *everything* in flight -- all
clients' requests share each forward pass (continuous batching across clients) -- and hands each
`RequestOutput` back to its handler through that handler's `asyncio.Queue`
(`loop.call_soon_threadsafe`). When nothing is in flight the thread sleeps on an event.

A handler learns whether its request was accepted (the engine's `ValueError`s become HTTP 400)
before it sends a status line, by awaiting the future its `add` operation resolves. A handler
that stops listening (client disconnect, cancellation) queues an `abort`; the engine frees the
request's KV blocks at the next loop iteration, before the next step.

If `engine.step()` ever raises, the engine state can no longer be trusted: every in-flight
request fails with that error, `/health` turns 500, and new requests are refused with 503.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import APIError

logger = logging.getLogger("kvserve.server")


@dataclass
class RequestFailed:
    """Put on a handler's queue instead of an output when its request cannot go on."""
    request_id: str
    error: BaseException


class AsyncEngine:
    def __init__(self, engine, metrics: ServerMetrics, max_waiting: int | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._ops: deque = deque()
        self._ops_lock = threading.Lock()
        self._wake = threading.Event()
        self._running = False
        self._thread: threading.Thread | None = None
        # request id -> (event loop, queue, number of sequences); touched by the loop thread only
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self._pending_adds = 0              # adds queued but not yet applied (under _ops_lock)
        self.dead: BaseException | None = None
        self.last_stats = engine.stats()
        self.num_steps = 0
        metrics.update_stats(self.last_stats)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._running = True
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
    async def add_request(self, request_id: str, prompt, params, queue: asyncio.Queue,
                          prompt_text: str | None = None) -> None:
        """Queue a request; returns once the engine accepted it, raises APIError otherwise.

        Outputs (cumulative `RequestOutput`s) and failures (`RequestFailed`) arrive on `queue`.
        """
        if self.dead is not None:
            raise APIError(f"the engine has failed and is not serving: {self.dead!r}",
                           status_code=503, type="server_error", code="engine_dead")
        if not self._running:
            raise APIError("the server is shutting down", status_code=503, type="server_error",
                           code="shutting_down")
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        with self._ops_lock:
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
            self._ops.append(("add", request_id, prompt, params, queue, loop, accepted, prompt_text,
                              time.monotonic()))
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
        try:
            while self._running:
                self._wake.clear()
                self._apply_ops()
                if engine.has_unfinished_requests():
                    steps_before = getattr(self.last_stats, "num_steps", None)
                    outputs = engine.step()
                    self.num_steps += 1
                    for out in outputs:
                        self._dispatch(out)
                    self._snapshot()
                    if not outputs and steps_before is not None and self.last_stats.num_steps == steps_before:
                        # Nothing could be scheduled (e.g. every request waits for blocks): do not
                        # spin on the GIL; an add or abort wakes us at once.
                        self._wake.wait(timeout=0.001)
                else:
                    self._wake.wait(timeout=1.0)
        except BaseException as e:  # noqa: BLE001 -- a broken engine must not hang clients
            logger.exception("engine loop failed; failing every in-flight request")
            self.dead = e
        finally:
            err = self.dead or APIError("the server is shutting down", status_code=503,
                                        type="server_error", code="shutting_down")
            self._fail_everything(err)

    def _apply_ops(self) -> None:
        with self._ops_lock:
            ops = list(self._ops)
            self._ops.clear()
        if not ops:
            return
        for op in ops:
            if op[0] == "add":
                _, rid, prompt, params, queue, loop, accepted, prompt_text, arrival = op
                with self._ops_lock:
                    self._pending_adds -= 1
                try:
                    self.engine.add_request(rid, prompt, params, arrival_time=arrival,
                                            prompt_text=prompt_text)
                except ValueError as e:
                    _resolve(loop, accepted, APIError(str(e)))
                    continue
                except Exception as e:  # noqa: BLE001 -- an engine bug is a 500 for this one request
                    logger.exception("add_request failed")
                    _resolve(loop, accepted, e)
                    continue
                self._streams[rid] = (loop, queue, getattr(params, "n", 1))
                _resolve(loop, accepted, None)
            else:
                _, rid = op
                entry = self._streams.pop(rid, None)
                self.engine.abort_request(rid)
                if entry is not None:
                    self.metrics.observe_abort(entry[2])
        self._snapshot()

    def _dispatch(self, out) -> None:
        entry = self._streams.get(out.request_id)
        if out.finished:
            self._streams.pop(out.request_id, None)
            self.metrics.observe_finished(out)
        if entry is not None:
            loop, queue, _ = entry
            _put(loop, queue, out)

    def _snapshot(self) -> None:
        self.last_stats = self.engine.stats()
        self.metrics.update_stats(self.last_stats)

    def _fail_everything(self, err: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for rid, (loop, queue, _) in streams.items():
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                pass
            _put(loop, queue, RequestFailed(rid, err))
        with self._ops_lock:
            ops = list(self._ops)
            self._ops.clear()
            self._pending_adds = 0
        for op in ops:
            if op[0] == "add":
                _resolve(op[5], op[6], err)


def _put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:
        pass        # that event loop is closed: nobody is listening any more


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
