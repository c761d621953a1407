"""Requests waiting for their grammar (RequestStatus.WAITING_FOR_GRAMMAR): compiling off the loop.

The engine core hands a constrained request's sequences here instead of to the scheduler and
submits its grammar to the GrammarCompiler's worker. Every step, `take_ready()` returns the
requests whose compile has finished -- with the compiled matcher, or with the compiler's
error -- and those whose grammar is not ready `max_grammar_compile_s` after they arrived, with
a timeout error. Nothing here blocks the loop: a slow compile holds back only its own request.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass

from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.params import StructuredOutputsParams


@dataclass
class _Pending:
    seqs: list                    # the request's sequences, all WAITING_FOR_GRAMMAR
    future: cf.Future             # -> (compiled matcher, its vocabulary size); .started_at

    def deadline(self, max_compile_s: float) -> float:
        """time.monotonic() past which the request fails (inf while its compile is queued)."""
        started = getattr(self.future, "started_at", None)
        return float("inf") if started is None else started + max_compile_s


@dataclass
class GrammarReady:
    """A request that leaves the wait list: `compiled` (matcher, vocab size) or an `error`."""

    request_id: str
    seqs: list
    compiled: tuple | None = None
    error: str | None = None


class GrammarWaitList:
    def __init__(self, compiler: GrammarCompiler, max_compile_s: float):
        self.compiler = compiler
        self.max_compile_s = max_compile_s
        self._pending: dict[str, _Pending] = {}
        self.num_timeouts = 0

    def add(self, request_id: str, seqs: list, params: StructuredOutputsParams) -> None:
        self._pending[request_id] = _Pending(list(seqs), self.compiler.submit(params))

    def discard(self, request_id: str) -> None:
        """The request ended while waiting (aborted): forget it (its compile still fills the cache)."""
        self._pending.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def take_ready(self) -> list[GrammarReady]:
        """The requests whose grammar compiled, failed to compile, or ran out of time."""
        now, out = time.monotonic(), []
        for rid, p in list(self._pending.items()):
            if p.future.done():
                e = p.future.exception()
                out.append(GrammarReady(rid, p.seqs, None if e else p.future.result(),
                                        None if e is None else _message(e)))
            elif now >= p.deadline(self.max_compile_s):
                self.num_timeouts += 1
                out.append(GrammarReady(rid, p.seqs, error=(
                    f"the grammar did not compile within max_grammar_compile_s={self.max_compile_s:g} s: "
                    "give a simpler schema or grammar, or raise --max-grammar-compile-s.")))
            else:
                continue
            del self._pending[rid]
        return out

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes or a deadline passes, `timeout` seconds at most (the
        engine has nothing else to do: better than spinning on empty steps)."""
        if not self._pending:
            return
        first_deadline = min(p.deadline(self.max_compile_s) for p in self._pending.values())
        timeout = max(0.0, min(timeout, first_deadline - time.monotonic()))
        cf.wait([p.future for p in self._pending.values()], timeout, return_when=cf.FIRST_COMPLETED)

    def stats(self) -> dict:
        return dict(self.compiler.stats(), timeouts=self.num_timeouts,
                    num_waiting_for_grammar=sum(len(p.seqs) for p in self._pending.values()))


def _message(e: BaseException) -> str:
    return str(e) if isinstance(e, ValueError) else f"grammar compile failed: {type(e).__name__}: {e}"
