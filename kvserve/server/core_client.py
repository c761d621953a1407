"""CoreClient: the server's side of the engine core, in a thread or in a process of its own.

The core runs `engine/core_loop.py`'s loop either way -- in a spawned process (vLLM v1's
layout, `kvserve serve`'s default: HTTP, JSON and detokenizing never compete with the step for
the GIL) or in a thread of this process (`ThreadPipe`s instead of pipes) -- so both layouts
share one loop, one back-off and one failure path. Here, on the event loop: requests are checked
(frontend/processor.py: a ValueError is a 400) and sent as token ids; each step's token deltas
come back through a receiver thread and are turned into text and outputs
(frontend/output_processor.py), handed to each request's collector, and every stop string found
aborts its sequence in the core. `add_request` and `abort` must be called from the event loop.

Admission (`--max-waiting`: 503 with Retry-After), the dead flag behind /health, aborting
requests whose reader stalls (`--stream-stall-timeout`) and failing everything in flight when
the core goes are here too. If the core dies (a failed step, a crash, a kill), every request in
flight fails with a clear error, /health turns 500 and new requests get 503.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import threading
import time

from kvserve.engine.core_loop import ThreadPipe, run_core_loop, run_engine_core
from kvserve.frontend.output_processor import OutputProcessor
from kvserve.frontend.processor import Processor
from kvserve.server.collector import RequestFailed, RequestOutputCollector
from kvserve.server.grammar_checks import GrammarChecks
from kvserve.server.openai.protocol import ENGINE_REJECTED, INVALID_STRUCTURED_OUTPUT, APIError
from kvserve.server.tenants import current_tenant
from kvserve.structured import GrammarRejected

logger = logging.getLogger("kvserve.server")


class EngineDeadError(RuntimeError):
    """The engine core failed or exited; the server can no longer serve."""


class CoreClient:
    """The engine core behind a pipe (see the module docstring). Build it with `in_thread`
    (an EngineCore already loaded) or `in_process` (a config; blocks until the model is loaded,
    raises RuntimeError if loading failed)."""

    def __init__(self, to_core, from_core, config, tokenizer, limits, stats, proc=None, thread=None):
        self._to_core, self._from_core = to_core, from_core
        self.proc, self._core_thread = proc, thread
        self.config, self.tokenizer, self.last_stats = config, tokenizer, stats
        self.limits = limits                    # the core's CoreLimits: max_model_len is the served one
        self.processor = Processor(tokenizer, limits)
        self.grammar_checks = GrammarChecks(tokenizer, limits)
        self.output = OutputProcessor(tokenizer, logprob_text=False)
        self.metrics = None
        self.request_log = None      # server/request_log.py: a line per finished/aborted/failed request
        self.max_waiting: int | None = None
        self.stall_timeout: float | None = None
        self.dead: BaseException | None = None
        self.num_steps = 0
        self._ops_lock = threading.Lock()
        self._running = self._accepting = False
        self._pending_adds = 0
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._receiver: threading.Thread | None = None
        self._streams: dict[str, tuple[RequestOutputCollector, int]] = {}   # rid -> (collector, n)
        self._pending: dict[str, tuple] = {}     # rid -> (future, collector, n) until "added"
        self._aborted_pending: set[str] = set()

    @classmethod
    def in_thread(cls, core) -> CoreClient:
        inbox, outbox = ThreadPipe(), ThreadPipe()
        def loop():
            try:
                run_core_loop(core, inbox, outbox)
            finally:
                outbox.close()          # the receiver reads it as the core's exit

        thread = threading.Thread(target=loop, name="kvserve-engine-loop", daemon=True)
        return cls(inbox, outbox, core.config, core.tokenizer, core.limits, core.stats(), thread=thread)

    @classmethod
    def in_process(cls, config, num_threads: int | None = None, log_level: str = "info",
                   startup_timeout: float = 900.0) -> CoreClient:
        ctx = multiprocessing.get_context("spawn")
        core_inbox, to_core = ctx.Pipe(duplex=False)
        from_core, core_outbox = ctx.Pipe(duplex=False)
        # Not a daemon: the core may start processes of its own (tensor-parallel workers).
        # Stopped by `shutdown` (also at exit), or by itself when this process's pipe end closes.
        proc = ctx.Process(target=run_engine_core, name="kvserve-engine-core",
                           args=(config, num_threads, log_level, core_inbox, core_outbox))
        proc.start()
        core_inbox.close()              # the core holds the only other ends: its exit is our EOF
        core_outbox.close()
        deadline = time.monotonic() + startup_timeout
        while not from_core.poll(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"the engine core process exited with code {proc.exitcode} "
                                   "while loading the model; see the log above")
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the engine core did not load the model within {startup_timeout:.0f} s")
        msg = from_core.recv()
        if msg[0] == "failed":
            proc.join(10)
            raise RuntimeError(f"the engine core could not load the model:\n{msg[1]}")
        client = cls(to_core, from_core, *msg[1:], proc=proc)
        atexit.register(client.shutdown)
        return client

    def bind(self, metrics, max_waiting: int | None, stall_timeout: float | None = None) -> None:
        """Report to `metrics`, refuse adds beyond `max_waiting` waiting requests, abort
        requests whose reader fell `stall_timeout` s behind."""
        self.metrics, self.max_waiting, self.stall_timeout = metrics, max_waiting, stall_timeout
        metrics.update_stats(self.last_stats)
        if self.limits.num_kv_blocks:       # (an embedding core has no KV cache)
            metrics.set_cache_config(self.config.cache, self.limits.num_kv_blocks)

    # -- lifecycle (event loop) ---------------------------------------------------------------
    def start(self) -> None:
        if self._receiver is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.grammar_checks.start()
        with self._ops_lock:
            self._running = True
            self._accepting = self.dead is None and (self.proc is None or self.proc.is_alive())
        if self._core_thread is not None:
            self._core_thread.start()
        self._receiver = threading.Thread(target=self._receive, name="kvserve-engine-receiver",
                                          daemon=True)
        self._receiver.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fail what is in flight ('server shutting down'), stop the core, wait for it
        (idempotent)."""
        if self._to_core.closed:
            return
        with self._ops_lock:
            self._running = self._accepting = False
        self.grammar_checks.close()
        self._fail_everything(APIError("the server is shutting down", status_code=503,
                                       type="server_error", code="shutting_down"))
        try:
            self._send(("shutdown",))
        except OSError:
            pass
        if self.proc is not None:
            self.proc.join(timeout)
            if self.proc.is_alive():
                logger.warning("the engine core did not stop within %.0f s; killing it", timeout)
                self.proc.kill()
                self.proc.join(5)
        elif self._core_thread is not None and self._core_thread.is_alive():
            self._core_thread.join(timeout)
        self._to_core.close()

    def fail_in_flight(self, err: APIError) -> None:
        """Refuse new requests, and fail and abort every request in flight with `err` (the
        shutdown deadline: their handlers answer with it instead of being cut off)."""
        with self._ops_lock:
            self._accepting = False
        rids = list(self._streams)
        self._fail_everything(err)
        for rid in rids:
            try:
                self._send(("abort", rid))
            except OSError:
                break

    # -- the handler side (event loop) ----------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params, collector: RequestOutputCollector,
                          prompt_text: str | None = None, stream: bool = False) -> None:
        """Check a request and send it to the core; returns once the core took it, raises
        APIError otherwise. Outputs go to `collector`: deltas when `stream`, else the final one."""
        if request_id in self._streams or request_id in self._pending:
            raise APIError(f"request id {request_id!r} is already in the engine.")
        if params is not None and params.structured_outputs is not None:     # off the loop, first
            await self.grammar_checks.check(params.structured_outputs, current_tenant.get())
        try:
            req, text = self.processor.process(request_id, prompt, params, time.monotonic(), prompt_text)
        except GrammarRejected as e:
            raise APIError(str(e), code=INVALID_STRUCTURED_OUTPUT) from None
        except ValueError as e:
            raise APIError(str(e), code=ENGINE_REJECTED) from None
        with self._ops_lock:
            self._admit()
        accepted = self._loop.create_future()
        self._pending[request_id] = (accepted, collector, req.params.n)
        self.output.add_request(request_id, text, req.prompt_token_ids, req.params, req.arrival_time,
                                "delta" if stream else "final")
        try:
            self._send(("add", req))
        except OSError:
            self._pending.pop(request_id, None)
            self.output.abort(request_id)
            with self._ops_lock:
                self._pending_adds -= 1
            raise self._refusal() from None
        await accepted
        self.metrics.observe_params(req.params)

    def abort(self, request_id: str) -> None:
        """Abort a request (from the event loop; for any id, any number of times)."""
        whole = self._whole(request_id)
        self.output.abort(request_id)
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            self.metrics.observe_abort(entry[1])
            self._log_end(entry[0], request_id, whole, "abort")
        elif request_id in self._pending:
            self._aborted_pending.add(request_id)
        else:
            return
        try:
            self._send(("abort", request_id))
        except OSError:
            pass                    # the core is gone; its exit fails everything

    def _send(self, msg) -> None:
        with self._send_lock:
            self._to_core.send(msg)

    def _tell(self, msg) -> None:
        """Send from the message callback: a core that is gone is handled by its exit message."""
        try:
            self._send(msg)
        except OSError:
            pass

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

    # -- messages from the core (receiver thread -> event loop) ---------------------------------
    def _receive(self) -> None:
        while True:
            try:
                msg = self._from_core.recv()
            except (EOFError, OSError):
                msg = ("exited",)
            if msg[0] == "shutdown" and self.proc is None:
                msg = ("exited",)    # the thread layout's pipe closed
            try:
                self._loop.call_soon_threadsafe(self._on_message, msg)
            except RuntimeError:
                return              # the event loop is closed: nobody is listening any more
            if msg[0] in ("exited", "dead"):
                return

    def _on_message(self, msg) -> None:
        kind = msg[0]
        if kind == "step":
            emitted, stops, finished = self.output.process(msg[1])
            for rid, index in stops:
                self._tell(("abort_seq", rid, index))
            for out in emitted:
                entry = self._streams.get(out.request_id)
                if entry is not None and not self._deliver(*entry, out):
                    del self._streams[out.request_id]
                    self.output.abort(out.request_id)
                    self._tell(("abort", out.request_id))
            for out in finished:
                entry = self._streams.pop(out.request_id, None)
                if entry is not None:
                    self.metrics.observe_finished(out)
                    self._log_end(entry[0], out.request_id, out)
            self.num_steps += 1
            self._set_stats(msg[2])
        elif kind == "stats":
            self._set_stats(msg[1])
        elif kind == "added":
            self._on_added(msg[1], msg[2])
        elif kind in ("dead", "exited"):
            self._on_core_exit(msg[1] if kind == "dead" else None)

    def _deliver(self, collector: RequestOutputCollector, n: int, out) -> bool:
        """Hand `out` to its reader; False (and a failure instead) when the reader has left an
        output unread for more than `stall_timeout` s: a client that stopped reading its stream
        must not hold a seat and KV blocks for ever. The caller then aborts the request."""
        if (not out.finished and self.stall_timeout is not None
                and collector.unread_for(out.request_id) > self.stall_timeout):
            logger.warning("request %s: its client has read nothing for over %.0f s; aborting it",
                           out.request_id, self.stall_timeout)
            self.metrics.observe_abort(n)        # every sample, as `abort` counts them
            self._log_end(collector, out.request_id, self._whole(out.request_id), "abort")
            collector.put(RequestFailed(out.request_id, APIError(
                f"aborted: the client read nothing for over {self.stall_timeout:.0f} s "
                "(--stream-stall-timeout)", status_code=408, type="server_error", code="client_too_slow")))
            return False
        collector.put(out)
        return True

    def _whole(self, rid: str):
        """The cumulative RequestOutput of an unfinished request (what it made so far), or None."""
        req = self.output.requests.get(rid)
        return req.output if req is not None else None

    def _log_end(self, collector, rid: str, output, reason: str | None = None, error=None) -> None:
        if self.request_log is not None:
            self.request_log.ended(collector, rid, output, reason, error)

    def _set_stats(self, stats) -> None:
        self.last_stats = stats
        self.metrics.update_stats(stats)

    def _on_added(self, rid: str, error) -> None:
        if rid not in self._pending:        # failed meanwhile (shutdown, fail_in_flight): drop it
            self._aborted_pending.discard(rid)
            if error is None:
                try:
                    self._send(("abort", rid))
                except OSError:
                    pass                    # the core is stopping anyway
            return
        accepted, collector, n = self._pending.pop(rid)
        with self._ops_lock:
            self._pending_adds -= 1
        if rid in self._aborted_pending:
            self._aborted_pending.discard(rid)
            error = error or "aborted before it was accepted"
            self.output.abort(rid)
        elif error is None:
            self._streams[rid] = (collector, n)
        else:
            self.output.abort(rid)
        if accepted.done():
            return                  # the handler was cancelled meanwhile; its abort is sent
        if error is None:
            accepted.set_result(None)
        else:
            accepted.set_exception(RuntimeError(error))

    def _on_core_exit(self, trace: str | None) -> None:
        if not self._running:
            return                  # an orderly shutdown
        if trace is not None:
            logger.error("the engine core failed:\n%s", trace)
            reason = trace.strip().splitlines()[-1]
        else:
            if self.proc is not None:
                self.proc.join(1)
            reason = f"exit code {self.proc.exitcode}" if self.proc is not None else "the loop ended"
            logger.error("the engine core exited unexpectedly (%s)", reason)
        self.dead = EngineDeadError(f"the engine process failed ({reason})")
        with self._ops_lock:
            self._accepting = False
        self._fail_everything(self.dead)

    def _fail_everything(self, err: BaseException) -> None:
        pending, self._pending = self._pending, {}
        with self._ops_lock:
            self._pending_adds = 0
        refusal = self._refusal()
        for rid, (accepted, *_) in pending.items():
            self.output.abort(rid)
            if not accepted.done():
                accepted.set_exception(refusal)
        streams, self._streams = self._streams, {}
        for rid, (collector, _) in streams.items():
            self._log_end(collector, rid, self._whole(rid), "error", err)
            self.output.abort(rid)
            collector.put(RequestFailed(rid, err))
