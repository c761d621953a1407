"""CoreClient (server/core_client.py) over the real core loop (engine/core_loop.py) in a
thread, driven by a small fake engine core (deterministic, the EngineCore surface only):
admission and --max-waiting, aborts at any point, the stall timeout, stop strings aborting their
sequence in the core, the core's death and shutdown. (The collector, the loop's back-off and a
real core's streams: test_core_loop.py.)

The fake core can be gated: each `step` waits for a permit the test hands out, so a test knows
which step the core is in when it adds, aborts, fails or shuts down. No test waits on a timer for
ordering: `until` polls a condition, and its bound only turns a hang into a failure.
"""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from kvserve.engine.core_io import CoreLimits, EngineCoreOutput, EngineCoreRequest, SequenceDelta
from kvserve.engine.stats import EngineStats
from kvserve.sample.params import SamplingParams
from kvserve.server.collector import RequestFailed, RequestOutputCollector
from kvserve.server.core_client import CoreClient, EngineDeadError
from kvserve.server.metrics import ServerMetrics
from kvserve.server.openai.protocol import APIError
from tests.conftest import STORIES_HF

GUARD_S = 10.0      # only ever reached when something hangs


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, GUARD_S * 3))


async def until(cond, what: str, timeout: float = GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


# ------------------------------------------------------------------ the fake core


class FakeCore:
    """The EngineCore surface: each step gives each sequence of the first `seats` requests one
    more token (sample i's tokens are scripts[i], else 300, 301, ...) until max_tokens; the rest
    wait. `log` records what reached the core, in its order."""

    def __init__(self, tokenizer=None, gated: bool = False, seats: int | None = None, scripts=None):
        self.config = SimpleNamespace(model=SimpleNamespace(model="fake"),    # Config.model.model
                                      cache=SimpleNamespace(block_size=16, kv_cache_dtype="auto",    # Config.cache
                                                            enable_prefix_caching=True, prefix_cache_kind="hash",
                                                            swap_space=0, gpu_memory_utilization=0.9))
        self.tokenizer = tokenizer
        self.limits = CoreLimits(vocab_size=512, max_model_len=256, max_num_seqs=8, num_kv_blocks=64,
                                 block_size=16, watermark_blocks=0, eos_token_id=2)
        self.reqs: dict[str, tuple[EngineCoreRequest, list[dict]]] = {}
        self.log: list[tuple] = []
        self.num_steps = 0
        self.seats, self.scripts = seats, scripts or {}
        self.permits = threading.Semaphore(0) if gated else None
        self.fail_at_step: int | None = None

    def allow(self, k: int = 1) -> None:
        self.permits.release(k)

    def open(self) -> None:
        permits, self.permits = self.permits, None
        if permits is not None:
            permits.release()

    def add_request(self, req: EngineCoreRequest) -> None:
        self.log.append(("add", req.request_id))
        if req.prompt_token_ids == [13]:
            raise RuntimeError("the core cannot take prompt [13]")
        self.reqs[req.request_id] = (req, [{"made": 0, "finish": None, "sent": False}
                                           for _ in range(req.params.n)])

    def abort_request(self, rid) -> None:
        self.log.append(("abort", rid))
        self.reqs.pop(rid, None)

    def abort_sequence(self, rid, index) -> None:
        self.log.append(("abort_seq", rid, index))
        if rid in self.reqs:
            seqs = self.reqs[rid][1]
            seqs[index]["finish"] = seqs[index]["finish"] or "abort"
            if all(s["finish"] for s in seqs):
                del self.reqs[rid]

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[EngineCoreOutput]:
        permits = self.permits
        if permits is not None and not permits.acquire(timeout=GUARD_S):
            raise TimeoutError("the test handed out no step permit (hang guard)")
        if self.fail_at_step == self.num_steps:
            raise RuntimeError("injected fault")
        self.num_steps += 1
        outs = []
        for rid, (req, seqs) in list(self.reqs.items())[:self.seats]:
            deltas = []
            for i, s in enumerate(seqs):
                if s["finish"] is None:
                    script = self.scripts.get(i)
                    tok = script[s["made"]] if script else 300 + s["made"]
                    s["made"] += 1
                    if s["made"] == req.params.max_tokens or (script and s["made"] == len(script)):
                        s["finish"] = "length"
                    deltas.append(SequenceDelta(i, [tok]))
                elif not s["sent"]:
                    deltas.append(SequenceDelta(i))
                if s["finish"] is not None and not s["sent"]:
                    s["sent"] = True
                    deltas[-1].finish_reason = s["finish"]
            done = all(s["finish"] for s in seqs)
            outs.append(EngineCoreOutput(rid, deltas, done, time.monotonic()))
            if done:
                del self.reqs[rid]
        return outs

    def stats(self) -> EngineStats:
        waiting = max(0, len(self.reqs) - self.seats) if self.seats is not None else 0
        return EngineStats(num_running=len(self.reqs) - waiting, num_waiting=waiting, kv_cache_usage=0.0,
                           num_free_blocks=64, num_total_blocks=64, num_preemptions_total=0,
                           prompt_tokens_total=0, generation_tokens_total=0, num_steps=self.num_steps)


def started(core, max_waiting=None, stall_timeout=None) -> CoreClient:
    client = CoreClient.in_thread(core)
    client.bind(ServerMetrics("fake"), max_waiting, stall_timeout)
    client.start()
    return client


def stop(client: CoreClient, core: FakeCore) -> None:
    core.open()
    client.shutdown()
    assert not client._core_thread.is_alive()


def counted(client: CoreClient, metric: str, **labels) -> float:
    name = {"success": "kvserve:request_success_total", "rejected": "kvserve:http_requests_rejected_total"}
    return client.metrics.registry.get_sample_value(name[metric], {"model_name": "fake", **labels}) or 0.0


def drain(col: RequestOutputCollector) -> list:
    items = []
    while (item := col.get_nowait()) is not None:
        items.append(item)
    return items


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 10_000, **kw})


