"""Grammar checks in worker processes: a spec that crashes, hangs or blows up the compiler costs
one worker, never the process that asked (seed 000's isolation of what parses user input).

    sandbox = sandbox_for(tokenizer, vocab_size, eos)      # one per tokenizer, started once
    sandbox.check(params, max_compile_s, max_forced_tokens, owner="alice")
        None, or GrammarRejected (a ValueError naming structured_outputs.<kind>), or
        GrammarBusy (too many compiles in flight: the owner's cap or the queue's bound)

A check compiles the spec in full in a worker (sandbox_worker.py: llguidance on a thread with
an 8 MiB stack, under an address-space limit), then the engine compiles the same spec again in
its own threads, whose stacks are eight times larger (compiler.py): llguidance keeps no
serialisable form of a compiled matcher, and a recompile of what passed costs what the check
cost (milliseconds for the schemas of tools and response formats) while a worker that kept
every sequence's matcher would add a pipe round trip to every decode step. Results are cached
by spec (passes and compile errors, not timeouts), so the same schema on every request is
checked once; the same crashing spec crashes one worker once.

Fairness: at most `num_workers` checks run at once, at most `max_queued` wait (GrammarBusy
beyond), at most `per_owner` of them one owner's (a tenant; GrammarBusy beyond), and a check's
deadline counts from when a worker takes it, not from when it queued. A check past its deadline
kills its worker (a replacement starts at once) and is refused. Every worker exits when the
pipe from its parent closes.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path

NUM_WORKERS = 2
MAX_QUEUED = 16             # checks waiting for a worker, over all owners
PER_OWNER = 4               # one owner's checks waiting or running
# The address space a worker may map: a grammar whose compile needs more fails there alone.
WORKER_MEMORY_BYTES = 4 * 1024 ** 3
STARTUP_TIMEOUT_S = 60.0    # a worker's start (it builds llguidance's tokenizer: ~0.3 s for 49k)
MAX_CACHED = 1024
# A grammar forcing this many tokens before any choice has no finite output (llguidance stops
# following a forced path after some 10,000 tokens): the bound when no max_model_len is known.
DEFAULT_MAX_FORCED_TOKENS = 8192
_WORKER = str(Path(__file__).with_name("sandbox_worker.py"))


class GrammarRejected(ValueError):
    """The spec does not compile, has no finite output, crashed or outlasted its worker."""


class GrammarBusy(RuntimeError):
    """Too many compiles in flight (`scope`: "owner" or "queue"): retry later."""

    def __init__(self, message: str, scope: str):
        super().__init__(message)
        self.scope = scope


class _Worker:
    """One worker process and its pipes; `ready` once it has built its tokenizer."""

    def __init__(self, init_line: bytes):
        self.proc = subprocess.Popen([sys.executable, _WORKER, str(WORKER_MEMORY_BYTES)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, close_fds=True)
        self.proc.stdin.write(init_line)
        self.proc.stdin.flush()
        self.ready = False
        self.timed_out = False       # killed by `read` at its deadline
        self._buf = b""

    def read(self, deadline: float) -> dict | None:
        """The next message, or None when the worker died or the deadline passed (then it is
        killed and `timed_out`)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.timed_out = True
                self.kill()
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:                          # the worker is gone
                self.proc.wait()
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, msg: dict) -> bool:
        try:
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        try:
            self.proc.stdin.close()        # the worker's loop ends at EOF
        except OSError:
            pass
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.kill()

    def death(self) -> str:
        """How the worker ended, for the refusal's message."""
        rc = self.proc.returncode
        if rc is not None and rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exit status {rc}"


