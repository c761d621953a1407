"""The server's output collector (server/collector.py), the engine core loop's back-off
(engine/core_loop.py) and a real stories260K core's streams through CoreClient: a reader that
falls behind holds one small delta per step and gets what a fast reader gets.

The client tests and the fake core are in test_core_client.py.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

from kvserve.engine.core_io import EngineCoreRequest
from kvserve.engine.core_loop import ThreadPipe, run_core_loop
from kvserve.sample.params import SamplingParams
from kvserve.server import collector as collector_module
from kvserve.server.collector import RequestFailed, RequestOutputCollector
from kvserve.server.core_client import CoreClient
from kvserve.server.metrics import ServerMetrics
from tests.conftest import STORIES_HF

from .test_core_client import GUARD_S, FakeCore, drain, params, run, until

# ------------------------------------------------------------------ the collector


@dataclass
class Item:
    request_id: str
    finished: bool = False
    tag: int = 0


def test_collector_keeps_order_and_terminal_items(monkeypatch):
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(collector_module, "time", SimpleNamespace(monotonic=lambda: clock.now))

    async def main():
        col = RequestOutputCollector()
        assert col.unread_for("a") == 0.0 and col.empty()
        col.put(Item("a", tag=1))
        clock.now += 1
        col.put(Item("b", tag=1))
        col.put(Item("a", tag=2))
        clock.now += 2
        assert col.unread_for("a") == 3.0 and col.unread_for("b") == 2.0    # the oldest unread
        assert col.num_held_outputs == 3                                     # one item per put
        col.put(Item("a", finished=True, tag=3))                             # terminal ...
        col.put(Item("a", tag=4))
        col.put(RequestFailed("a", RuntimeError("late")))                    # ... nothing after it
        col.put(RequestFailed("b", RuntimeError("boom")))                    # terminal too
        col.put(Item("b", finished=True, tag=2))
        got = [await col.get() for _ in range(5)]
        assert [(g.request_id, getattr(g, "tag", "failed")) for g in got] == \
            [("a", 1), ("b", 1), ("a", 2), ("a", 3), ("b", "failed")]
        assert str(got[-1].error) == "boom"
        assert col.empty() and col.unread_for("a") == 0.0 and col.unread_for("b") == 0.0
    run(main())


def test_collector_get_wakes_on_a_put_from_another_thread():
    async def main():
        col = RequestOutputCollector()
        getter = asyncio.ensure_future(col.get())
        await asyncio.sleep(0)
        assert not getter.done()
        await asyncio.to_thread(col.put, Item("r", tag=7))
        assert (await asyncio.wait_for(getter, GUARD_S)).tag == 7
    run(main())


# ------------------------------------------------------------------ the loop's back-off


class StuckCore(FakeCore):
    """A core with a request in flight whose steps can never make progress."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def step(self):
        self.calls += 1
        return []


def test_loop_backs_off_when_no_step_makes_progress():
    core = StuckCore()
    inbox, outbox = ThreadPipe(), ThreadPipe()
    loop = threading.Thread(target=run_core_loop, args=(core, inbox, outbox), daemon=True)
    loop.start()
    try:
        req = EngineCoreRequest("r", [5], params(), time.monotonic())
        inbox.send(("add", req))
        assert outbox.poll(GUARD_S) and outbox.recv() == ("added", "r", None)
        start = core.calls
        time.sleep(0.3)                               # the interval steps are counted over
        assert core.calls - start < 100               # backing off (<= 50 ms): ~10; a spin: ~10^5
        assert not outbox.poll(0)                     # no step message for a step that did nothing
        inbox.send(("abort", "r"))                    # still served while stalled
        assert outbox.poll(GUARD_S) and outbox.recv()[0] == "stats"
        idle = core.calls
        time.sleep(0.05)
        assert core.calls == idle                     # idle: no step at all
    finally:
        inbox.send(("shutdown",))
        loop.join(GUARD_S)
    assert not loop.is_alive()


# ------------------------------------------------------------------ end to end, stories260K


def test_real_core_slow_and_fast_readers_get_the_same_deltas():
    """A real EngineCore on stories260K: two greedy streams of the same prompt, one read as it
    comes and one only once it finished, get the same one-token deltas; their text is that of
    a non-streamed twin."""
    from kvserve.config import EngineConfig
    from kvserve.engine.engine_core import EngineCore

    core = EngineCore(EngineConfig(model=str(STORIES_HF)))
    ids = core.tokenizer.encode("Once upon a time", add_special_tokens=True)
    n = 40
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    async def main():
        client = CoreClient.in_thread(core)
        client.bind(ServerMetrics("stories"), None)
        client.start()
        try:
            fast, slow, final = RequestOutputCollector(), RequestOutputCollector(), RequestOutputCollector()
            await client.add_request("slow", ids, p, slow, stream=True)
            await client.add_request("fast", ids, p, fast, stream=True)
            await client.add_request("final", ids, p, final)
            fast_outs = []
            while not fast_outs or not fast_outs[-1].finished:
                fast_outs.append(await asyncio.wait_for(fast.get(), GUARD_S))
            whole = await asyncio.wait_for(final.get(), GUARD_S)
            await until(lambda: slow.num_held_outputs == n, "the slow stream's deltas")
            slow_outs = drain(slow)
        finally:
            client.shutdown()
        view = [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for o in slow_outs]
        assert view == [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for o in fast_outs]
        assert all(len(o.outputs[0].token_ids) == 1 for o in slow_outs)       # one token a step
        assert "".join(o.outputs[0].text for o in slow_outs) == whole.outputs[0].text
        assert whole.finished and len(whole.outputs[0].token_ids) == n
    run(main())