# ------------------------------------------------------------------ admission and aborts


def test_admission_refuses_beyond_max_waiting_and_maps_errors():
    core = FakeCore(gated=True, seats=0)          # nothing ever runs: every request waits

    async def main():
        client = started(core, max_waiting=2)
        try:
            with pytest.raises(APIError) as ei:       # the frontend's checks: a 400, nothing sent
                await client.add_request("bad", [9999], params(), RequestOutputCollector())
            assert ei.value.status_code == 400 and "outside the vocabulary" in ei.value.message
            with pytest.raises(RuntimeError, match="cannot take prompt"):   # the core's: this one only
                await client.add_request("odd", [13], params(), RequestOutputCollector())
            # two adds in flight at once count as waiting before the core has seen them
            client.max_waiting = 1
            results = await asyncio.gather(
                *(client.add_request(r, [5], params(), RequestOutputCollector()) for r in ("p", "q")),
                return_exceptions=True)
            assert results[0] is None and isinstance(results[1], APIError)
            assert results[1].status_code == 503 and results[1].code == "server_overloaded"
            client.max_waiting = 2                    # p is in the core, in its (blocked) step 1
            add_r = asyncio.ensure_future(client.add_request("r", [5], params(), RequestOutputCollector()))
            await asyncio.sleep(0)
            core.allow(2)                             # steps that run nothing; r comes in between
            await add_r
            await until(lambda: client.last_stats.num_waiting == 2, "the step's stats")
            with pytest.raises(APIError) as ei:
                await client.add_request("s", [5], params(), RequestOutputCollector())
            assert ei.value.status_code == 503 and ei.value.code == "server_overloaded"
            assert ei.value.headers == {"Retry-After": "1"}
            assert counted(client, "rejected", reason="overloaded") == 2
            client.abort("p")
            core.allow(2)                             # the abort is applied after the blocked step
            await until(lambda: client.last_stats.num_waiting == 1, "the abort's stats")
            add_s = asyncio.ensure_future(client.add_request("s", [5], params(), RequestOutputCollector()))
            await asyncio.sleep(0)
            core.allow()
            await add_s
            assert [e for e in core.log if e[0] == "add"] == \
                [("add", "odd"), ("add", "p"), ("add", "r"), ("add", "s")]
        finally:
            stop(client, core)
    run(main())


