"""Structured-outputs checks for the server: off the event loop, fair between tenants.

`await GrammarChecks.check(params, tenant)` before a constrained request is processed: its spec
goes to the grammar sandbox (structured/sandbox.py: worker processes, so a crashing or hanging
compile never touches this process), admitted on the loop and run on a thread of a pool as
large as the sandbox's bound, so nothing waits unbounded and the loop never blocks (/health
answers while a 100 KB schema compiles). Refusals: a spec that does not compile, has no finite
output, crashes or outlasts --max-grammar-compile-s is a 400 `invalid_structured_output`; a
tenant with PER_OWNER checks in flight is a 429 `too_many_grammar_compiles`, and a full queue a
503 `server_overloaded`, both with Retry-After. The Processor's own check then finds the
outcome cached.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from kvserve.server.openai.protocol import INVALID_STRUCTURED_OUTPUT, APIError
from kvserve.structured import GrammarBusy, GrammarRejected
from kvserve.structured.sandbox import sandbox_for

class GrammarChecks:
    def __init__(self, tokenizer, limits):
        self.limits = limits
        self._box = None
        self._pool: ThreadPoolExecutor | None = None
        try:
            self._box = sandbox_for(tokenizer, limits.vocab_size)
        except ValueError:          # no tokenizer llguidance reads: the Processor says so per request
            return
        self._pool = ThreadPoolExecutor(self._box.max_queued + self._box.num_workers,
                                        thread_name_prefix="kvserve-grammar-check")

    def start(self) -> None:
        """Start the sandbox's workers with the server, so no request waits for one to start."""
        if self._box is not None:
            self._box.start()

    async def check(self, params, tenant: str | None) -> None:
        """APIError (400 / 429 / 503) unless `params` (StructuredOutputsParams) passes."""
        if self._box is None:
            return
        lim = self.limits
        try:
            ticket = self._box.admit(params, lim.max_model_len, tenant)
            if ticket is not None:
                await asyncio.get_running_loop().run_in_executor(
                    self._pool, self._box.run, ticket, lim.max_grammar_compile_s)
        except GrammarRejected as e:
            raise APIError(str(e), code=INVALID_STRUCTURED_OUTPUT) from None
        except GrammarBusy as e:
            if e.scope == "owner":
                raise APIError(f"too many grammar compiles: {e}", 429, type="rate_limit_error",
                               code="too_many_grammar_compiles", headers={"Retry-After": "1"}) from None
            raise APIError(f"the server is overloaded: {e}", 503, type="server_error",
                           code="server_overloaded", headers={"Retry-After": "1"}) from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
