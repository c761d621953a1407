"""Reading a POST body, in order and each step bounded: the API key, the Content-Type
(`application/json` only: a browser's cross-site "simple" request -- `text/plain`, a form, or no
type at all -- gets 415, as FastAPI's own body handling refuses it), the size cap, UTF-8, JSON
(standard JSON only: NaN and Infinity are refused, and so are numbers over Python's 4300-digit
limit and nesting too deep to parse), the lengths of list fields (server/limits.py), then the
pydantic schema and the model name. Each failure is a 4xx in OpenAI's shape.

A JSON number with an integral value (`4.0`, `1e3`) is parsed as an integer, as JSON Schema
counts it, so an `integer` field takes it; the request models are strict otherwise (no `"4"`
for a number, no `0` for a boolean), as their served schema says (server/openai/protocol.py)."""
from __future__ import annotations

import hmac
import json
import logging
from decimal import Decimal

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvserve.server.openai.chat_fields import REFUSED
from kvserve.server.openai.protocol import APIError
from kvserve.server.openai.request_rules import CONSTRAINTS_CODE, EXTENSION_RULE_CODE, MIN_TOKENS_CODE, RULE_ERROR

MAX_BODY_BYTES = 32 * 1024 * 1024
IGNORED_FIELDS_HEADER = "kvserve-ignored-fields"
_IGNORED_KEY = "kvserve_ignored_fields"
MAX_NAMED_IGNORED = 16

logger = logging.getLogger("kvserve.server")


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


def _number(literal: str) -> int | float:
    """A JSON number with a fraction or exponent: an int when its value is integral."""
    f = float(literal)
    if abs(f) < 2.0**70:         # larger ones stay floats (and out of every integer field's range)
        d = Decimal(literal)
        if d == d.to_integral_value():
            return int(d)
    return f


def loads(text: str):
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_number)
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
    if req.model is not None and req.model not in (state.model_name, state.engine.config.model.model):
        raise APIError(f"the model {req.model!r} does not exist; this server serves "
                       f"{state.model_name!r}", 404, param="model", code="model_not_found")
    ignored = unknown_fields(req, obj)
    if ignored:     # accepted (newer clients send newer fields) but said: the log and a header
        logger.warning("%s %s: ignored the unknown request fields %s", request.method, request.url.path, ignored)
        setattr(request.state, _IGNORED_KEY, ignored)
    return req


def note_ignored(request, names: list[str], why: str) -> None:
    """More fields of an accepted request that have no effect (`why`): logged and named in the
    `kvserve-ignored-fields` header beside the unknown ones. `request` None (no HTTP request): nothing."""
    if request is None or not names:
        return
    logger.warning("%s %s: ignored %s: %s", request.method, request.url.path, names, why)
    setattr(request.state, _IGNORED_KEY, [*getattr(request.state, _IGNORED_KEY, []), *names])


def unknown_fields(model, raw, path: str = "") -> list[str]:
    """The keys of the JSON `raw` that `model` (a parsed request or part) has no field for, as
    paths ("foo", "messages[0].bar"), nested parts included."""
    if isinstance(model, BaseModel) and isinstance(raw, dict):
        fields = type(model).model_fields
        by_key = {f.alias or name: name for name, f in fields.items()}
        out = [f"{path}{k}" for k in raw if k not in by_key]
        for key, name in by_key.items():
            if key in raw:
                out += unknown_fields(getattr(model, name), raw[key], f"{path}{key}.")
        return out
    if isinstance(model, list) and isinstance(raw, list) and model and isinstance(model[0], BaseModel):
        return [u for i, (m, r) in enumerate(zip(model, raw))
                for u in unknown_fields(m, r, f"{path[:-1]}[{i}].")]
    return []


def _header_safe(name: str) -> str:
    """A field name as ASCII with control characters escaped; quoted when empty or when it
    starts or ends with a space (a header value may not)."""
    text = json.dumps(name)[1:-1]
    return text if text and text == text.strip() else json.dumps(name)


