"""The engine core's loop: messages in, token deltas out -- the same loop in a thread of the
server process or in a process of its own (vLLM v1's EngineCore layout, `kvserve serve`'s
default), so that the two layouts share their back-off, failure and shutdown logic.

    inbox  (frontend -> core):  ("add", EngineCoreRequest)   ("abort", rid)
                                ("abort_seq", rid, index)    ("shutdown",)
    outbox (core -> frontend):  ("added", rid, None | message)     the core could not take it
                                ("step", [EngineCoreOutput, ...], stats)   one per engine step
                                ("stats", stats)            after adds / aborts, when idle
                                ("dead", traceback)         the step raised; then the loop ends

A step's outputs are token deltas (engine/core_io.py): the bytes sent per step are
proportional to the tokens made in that step, whatever the lengths of the streams. `inbox` and
`outbox` are the two ends of a pipe (process layout) or a `ThreadPipe` (thread layout): both
have `poll(timeout)`, `recv()` and `send(msg)`.

The loop ends when told to, when its inbox closes (the frontend is gone: no orphan keeps the
model in memory), or when a step fails (after saying why). The process entry point ignores
SIGINT and SIGTERM: Ctrl-C in a terminal, `timeout` and systemd signal the whole process
group, and a graceful shutdown (in-flight requests run to completion first) is the frontend's.
"""
from __future__ import annotations

import gc
import logging
import queue
import signal
import traceback

logger = logging.getLogger("kvserve.engine_core")

# The loop's back-off while requests are in flight but no step can make progress.
BACKOFF_MIN_S = 0.001
BACKOFF_MAX_S = 0.05


class ThreadPipe:
    """One direction of an in-process pipe, with the methods the loop uses of a Connection."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._peeked = []
        self.closed = False

    def send(self, msg) -> None:
        if self.closed:
            raise OSError("the pipe is closed")
        self._q.put(msg)

    def poll(self, timeout: float | None = 0.0) -> bool:
        if self._peeked:
            return True
        try:
            self._peeked.append(self._q.get(timeout=timeout) if timeout != 0 else self._q.get_nowait())
        except queue.Empty:
            return False
        return True

    def recv(self):
        if self._peeked:
            return self._peeked.pop()
        return self._q.get()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._q.put(("shutdown",))


def run_core_loop(engine, inbox, outbox) -> None:
    """Serve `engine` (an EngineCore) over the two pipe ends until shutdown (module docstring)."""
    backoff = 0.0
    num_steps = engine.stats().num_steps
    while True:
        busy = engine.has_unfinished_requests()
        # Idle: block until a message comes. Busy: take what has come without waiting, unless
        # the last step could not make progress (then wait a little longer each time).
        if inbox.poll(backoff if busy else None):
            if not _drain(engine, inbox, outbox):
                return
            backoff = 0.0
            if not engine.has_unfinished_requests():     # e.g. the last one was aborted
                outbox.send(("stats", engine.stats()))
                continue
        if not engine.has_unfinished_requests():
            continue
        try:
            outputs = engine.step()
        except BaseException:  # noqa: BLE001 -- the shared forward pass failed: say why, stop
            logger.exception("engine step failed; the engine core stops")
            outbox.send(("dead", traceback.format_exc()))
            return
        stats = engine.stats()
        if outputs or stats.num_steps != num_steps:
            outbox.send(("step", outputs, stats))
            backoff = 0.0
        else:
            backoff = min(max(2 * backoff, BACKOFF_MIN_S), BACKOFF_MAX_S)
        num_steps = stats.num_steps


def _drain(engine, inbox, outbox) -> bool:
    """Apply every message waiting in the inbox; False when the loop must stop."""
    while inbox.poll(0):
        try:
            msg = inbox.recv()
        except (EOFError, OSError):
            return False                # the frontend is gone
        kind = msg[0]
        if kind == "add":
            error = None
            try:
                engine.add_request(msg[1])
            except Exception as e:  # noqa: BLE001 -- an engine bug is a 500 for this one request
                logger.exception("add_request failed")
                error = f"{type(e).__name__}: {e}"
            outbox.send(("added", msg[1].request_id, error))
        elif kind == "abort":
            engine.abort_request(msg[1])
        elif kind == "abort_seq":
            engine.abort_sequence(msg[1], msg[2])
        elif kind == "shutdown":
            return False
    return True


def apply_threads(num_threads: int | None) -> int:
    """The engine's torch thread count in this process (`--engine-threads`; None: torch's own,
    which follows OMP_NUM_THREADS), set by the worker (worker/device.py); returns it."""
    from kvserve.worker.device import set_num_threads
    return set_num_threads(num_threads)


def run_engine_core(config, num_threads: int | None, log_level: str, inbox, outbox) -> None:
    """The engine core process's entry point: build the core, answer ("ready", config,
    tokenizer, limits, stats) or ("failed", traceback), then run the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    from kvserve.engine.engine_core import EngineCore

    logger.info("engine core: %d torch threads", apply_threads(num_threads))
    try:
        engine = EngineCore(config)
    except BaseException:  # noqa: BLE001 -- the frontend reports it and exits
        outbox.send(("failed", traceback.format_exc()))
        return
    outbox.send(("ready", engine.config, engine.tokenizer, engine.limits, engine.stats()))
    from kvserve import memory_probe
    memory_probe.start("engine", {"engine": engine})     # only with KVSERVE_MEMORY_PROBE set
    gc.freeze()             # the model and the engine live as long as the process: never scan them
    try:
        run_core_loop(engine, inbox, outbox)
    finally:
        engine.shutdown()
