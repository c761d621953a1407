"""Per HTTP handler: the latest output of each of its engine requests, coalesced.

Outputs are cumulative, so a newer one says everything an older unread one did: the collector
holds the *latest* output of each request, not a backlog, and a client that reads slowly costs
one output per request however far behind it is (a queue of every step's output would hold
O(n^2) token ids for n tokens). To let a late reader still send one chunk per engine step, the
collector notes, per step, how far each sequence's tokens and text had got (a few integers, no
token lists). A failure or a finished output is never replaced or dropped.
"""
from __future__ import annotations

import asyncio
import threading
import time
from array import array
from dataclasses import dataclass


@dataclass
class RequestFailed:
    """Handed to a collector instead of an output when its request cannot go on."""
    request_id: str
    error: BaseException


class _Slot:
    """What one request has waiting for its reader."""
    __slots__ = ("output", "steps", "failure", "unread_since")

    def __init__(self):
        self.output = None              # the latest unread RequestOutput
        self.unread_since = 0.0         # time.monotonic() when the oldest unread output came
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
                if slot.output is None:
                    slot.unread_since = time.monotonic()
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

    def unread_for(self, request_id: str) -> float:
        """Seconds the oldest unread output of `request_id` has waited for its reader (0 when
        the reader is up to date): how far a client that stopped reading has fallen behind."""
        with self._lock:
            slot = self._slots.get(request_id)
            if slot is None or slot.output is None:
                return 0.0
            return time.monotonic() - slot.unread_since

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