class IgnoredFieldsHeader:
    """ASGI middleware: a response to a request with unknown fields names them (up to
    MAX_NAMED_IGNORED, escaped to ASCII) in the `kvserve-ignored-fields` header."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            ignored = scope.get("state", {}).get(_IGNORED_KEY)
            if message["type"] == "http.response.start" and ignored:
                names = [_header_safe(n[:64]) for n in ignored[:MAX_NAMED_IGNORED]]
                value = ", ".join(names) + (", ..." if len(ignored) > MAX_NAMED_IGNORED else "")
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (IGNORED_FIELDS_HEADER.encode(), value.encode("ascii"))]}
            await send(message)
        await self.app(scope, receive, send_named)


def validation_error_to_api_error(err: ValidationError) -> APIError:
    """The first pydantic error as a one-line message naming the offending field."""
    errors = err.errors()
    first = errors[0]
    if first["type"] in (RULE_ERROR, MIN_TOKENS_CODE, CONSTRAINTS_CODE, EXTENSION_RULE_CODE):
        param = ".".join([*map(str, _loc(first)), first["ctx"]["param"]])    # (a message's rule: its place)
        return APIError(f"{param}: {first['msg']}", param=param,
                        code=None if first["type"] == RULE_ERROR else first["type"])
    same_field = [e for e in errors if e.get("loc", ())[:1] == first.get("loc", ())[:1]]
    union = len(same_field) > 1 and any(_is_union_tag(x) for x in first.get("loc", ()))
    if union:       # the member the value had the shape of, if any: its constraint is the news
        first = next((e for e in same_field if not _is_shape_error(e)), first)
    loc = _loc(first)
    param = ".".join(str(x) for x in loc) or None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if union and _is_shape_error(first):
        msg = f"invalid type ({_UNION_HINTS.get(str(loc[-1]), 'see the API reference')})"
    elif first["type"] in ("too_long", "literal_error", "none_required") and loc and str(loc[0]) in _UNSUPPORTED:
        param = str(loc[0])
        msg = _UNSUPPORTED[param]
    elif first["type"] == "string_pattern_mismatch" and loc and loc[0] == "logit_bias":
        msg = "logit_bias keys must be token ids written as strings, such as \"50256\""
    elif first["type"] == "extra_forbidden":
        parent = str(loc[-2]) if len(loc) > 1 else ""
        msg = f"not supported (the object takes only {_ALLOWED.get(parent, 'the documented keys')})"
    elif first["type"] == "union_tag_invalid":
        msg = f"unknown type {first['ctx']['tag']!r} (expected one of {first['ctx']['expected_tags']})"
    elif first["type"] == "too_short" and first.get("input") in ([], ""):
        msg = f"must not be empty ({msg})"
    return APIError(f"{param}: {msg}" if param else msg, param=param)


def _loc(error: dict) -> list:
    """The error's place, without pydantic's union members (and a tagged union's tag)."""
    loc = list(error.get("loc", ()))
    for i in range(len(loc) - 1, 0, -1):
        if loc[i - 1] in _TAGGED_UNIONS:
            del loc[i]
    return [x for x in loc if not _is_union_tag(x)]


_TAGGED_UNIONS = ("response_format",)
_ALLOWED = {"structured_outputs": "json, regex, choice, grammar or json_object"}
_UNION_HINTS = {
    "prompt": "expected a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "expected a string or a list of strings",
    "content": "expected a string or a list of {\"type\": \"text\", \"text\": ...} parts; "
               "only text is supported",
    "tool_choice": "expected \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}",
}
_UNSUPPORTED = {"suffix": "suffix is not supported",
                "best_of": "best_of is not supported beyond 1 (use n for more samples)", **REFUSED}


def _is_shape_error(e: dict) -> bool:
    """The value is not of this union member's kind at all (a type or a literal mismatch)."""
    return e["type"].endswith("_type") or e["type"] in ("literal_error", "missing")


def _is_union_tag(x) -> bool:
    # pydantic puts the union member it tried into `loc` (e.g. 'str', 'list[int]').
    return isinstance(x, str) and (x in ("str", "int", "bool", "float") or "[" in x
                                   or x.startswith("function-"))
