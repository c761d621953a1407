"""The engine core process: scheduling and the forward pass, apart from the HTTP server.

vLLM v1 runs its EngineCore in a process of its own so that HTTP, tokenization, SSE and JSON
never compete with the step loop for the GIL. `run_engine_core` is that process's entry point:
it sets torch's threads explicitly, builds the `LLMEngine`, answers `("ready", config,
tokenizer, stats)` (or `("failed", traceback)`), then runs `EngineCore.run`:

    inbox  (API -> core):  ("add", rid, prompt, params, prompt_text, arrival_time)
                           ("abort", rid)    ("shutdown",)
    outbox (core -> API):  ("added", rid, None | (kind, message))   kind: "invalid" | "error"
                           ("step", [delta, ...], stats)            one message per engine step
                           ("stats", stats)                         after adds/aborts, when idle
                           ("dead", traceback)                      the step raised; then exit

A step's outputs cross as *deltas*, never as cumulative outputs: for each request that changed,
`(request_id, finished, num_cached_tokens, metrics, prompt_logprobs or None, [completion delta,
...])`, where a completion delta is `(index, token_start, new_token_ids, text_start, new_text,
logprob_start, new_logprobs or None, cumulative_logprob, finish_reason, stop_reason, error)`:
the sequence's lists from `*_start` on are replaced by the new items (usually an append; a
replacement from 0 when a finished beam search reports its beams). So the bytes sent per step
are proportional to the tokens made in that step, whatever the lengths of the streams.

The core exits when told to, when its inbox closes (the API process is gone: no orphan keeps
the model in memory), or when a step fails (after saying why). It ignores SIGINT and SIGTERM:
Ctrl-C in a terminal, `timeout` and systemd signal the whole process group, and a graceful
shutdown (in-flight requests run to completion first) is the API process's to conduct.
"""
from __future__ import annotations

import gc
import logging
import signal
import traceback

logger = logging.getLogger("kvserve.engine_core")

# The loop's back-off while requests are in flight but no step can make progress.
BACKOFF_MIN_S = 0.001
BACKOFF_MAX_S = 0.05


class DeltaEncoder:
    """What each request's consumer already has, so that only the new part is sent."""

    def __init__(self):
        # request id -> index -> (num tokens, text length, num logprobs) already sent
        self._sent: dict[str, dict[int, tuple[int, int, int]]] = {}
        self._prompt_lp_sent: dict[str, int] = {}

    def encode(self, out) -> tuple:
        rid = out.request_id
        sent = self._sent.setdefault(rid, {})
        comps = []
        for c in out.outputs:
            n0, t0, l0 = sent.get(c.index, (0, 0, 0))
            n, t = len(c.token_ids), len(c.text)
            lps = c.logprobs
            nl = len(lps) if lps is not None else 0
            if n < n0 or t < t0 or nl < l0:
                n0 = t0 = l0 = 0                      # replaced, not extended: send it all
            comps.append((c.index, n0, c.token_ids[n0:], t0, c.text[t0:], l0,
                          lps[l0:] if lps is not None else None, c.cumulative_logprob,
                          c.finish_reason, c.stop_reason, c.error))
            sent[c.index] = (n, t, nl)
        plp = out.prompt_logprobs
        if plp is not None and len(plp) != self._prompt_lp_sent.get(rid, 0):
            self._prompt_lp_sent[rid] = len(plp)
        else:
            plp = None
        if out.finished:
            self.forget(rid)
        return (rid, out.finished, out.num_cached_tokens, out.metrics, plp, comps)

    def forget(self, rid: str) -> None:
        self._sent.pop(rid, None)
        self._prompt_lp_sent.pop(rid, None)


class EngineCore:
    """The step loop over an `LLMEngine`, fed and drained through two pipe ends."""

    def __init__(self, engine, inbox, outbox):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.deltas = DeltaEncoder()

    def run(self) -> None:
        engine, backoff = self.engine, 0.0
        num_steps = engine.stats().num_steps
        while True:
            busy = engine.has_unfinished_requests()
            # Idle: block until a message comes. Busy: take what has come without waiting,
            # unless the last step could not make progress (then wait a little longer each time).
            if self.inbox.poll(backoff if busy else None):
                if not self._drain():
                    return
                backoff = 0.0
                if not engine.has_unfinished_requests():     # e.g. the last one was aborted
                    self.outbox.send(("stats", engine.stats()))
                    continue
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except BaseException:  # noqa: BLE001 -- the shared forward pass failed: say why, stop
                logger.exception("engine step failed; the engine core stops")
                self.outbox.send(("dead", traceback.format_exc()))
                return
            stats = engine.stats()
            if outputs or stats.num_steps != num_steps:
                self.outbox.send(("step", [self.deltas.encode(o) for o in outputs], stats))
                backoff = 0.0
            else:
                backoff = min(max(2 * backoff, BACKOFF_MIN_S), BACKOFF_MAX_S)
            num_steps = stats.num_steps

    def _drain(self) -> bool:
        """Apply every message waiting in the inbox; False when the core must stop."""
        while self.inbox.poll():
            try:
                msg = self.inbox.recv()
            except (EOFError, OSError):
                return False                # the API process is gone
            kind = msg[0]
            if kind == "add":
                self._add(*msg[1:])
            elif kind == "abort":
                self.engine.abort_request(msg[1])
                self.deltas.forget(msg[1])
            elif kind == "shutdown":
                return False
        return True

    def _add(self, rid, prompt, params, prompt_text, arrival) -> None:
        try:
            self.engine.add_request(rid, prompt, params, arrival_time=arrival, prompt_text=prompt_text)
        except ValueError as e:
            error = ("invalid", str(e))
        except Exception as e:  # noqa: BLE001 -- an engine bug is a 500 for this one request
            logger.exception("add_request failed")
            error = ("error", f"{type(e).__name__}: {e}")
        else:
            error = None
        self.outbox.send(("added", rid, error))


def run_engine_core(config, num_threads: int | None, log_level: str, inbox, outbox) -> None:
    """The engine core process's entry point (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    import torch

    from kvserve.engine.engine import LLMEngine

    if num_threads:
        torch.set_num_threads(num_threads)
    logger.info("engine core: %d torch threads", torch.get_num_threads())
    try:
        engine = LLMEngine(config)
    except BaseException:  # noqa: BLE001 -- the API process reports it and exits
        outbox.send(("failed", traceback.format_exc()))
        return
    outbox.send(("ready", engine.config, engine.tokenizer, engine.stats()))
    gc.freeze()             # the model and the engine live as long as the process: never scan them
    try:
        EngineCore(engine, inbox, outbox).run()
    finally:
        engine.shutdown()
