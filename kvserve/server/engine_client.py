"""`ProcessEngine`: the API process's side of the engine core process (server/engine_core.py).

The API process does HTTP, tokenization, SSE and JSON; the engine core does scheduling and the
forward pass with its own threads, so neither waits for the other's GIL. Requests go to the
core as messages on one pipe; each engine step comes back as one message of deltas (only the
tokens, text and logprobs that step made) on another. A receiver thread reads that pipe and
hands every message to the server's event loop, which applies it: it extends each request's
cumulative `RequestOutput` in place (lists only grow, so a reader holding an output and the
per-step lengths of `RequestOutputCollector` slices it consistently) and puts it in the
request's collector. All request bookkeeping happens on the event loop thread: `add_request`
and `abort` must be called from it.

If the core process dies (a failed step, a crash, a kill), every in-flight request fails with a
clear error, `/health` turns 500 and new requests get 503; nothing waits for a core that is gone.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import threading
import time

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server.async_engine import EngineFrontend
from kvserve.server.collector import RequestFailed, RequestOutputCollector
from kvserve.server.engine_core import run_engine_core
from kvserve.server.protocol import ENGINE_REJECTED, APIError

logger = logging.getLogger("kvserve.server")


class EngineDeadError(RuntimeError):
    """The engine core process failed or exited; the server can no longer serve."""


class _Stream:
    """A request in the core: whom to tell, and its cumulative output, built from deltas."""
    __slots__ = ("collector", "n", "output", "by_index")

    def __init__(self, collector: RequestOutputCollector, n: int, output: RequestOutput):
        self.collector, self.n, self.output = collector, n, output
        self.by_index: dict[int, CompletionOutput] = {}

    def apply(self, delta) -> RequestOutput:
        _, finished, num_cached, metrics, prompt_logprobs, comps = delta
        out = self.output
        for (index, t0, toks, x0, text, l0, lps, cum_lp, finish, stop, error) in comps:
            c = self.by_index.get(index)
            if c is None:
                c = self.by_index[index] = CompletionOutput(index=index, text="", token_ids=[])
                out.outputs.append(c)
                out.outputs.sort(key=lambda o: o.index)
            c.token_ids[t0:] = toks
            c.text = c.text + text if x0 == len(c.text) else c.text[:x0] + text
            if lps is not None:
                if c.logprobs is None:
                    c.logprobs = []
                c.logprobs[l0:] = lps
            c.cumulative_logprob, c.finish_reason, c.stop_reason, c.error = cum_lp, finish, stop, error
        out.finished, out.num_cached_tokens, out.metrics = finished, num_cached, metrics
        if prompt_logprobs is not None:
            out.prompt_logprobs = prompt_logprobs
        return out


class ProcessEngine(EngineFrontend):
    """Start the engine core process for `config` and serve through it (see the module
    docstring). Blocks until the model is loaded; raises RuntimeError if loading failed."""

    def __init__(self, config, num_threads: int | None = None, log_level: str = "info",
                 startup_timeout: float = 900.0):
        super().__init__()
        ctx = multiprocessing.get_context("spawn")
        core_inbox, self._to_core = ctx.Pipe(duplex=False)
        self._from_core, core_outbox = ctx.Pipe(duplex=False)
        # Not a daemon: the core may start processes of its own (tensor-parallel workers).
        # Stopped by `shutdown` (also at exit), or by itself when this process's pipe end closes.
        self.proc = ctx.Process(target=run_engine_core, name="kvserve-engine-core",
                                args=(config, num_threads, log_level, core_inbox, core_outbox))
        self.proc.start()
        atexit.register(self.shutdown)
        core_inbox.close()              # the core holds the only other ends: its exit is our EOF
        core_outbox.close()
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._receiver: threading.Thread | None = None
        self._streams: dict[str, _Stream] = {}
        self._pending: dict[str, tuple] = {}     # rid -> (future, collector, n, output skeleton)
        self._aborted_pending: set[str] = set()
        self._await_ready(startup_timeout)

    def _await_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._from_core.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine core process exited with code {self.proc.exitcode} "
                                   "while loading the model; see the log above")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the engine core did not load the model within {timeout:.0f} s")
        msg = self._from_core.recv()
        if msg[0] == "failed":
            self.proc.join(10)
            raise RuntimeError(f"the engine core could not load the model:\n{msg[1]}")
        _, self.config, self.tokenizer, self.last_stats = msg

    # -- lifecycle (event loop) ---------------------------------------------------------------
    def start(self) -> None:
        if self._receiver is not None:
            return
        self._loop = asyncio.get_running_loop()
        with self._ops_lock:
            self._running = True
            self._accepting = self.dead is None and self.proc.is_alive()
        self._receiver = threading.Thread(target=self._receive, name="kvserve-engine-receiver",
                                          daemon=True)
        self._receiver.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fail what is in flight ('server shutting down'), stop the core, wait for it
        (idempotent)."""
        if self._to_core.closed:
            return
        with self._ops_lock:
            self._running = False
            self._accepting = False
        self._fail_everything(APIError("the server is shutting down", status_code=503,
                                       type="server_error", code="shutting_down"))
        try:
            self._send(("shutdown",))
        except OSError:
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            logger.warning("the engine core did not stop within %.0f s; killing it", timeout)
            self.proc.kill()
            self.proc.join(5)
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
                          prompt_text: str | None = None) -> None:
        """Send a request to the core; returns once the core accepted it, raises APIError
        otherwise. `prompt` is a list of token ids or {"prompt_token_ids": [...], ...}."""
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        if not isinstance(ids, (list, tuple)):
            raise APIError("the engine process takes prompts as token ids")
        if request_id in self._streams or request_id in self._pending:
            raise APIError(f"request id {request_id!r} is already in the engine.")
        with self._ops_lock:
            self._admit()
        accepted = self._loop.create_future()
        skeleton = RequestOutput(request_id=request_id, prompt=prompt_text, prompt_token_ids=list(ids),
                                 outputs=[], finished=False)
        self._pending[request_id] = (accepted, collector, getattr(params, "n", 1), skeleton)
        try:
            self._send(("add", request_id, prompt, params, prompt_text, time.monotonic()))
        except OSError:
            self._pending.pop(request_id, None)
            with self._ops_lock:
                self._pending_adds -= 1
            raise self._refusal() from None
        await accepted

    def abort(self, request_id: str) -> None:
        """Abort a request (from the event loop; for any id, any number of times)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.metrics.observe_abort(stream.n)
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

    # -- messages from the core (receiver thread -> event loop) ---------------------------------
    def _receive(self) -> None:
        while True:
            try:
                msg = self._from_core.recv()
            except (EOFError, OSError):
                msg = ("exited",)
            try:
                self._loop.call_soon_threadsafe(self._on_message, msg)
            except RuntimeError:
                return              # the event loop is closed: nobody is listening any more
            if msg[0] in ("exited", "dead"):
                return

    def _on_message(self, msg) -> None:
        kind = msg[0]
        if kind == "step":
            for delta in msg[1]:
                stream = self._streams.get(delta[0])
                if stream is None:
                    continue        # aborted meanwhile
                out = stream.apply(delta)
                if out.finished:
                    del self._streams[delta[0]]
                if not self._deliver(stream.collector, out):
                    del self._streams[delta[0]]
                    self._send(("abort", delta[0]))
            self.num_steps += 1
            self._set_stats(msg[2])
        elif kind == "stats":
            self._set_stats(msg[1])
        elif kind == "added":
            self._on_added(msg[1], msg[2])
        elif kind in ("dead", "exited"):
            self._on_core_exit(msg[1] if kind == "dead" else None)

    def _on_added(self, rid: str, error) -> None:
        accepted, collector, n, skeleton = self._pending.pop(rid)
        with self._ops_lock:
            self._pending_adds -= 1
        if rid in self._aborted_pending:
            self._aborted_pending.discard(rid)
            error = error or ("invalid", "aborted before it was accepted")
        elif error is None:
            self._streams[rid] = _Stream(collector, n, skeleton)
        if accepted.done():
            return                  # the handler was cancelled meanwhile; its abort is sent
        if error is None:
            accepted.set_result(None)
        elif error[0] == "invalid":
            accepted.set_exception(APIError(error[1], code=ENGINE_REJECTED))
        else:
            accepted.set_exception(RuntimeError(error[1]))

    def _on_core_exit(self, trace: str | None) -> None:
        if not self._running:
            return                  # an orderly shutdown
        if trace is not None:
            logger.error("the engine core failed:\n%s", trace)
            reason = trace.strip().splitlines()[-1]
        else:
            self.proc.join(1)
            reason = f"exit code {self.proc.exitcode}"
            logger.error("the engine core process exited unexpectedly (%s)", reason)
        self.dead = EngineDeadError(f"the engine process failed ({reason})")
        with self._ops_lock:
            self._accepting = False
        self._fail_everything(self.dead)

    def _fail_everything(self, err: BaseException) -> None:
        pending, self._pending = self._pending, {}
        with self._ops_lock:
            self._pending_adds = 0
        refusal = self._refusal()
        for accepted, *_ in pending.values():
            if not accepted.done():
                accepted.set_exception(refusal)
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            stream.collector.put(RequestFailed(rid, err))