class GrammarSandbox:
    """A pool of grammar-check workers for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos_token_id: int | None,
                 json_options: dict, num_workers: int = NUM_WORKERS, max_queued: int = MAX_QUEUED,
                 per_owner: int = PER_OWNER):
        self._init = json.dumps({"tokenizer": tokenizer_json, "n_vocab": n_vocab,
                                 "eos": eos_token_id, "json_options": json_options}).encode() + b"\n"
        self.num_workers, self.max_queued, self.per_owner = num_workers, max_queued, per_owner
        self._lock = threading.Lock()
        self._idle_cv = threading.Condition(self._lock)
        self._done_cv = threading.Condition(self._lock)    # a check ended: `_inflight` shrank
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []
        self._closed = False
        self._queued = 0                                   # waiting for a worker
        self._owners: dict[str, int] = {}                  # owner -> checks waiting or running
        self._inflight: set[tuple] = set()                 # spec keys checked now (one check per spec)
        self._cache: OrderedDict[tuple, str | None] = OrderedDict()   # key -> None (passed) or why
        self.num_checks = self.num_crashes = self.num_timeouts = 0

    def start(self) -> None:
        """Start the workers now (else the first check starts them)."""
        with self._lock:
            while len(self._all) < self.num_workers and not self._closed:
                self._spawn()

    def _spawn(self) -> None:
        """Under the lock: one more idle worker (it starts at once, its tokenizer builds there)."""
        w = _Worker(self._init)
        self._all.append(w)
        self._idle.append(w)
        self._idle_cv.notify()

    # -- checks ----------------------------------------------------------------------------------
    def check(self, params, max_compile_s: float, max_forced_tokens: int, owner: str | None = None) -> None:
        """Raise GrammarRejected unless `params` (StructuredOutputsParams) compiles to a grammar
        with a finite output; GrammarBusy when its check cannot be queued now."""
        ticket = self.admit(params, max_forced_tokens, owner)
        if ticket is not None:
            self.run(ticket, max_compile_s)

    def admit(self, params, max_forced_tokens: int, owner: str | None = None) -> tuple | None:
        """The first half of `check`, cheap enough for an event loop: None when the outcome is
        cached (raising it if a refusal), else a place in the queue for `run`; GrammarBusy past
        the owner's cap or the queue's bound."""
        key = (params.key, max_forced_tokens)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._raise(self._cache[key])
            if owner is not None and self._owners.get(owner, 0) >= self.per_owner:
                raise GrammarBusy(f"{self.per_owner} grammar compiles of yours are in flight; "
                                  "retry when one is done", "owner")
            if self._queued >= self.max_queued:
                raise GrammarBusy(f"{self._queued} grammar compiles are queued; retry later", "queue")
            if owner is not None:
                self._owners[owner] = self._owners.get(owner, 0) + 1
            self._queued += 1
        return key, params, owner

    def run(self, ticket: tuple, max_compile_s: float) -> None:
        """The second half of `check` (it blocks): the admitted spec checked; GrammarRejected."""
        key, params, owner = ticket
        try:
            self._raise(self._check(key, params, max_compile_s))
        finally:
            with self._lock:
                if owner is not None:
                    self._owners[owner] -= 1
                    if not self._owners[owner]:
                        del self._owners[owner]

    @staticmethod
    def _raise(error: str | None) -> None:
        if error is not None:
            raise GrammarRejected(error)

    def _check(self, key, params, max_compile_s: float) -> str | None:
        """The check's outcome (None or why) for `key` (the spec's, and max_forced_tokens), from
        another caller's check of the same spec or a worker. Called with one `_queued` taken;
        gives it back."""
        with self._lock:
            while key in self._inflight:                   # the same spec, checked now by another
                self._done_cv.wait()
                if key in self._cache:
                    self._queued -= 1
                    return self._cache[key]
            self._inflight.add(key)
        worker = None
        try:
            worker = self._take_worker()                   # the queue's wait: not on the clock
            error, keep = self._run(worker, params, max_compile_s, key[1])
            with self._lock:
                self.num_checks += 1
                if keep:
                    self._cache[key] = error
                    while len(self._cache) > MAX_CACHED:
                        self._cache.popitem(last=False)
            return error
        finally:
            with self._lock:
                self._inflight.discard(key)
                self._done_cv.notify_all()
                if worker is not None:
                    self._give_back(worker)

    def _take_worker(self) -> _Worker:
        with self._lock:
            try:
                if len(self._all) < self.num_workers and not self._idle:
                    self._spawn()
                while not self._idle:
                    if self._closed:
                        raise GrammarBusy("the grammar checker is shutting down", "queue")
                    self._idle_cv.wait()
                return self._idle.pop()
            finally:
                self._queued -= 1

    def _give_back(self, w: _Worker) -> None:
        """Under the lock: `w` is idle again, or replaced if it died (its replacement starts now)."""
        if w.proc.poll() is None:
            self._idle.append(w)
            self._idle_cv.notify()
            return
        self._all.remove(w)
        if not self._closed:
            self._spawn()

    def _run(self, w: _Worker, params, max_compile_s: float, max_forced: int) -> tuple[str | None, bool]:
        """(None or why, whether to cache it) for one check on worker `w`."""
        where = f"structured_outputs.{params.kind}"
        if not w.ready:
            hello = w.read(time.monotonic() + STARTUP_TIMEOUT_S)
            if hello is None:
                return (f"{where}: the grammar checker could not start ({w.death()}); "
                        "retry, or report it"), False
            w.ready = True
        fmt, text, reasoning = params.key
        if not w.send({"format": fmt, "text": text, "kind": params.kind, "max_forced_tokens": max_forced,
                       "after_reasoning": reasoning}):
            w.kill()
            return f"{where}: the grammar checker's worker died; retry", False
        answer = w.read(time.monotonic() + max_compile_s)
        if answer is not None:
            return answer.get("error"), True
        if w.timed_out:
            with self._lock:
                self.num_timeouts += 1
            return (f"{where} did not compile within max_grammar_compile_s={max_compile_s:g} s: "
                    "give a simpler schema or grammar, or raise --max-grammar-compile-s."), False
        with self._lock:
            self.num_crashes += 1
        return (f"{where} crashed the grammar compiler ({w.death()}): give a simpler schema or "
                "grammar (long chains of rules or $refs and deep nesting overflow it)."), True

    def stats(self) -> dict:
        with self._lock:
            return dict(checks=self.num_checks, crashes=self.num_crashes, check_timeouts=self.num_timeouts,
                        workers=len(self._all), queued=self._queued, cached_checks=len(self._cache))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all, self._idle = list(self._all), [], []
            self._idle_cv.notify_all()
            self._done_cv.notify_all()
        for w in workers:
            w.close()


_sandboxes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_sandboxes_lock = threading.Lock()


def sandbox_for(tokenizer, vocab_size: int | None = None, eos_token_id: int | None = None) -> GrammarSandbox:
    """The sandbox of a kvserve tokenizer (one per tokenizer object, size and EOS, started on
    first use and closed at exit). ValueError when the model has no tokenizer llguidance reads."""
    from kvserve.structured.compiler import JSON_OPTIONS, llg_vocab

    backend, size, eos = llg_vocab(tokenizer, vocab_size, eos_token_id)
    with _sandboxes_lock:
        per_tok = _sandboxes.setdefault(tokenizer, {})
        if (size, eos) not in per_tok:
            box = per_tok[size, eos] = GrammarSandbox(backend.to_str(), size, eos, JSON_OPTIONS)
            atexit.register(box.close)
            weakref.finalize(tokenizer, box.close)
        return per_tok[size, eos]
