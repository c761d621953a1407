"""Graceful shutdown with an answer at the deadline (`kvserve serve --shutdown-timeout`)."""
from __future__ import annotations

import asyncio
import logging

import uvicorn

from kvserve.server.openai.protocol import APIError

# Seconds handlers get, after the shutdown deadline failed their requests, to send that answer.
ANSWER_GRACE_S = 2.0


class DeadlineServer(uvicorn.Server):
    """uvicorn's graceful shutdown (stop accepting; in-flight requests run on), with an answer
    at the deadline: when `shutdown_timeout` expires, the requests still in flight fail with 503
    `shutting_down` (a JSON body, or an SSE error event and `[DONE]`) and their KV blocks are
    freed, instead of uvicorn cutting their connections (a text/plain 500, or a stream ended
    mid-chunk). Give uvicorn's own `timeout_graceful_shutdown` ANSWER_GRACE_S more."""

    def __init__(self, config: uvicorn.Config, frontend, shutdown_timeout: float):
        super().__init__(config)
        self.frontend, self.shutdown_timeout = frontend, shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        deadline = asyncio.ensure_future(self._fail_at_deadline())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _fail_at_deadline(self) -> None:
        await asyncio.sleep(self.shutdown_timeout)
        logging.getLogger("kvserve.server").warning(
            "--shutdown-timeout (%.0f s) expired: failing the requests still in flight",
            self.shutdown_timeout)
        self.frontend.fail_in_flight(APIError("the server is shutting down", status_code=503,
                                              type="server_error", code="shutting_down"))
