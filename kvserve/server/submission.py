"""The engine requests behind one HTTP request: one output collector for all of them
(server/collector.py), their outputs as they come (a stream's deltas, or each final output),
failures as APIErrors (a request that failed alone in the engine is a 500 naming it; one its own
grammar failed, a 400 `grammar_error`), and aborts when the client leaves."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from fastapi import Request

from kvserve.engine.request import GRAMMAR_ERROR
from kvserve.server.collector import RequestFailed, RequestOutputCollector
from kvserve.server.errors import internal_error
from kvserve.server.limits import ADD_CHUNK
from kvserve.server.openai.protocol import APIError

logger = logging.getLogger("kvserve.server")


class Submission:
    """The engine requests behind one HTTP request, all feeding one collector."""

    def __init__(self, state, prefix: str, stream: bool = False):
        self.state = state
        self.stream = stream
        self.collector = RequestOutputCollector()
        self.prefix = prefix
        self.request_ids: list[str] = []
        self.unfinished: set[str] = set()

    async def outputs(self) -> AsyncIterator:
        """Every engine request's outputs as they come: deltas when streaming, else the final."""
        while self.unfinished:
            item = await self.collector.get()
            if isinstance(item, RequestFailed):
                self.unfinished.discard(item.request_id)
                err = item.error
                if isinstance(err, APIError):
                    raise err
                raise internal_error("the engine failed", err)
            if item.finished:
                self.unfinished.discard(item.request_id)
                failed = next((c for c in item.outputs if c.finish_reason == "error"), None)
                if failed is not None and failed.error_code == GRAMMAR_ERROR:     # the user's grammar
                    raise APIError(f"the output's grammar failed: {failed.error}", 400,
                                   param="structured_outputs", code=GRAMMAR_ERROR)
                if failed is not None:       # this request alone failed in the engine
                    logger.error("request %s failed in the engine: %s", item.request_id, failed.error)
                    raise APIError(f"request {item.request_id} failed in the engine; the server "
                                   "keeps serving others", 500, type="server_error", code="request_failed")
            yield item

    async def add_all(self, items: list, request: Request | None = None) -> bool:
        """Queue an engine request for each (prompt, SamplingParams), ADD_CHUNK at a time: each
        chunk is queued at once and applied by the engine in one go, the event loop runs
        between chunks, and once the client has gone the rest is not added (False; the caller
        aborts what was). Raises the first refusal (400 / 503) of a chunk."""
        engine = self.state.core_client
        for start in range(0, len(items), ADD_CHUNK):
            if start and request is not None and await request.is_disconnected():
                return False
            adds = []
            for i, (item, params) in enumerate(items[start:start + ADD_CHUNK], start):
                rid = f"{self.prefix}-{i}"
                self.request_ids.append(rid)
                self.unfinished.add(rid)
                adds.append(engine.add_request(rid, item, params, self.collector,
                                               prompt_text=item.get("prompt"), stream=self.stream))
            results = await asyncio.gather(*adds, return_exceptions=True)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
        return True

    def abort_unfinished(self) -> None:
        for rid in list(self.unfinished):
            self.state.core_client.abort(rid)
        self.unfinished.clear()


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_or_disconnect(sub: Submission, request: Request) -> dict[str, object] | None:
    """Final output of every engine request, or None when the client went away first."""
    async def collect():
        final = {}
        async for out in sub.outputs():
            if out.finished:
                final[out.request_id] = out
        return final

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collector in done:
            return collector.result()
        collector.cancel()
        return None
    finally:
        watcher.cancel()
        if not collector.done():
            collector.cancel()
        sub.abort_unfinished()
