"""Per HTTP handler: the outputs of its engine requests, in the order they came.

A stream's outputs are deltas (frontend/output_processor.py, output kind "delta": each holds
only what one engine step added), so a reader gets one item per step and sends one chunk per
step however late it reads; a non-streaming request gets one item, its final output. A reader
that falls behind holds a backlog of small deltas, bounded by the server's
--stream-stall-timeout (the request is aborted when its oldest unread item is older). A
failure or a finished output is terminal: later puts for that request are ignored.
"""
from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass
class RequestFailed:
    """Handed to a collector instead of an output when its request cannot go on."""
    request_id: str
    error: BaseException


class RequestOutputCollector:
    """`put` may be called from any thread; `get` is awaited on the event loop the collector
    was made on. Several engine requests (one HTTP request with several prompts) may share it."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._items: deque = deque()
        self._put_times: dict[str, deque] = {}   # request id -> when each unread item came
        self._closed: set[str] = set()           # requests with a terminal item
        self._event = asyncio.Event()
        self._wake_scheduled = False
        # The handler's context (its tenant and `user`), for the request log (server/request_log.py).
        self.context = contextvars.copy_context()

    # -- producer side (any thread) ----------------------------------------------------------
    def put(self, item) -> None:
        rid = item.request_id
        with self._lock:
            if rid in self._closed:
                return
            if isinstance(item, RequestFailed) or item.finished:
                self._closed.add(rid)
            self._items.append(item)
            self._put_times.setdefault(rid, deque()).append(time.monotonic())
            wake = not self._wake_scheduled
            self._wake_scheduled = True
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:
                pass        # that event loop is closed: nobody is listening any more

    def unread_for(self, request_id: str) -> float:
        """Seconds the oldest unread item of `request_id` has waited for its reader (0 when
        the reader is up to date): how far a client that stopped reading has fallen behind."""
        with self._lock:
            times = self._put_times.get(request_id)
            return time.monotonic() - times[0] if times else 0.0

    # -- consumer side (the collector's event loop) ----------------------------------------
    def get_nowait(self):
        """The oldest item (a RequestOutput or a RequestFailed), or None when nothing waits."""
        with self._lock:
            if not self._items:
                return None
            item = self._items.popleft()
            times = self._put_times[item.request_id]
            times.popleft()
            if not times:
                del self._put_times[item.request_id]
            return item

    async def get(self):
        while True:
            item = self.get_nowait()
            if item is not None:
                return item
            with self._lock:
                if self._items:
                    continue
                self._wake_scheduled = False
                self._event.clear()
            await self._event.wait()

    @property
    def num_held_outputs(self) -> int:
        with self._lock:
            return len(self._items)

    def empty(self) -> bool:
        with self._lock:
            return not self._items