def test_abort_before_added_and_after_a_cancelled_add():
    core = FakeCore()

    async def main():
        client = started(core)
        try:
            col = RequestOutputCollector()
            add = asyncio.ensure_future(client.add_request("r", [5], params(), col))
            await asyncio.sleep(0)                    # the add is sent; "added" not yet read
            client.abort("r")
            with pytest.raises(RuntimeError, match="aborted before it was accepted"):
                await add
            add = asyncio.ensure_future(client.add_request("c", [5], params(), col))
            await asyncio.sleep(0)
            add.cancel()                              # the handler went away (Submission aborts)
            client.abort("c")
            await until(lambda: ("abort", "c") in core.log, "the abort of c")
            await until(lambda: not client._pending, "c's 'added'")
            assert core.log == [("add", "r"), ("abort", "r"), ("add", "c"), ("abort", "c")]
            assert not core.reqs and not client._aborted_pending and not client.output.requests
            assert col.empty() and add.cancelled()
        finally:
            stop(client, core)
    run(main())


def test_abort_mid_stream_frees_everything_once():
    core = FakeCore(gated=True)

    async def main():
        client = started(core)
        try:
            col = RequestOutputCollector()
            await client.add_request("r", [5, 6], params(n=2), col, stream=True)
            core.allow(2)
            await until(lambda: client.num_steps == 2, "two steps")
            client.abort("r")
            client.abort("r")                         # again, and an unknown id: nothing sent
            client.abort("nobody")
            core.allow()
            await until(lambda: not core.reqs, "the core's abort")
            await client.add_request("marker", [5], params(max_tokens=1), RequestOutputCollector())
            assert core.log == [("add", "r"), ("abort", "r"), ("add", "marker")]
            deltas = drain(col)
            assert [[c.token_ids for c in d.outputs] for d in deltas] == [[[300], [300]], [[301], [301]]]
            assert counted(client, "success", finished_reason="abort") == 2
            assert "r" not in client._streams and "r" not in client.output.requests
        finally:
            stop(client, core)
    run(main())


def test_a_reader_that_stops_reading_is_aborted_after_the_stall_timeout():
    """Both samples count as aborted, also the one that finished before the stall."""
    core = FakeCore(gated=True, scripts={1: [7]})

    async def main():
        client = started(core, stall_timeout=0.05)
        try:
            col = RequestOutputCollector()
            await client.add_request("r", [5], params(n=2), col, stream=True)
            core.allow()
            first = await asyncio.wait_for(col.get(), GUARD_S)     # read once, then never again
            core.allow()
            await until(lambda: client.num_steps == 2, "step 2")
            await until(lambda: col.unread_for("r") > 0.05, "the stall")
            core.allow()                              # step 3 finds the stall ...
            await until(lambda: "r" not in client._streams, "the client's abort")
            core.allow()                              # ... and the abort is applied after step 4
            await until(lambda: ("abort", "r") in core.log and not core.reqs, "the core's abort")
            unread, failure = drain(col)
            assert [[c.token_ids for c in o.outputs] for o in (first, unread)] == [[[300], [7]], [[301]]]
            assert isinstance(failure, RequestFailed) and failure.error.status_code == 408
            assert failure.error.code == "client_too_slow"
            assert counted(client, "success", finished_reason="abort") == 2
        finally:
            stop(client, core)
    run(main())


