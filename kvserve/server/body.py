"""Reading a POST body, in order and each step bounded: the API key, the Content-Type
(`application/json` only: a browser's cross-site "simple" request -- `text/plain`, a form, or no
type at all -- gets 415, as FastAPI's own body handling refuses it), the size cap, UTF-8, JSON
(standard JSON only: NaN and Infinity are refused, and so are numbers over Python's 4300-digit
limit and nesting too deep to parse), the lengths of list fields (server/limits.py), then the
pydantic schema and the model name. Each failure is a 4xx in OpenAI's shape."""
from __future__ import annotations

import hmac
import json

from fastapi import Request
from pydantic import ValidationError

from kvserve.server.protocol import APIError, validation_error_to_api_error

MAX_BODY_BYTES = 32 * 1024 * 1024


def check_auth(state, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    # Header values reach us decoded as latin-1: back to the bytes the client sent, which a
    # UTF-8 client made from a non-ASCII key, and compared as bytes in constant time.
    sent = token.strip().encode("latin-1", "replace")
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent, state.api_key_bytes):
        state.metrics.reject("unauthorized")
        raise APIError("invalid or missing API key: send 'Authorization: Bearer <key>'", 401,
                       code="invalid_api_key")


def api_key_bytes(api_key: str) -> bytes:
    return api_key.encode("utf-8", "surrogateescape")    # argv's undecodable bytes as they were


def check_content_type(request: Request) -> None:
    given = request.headers.get("content-type", "")
    media = given.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise APIError(f"Content-Type must be application/json, got {given!r}" if given else
                   "Content-Type must be application/json (the request has none)", 415,
                   code="unsupported_media_type")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def loads(text: str):
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise APIError(f"malformed JSON in the request body: {e}") from None
    except RecursionError:
        raise APIError("the request body's JSON is nested too deeply") from None
    except ValueError as e:     # NaN / Infinity, or an integer over Python's digit limit
        raise APIError(f"invalid JSON in the request body: {e}") from None


async def parse_body(state, request: Request, model_cls):
    check_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(f"request body over {MAX_BODY_BYTES} bytes", 413)
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(f"request body over {MAX_BODY_BYTES} bytes", 413)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not valid UTF-8 (byte {e.start})") from None
    obj = loads(text)
    if not isinstance(obj, dict):
        raise APIError("the request body must be a JSON object")
    state.limits.check_list_lengths(obj)
    try:
        req = model_cls.model_validate(obj)
    except ValidationError as e:
        raise validation_error_to_api_error(e) from None
    except RecursionError:
        raise APIError("the request body's JSON is nested too deeply") from None
    if req.model is not None and req.model not in (state.model_name, state.engine.config.model):
        raise APIError(f"the model {req.model!r} does not exist; this server serves "
                       f"{state.model_name!r}", 404, param="model", code="model_not_found")
    return req
