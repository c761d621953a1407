"""Error responses: OpenAI's `{"error": {...}}` shape for every status, headers kept (405's
`Allow`, 503's `Retry-After`), and no internal detail in any body.

A failure inside the server (an unexpected exception, an engine that died) is logged with its
traceback under a short error id; the client gets a 500/503 naming that id and nothing of the
exception itself -- no reprs, paths or tensor shapes leak to an unauthenticated client, and an
operator can still find the cause from the id in the body.
"""
from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.server.openai.protocol import APIError

logger = logging.getLogger("kvserve.server")


def new_error_id() -> str:
    return f"err-{uuid.uuid4().hex[:16]}"


def internal_error(what: str, exc: BaseException | None, status_code: int = 500,
                   code: str | None = None) -> APIError:
    """An APIError for a failure inside the server: `exc` goes to the log under a new id, the
    client gets `what` and the id."""
    eid = new_error_id()
    logger.error("%s [%s]: %r", what, eid, exc,
                 exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)
    return APIError(f"{what} (error id {eid}; the server log has the details)", status_code,
                    type="server_error", code=code)


class EngineFailureReport:
    """One error id per engine failure, for /health and the 503s that follow it."""

    def __init__(self):
        self._seen: BaseException | None = None
        self._id = ""

    def error_id(self, dead: BaseException) -> str:
        if dead is not self._seen:
            self._seen, self._id = dead, new_error_id()
            logger.error("the engine has failed [%s]: %r", self._id, dead)
        return self._id

    def message(self, dead: BaseException) -> str:
        return (f"the engine has failed and is not serving (error id {self.error_id(dead)}; the "
                "server log has the details)")


def error_response(state, exc: APIError) -> JSONResponse:
    if exc.code == "engine_dead" and state.core_client.dead is not None:
        # The refusal's message names the exception: keep it in the log, not in the body.
        exc = APIError(state.engine_failure.message(state.core_client.dead), exc.status_code,
                       type=exc.type, code=exc.code, headers=exc.headers)
    if 400 <= exc.status_code < 500 and exc.status_code != 401:
        state.metrics.reject("bad_request")
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


def install_error_handlers(app: FastAPI, state) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(state, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(state, APIError(str(exc.detail), exc.status_code, code=code,
                                              headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return error_response(state, internal_error("internal server error", exc))