def test_stop_string_found_by_the_frontend_aborts_its_sequence_in_the_core():
    from kvserve.model.tokenizers.tokenizer import HFTokenizer

    tok = HFTokenizer(STORIES_HF)
    once = tok.encode("Once upon a time, there was a girl.", add_special_tokens=False)
    dog = tok.encode("The dog ran far away.", add_special_tokens=False)
    core = FakeCore(tokenizer=tok, gated=True, scripts={0: once, 1: dog})

    async def main():
        client = started(core)
        try:
            col = RequestOutputCollector()
            await client.add_request("r", [1], params(n=2, stop="upon"), col, stream=True)
            while core.reqs:                          # one step at a time, each answered
                core.allow()
                steps = core.num_steps + 1
                await until(lambda: client.num_steps == steps, f"step {steps}")
            outs = drain(col)
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            assert ("abort_seq", "r", 0) in core.log and ("abort_seq", "r", 1) not in core.log
            text = {i: "".join(c.text for o in outs for c in o.outputs if c.index == i) for i in (0, 1)}
            ids = {i: [t for o in outs for c in o.outputs if c.index == i for t in c.token_ids] for i in (0, 1)}
            assert text == {0: "Once ", 1: "The dog ran far away."}
            assert ids == {0: once[:2], 1: dog}     # what the core made after the stop: discarded
            ends = {c.index: (c.finish_reason, c.stop_reason) for o in outs for c in o.outputs if c.finish_reason}
            assert ends == {0: ("stop", "upon"), 1: ("length", None)}
            assert counted(client, "success", finished_reason="stop") == 1
        finally:
            stop(client, core)
    run(main())


# ------------------------------------------------------------------ the core's death, shutdown


def test_core_dying_mid_step_fails_every_request_and_refuses_new_ones():
    core = FakeCore(gated=True)

    async def main():
        client = started(core)
        try:
            col = RequestOutputCollector()
            await client.add_request("r", [5], params(), col, stream=True)
            core.allow()
            await until(lambda: client.num_steps == 1, "step 1")
            late = asyncio.ensure_future(client.add_request("late", [5], params(), col))
            await asyncio.sleep(0)                    # sent while the core is in step 2
            core.fail_at_step = 1
            core.allow()
            with pytest.raises(APIError) as ei:
                await asyncio.wait_for(late, GUARD_S)
            assert ei.value.status_code == 503 and ei.value.code == "engine_dead"
            delta, failure = drain(col)
            assert delta.outputs[0].token_ids == [300]
            assert isinstance(failure, RequestFailed) and isinstance(failure.error, EngineDeadError)
            assert "injected fault" in str(failure.error) and "injected fault" in str(client.dead)
            with pytest.raises(APIError) as ei:
                await client.add_request("new", [5], params(), col)
            assert ei.value.status_code == 503 and ei.value.code == "engine_dead"
            assert "the engine has failed" in ei.value.message and "injected" not in ei.value.message
            assert core.log == [("add", "r")]
        finally:
            stop(client, core)
    run(main())


@pytest.mark.parametrize("how", ["shutdown", "fail_in_flight"])
def test_shutdown_fails_what_is_in_flight_with_503(how):
    """Both a stream and an add the core has not answered yet fail with the 503; an add the
    core takes meanwhile is aborted there, not run for nobody."""
    core = FakeCore(gated=True)
    errors = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        client = started(core)
        col = RequestOutputCollector()
        await client.add_request("r", [5], params(), col, stream=True)
        core.allow()
        await until(lambda: client.num_steps == 1, "step 1")
        pending = asyncio.ensure_future(client.add_request("p", [5], params(max_tokens=10**9), col,
                                                           stream=True))
        await asyncio.sleep(0)                        # sent while the core is in step 2
        if how == "shutdown":
            core.open()
            client.shutdown()
            assert not client._core_thread.is_alive()
        else:
            client.fail_in_flight(APIError("the server is shutting down", 503, code="shutting_down"))
            core.open()
            await until(lambda: ("add", "p") in core.log and not core.reqs, "the core's aborts")
        with pytest.raises(APIError) as ei:
            await asyncio.wait_for(pending, GUARD_S)
        assert ei.value.status_code == 503 and ei.value.code == "shutting_down"
        delta, failure = drain(col)
        assert delta.outputs[0].token_ids == [300]
        assert isinstance(failure, RequestFailed) and failure.error.code == "shutting_down"
        with pytest.raises(APIError) as ei:
            await client.add_request("new", [5], params(), col)
        assert ei.value.status_code == 503 and ei.value.code == "shutting_down"
        await until(lambda: not client._receiver.is_alive() or how != "shutdown", "the receiver")
        for _ in range(10):
            await asyncio.sleep(0)                    # let every message from the core land
        stop(client, core)
        assert not client.output.requests and not client._pending and not client._streams

    run(main())
    assert errors == []
