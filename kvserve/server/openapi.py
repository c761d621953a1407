"""`/openapi.json` with the request and response bodies.

The routes read their bodies themselves (server/body.py: Content-Type, size cap, UTF-8, JSON,
list lengths, then the pydantic model), so FastAPI cannot see the models; this module puts them
into the document: each POST route's request body is its pydantic request model, each route's
200 its response model (and `text/event-stream` for the streaming variant), and every error
status OpenAI's error shape. Schema-driven clients, code generators and fuzzers get the real
schema.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvserve.server.openai.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
    ErrorResponse, HealthResponse, ModelList)

REF = "#/components/schemas/{model}"
POST_ERRORS = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model",
               "413": "request body too large", "415": "Content-Type is not application/json",
               "500": "this request failed inside the server", "503": "overloaded or shutting down"}


def install_openapi(app: FastAPI, routes: dict[tuple[str, str], tuple]) -> None:
    """`routes`: (method, path) -> (request model or None, 200 response model or None,
    True if the 200 may be an SSE stream)."""

    def openapi():
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})

        def ref(model, mode: str) -> dict:
            s = model.model_json_schema(ref_template=REF, mode=mode)
            schemas.update(s.pop("$defs", {}))
            schemas[model.__name__] = s
            return {"$ref": REF.format(model=model.__name__)}

        error = {"content": {"application/json": {"schema": ref(ErrorResponse, "serialization")}}}
        for (method, path), (req_model, resp_model, streams) in routes.items():
            op = doc.get("paths", {}).get(path, {}).get(method)
            if op is None:
                continue
            ok: dict = {"description": "OK"}
            if resp_model is not None:
                ok["content"] = {"application/json": {"schema": ref(resp_model, "serialization")}}
                if streams:
                    ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
            op["responses"] = {"200": ok}
            if req_model is not None:
                op["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": ref(req_model, "validation")}}}
                for status, what in POST_ERRORS.items():
                    op["responses"][status] = {"description": what, **error}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi


ROUTES = {
    ("post", "/v1/completions"): (CompletionRequest, CompletionResponse, True),
    ("post", "/v1/chat/completions"): (ChatCompletionRequest, ChatCompletionResponse, True),
    ("get", "/v1/models"): (None, ModelList, False),
    ("get", "/health"): (None, HealthResponse, False),
}
