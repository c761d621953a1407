"""`POST /v1/responses`, OpenAI's Responses API over the chat machinery, and the stored responses:

    POST   /v1/responses                 create (JSON, or SSE with "stream": true)
    GET    /v1/responses/{response_id}   a stored response
    DELETE /v1/responses/{response_id}   forget it

A request becomes a chat request (`chat_request`): its conversation -- the instructions as a
system message, the previous response's conversation (`previous_response_id`), then `input` --
as messages, its function tools as chat tools, `text.format` as `response_format`,
`max_output_tokens` as `max_completion_tokens`. From there it is /v1/chat/completions' path
(server/openai/chat.py): the chat template, `tool_plan` (server/openai/tool_choice.py), the
output constraint, one engine request, and its text read by a `ChoiceOutput`
(server/openai/tool_output.py) into a message item and function_call items
(server/openai/responses/items.py), whole or streamed (server/openai/responses/streaming.py).

Authentication, rate limits and tenancy are the chat route's (server/tenants.py); the answer
caches are not used. With `store` (the default) the response is kept
(server/openai/responses/store.py) for its tenant, within the tenant's quota, where another
tenant's burst evicts only that tenant's own; an unknown `previous_response_id` is a 400 naming
it. The answer names its id in the `kvserve-response-id` header, so a router in front of
replicas sends the continuations to this one (fleet/response_holders.py).
"""
from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvserve.server.body import parse_body, validation_error_to_api_error
from kvserve.server.openai.chat import prepare_chat, submit
from kvserve.server.openai.protocol import CONSTRAINTS_CODE, MAX_MESSAGES, APIError, ChatCompletionRequest
from kvserve.server.openai.responses.items import (
    ResponseObject, as_input_items, chat_messages, finish, new_id, output_items, response_shell, status_of, usage)
from kvserve.server.openai.responses.protocol import FunctionToolChoice, ResponsesRequest
from kvserve.server.openai.responses.store import RESPONSE_ID_HEADER, ResponseStore
from kvserve.server.openai.responses.streaming import stream_response
from kvserve.server.openai.streaming import SSE_HEADERS
from kvserve.server.submission import Submission, collect_or_disconnect

logger = logging.getLogger("kvserve.server")
NOT_FOUND = "response_not_found"
PREVIOUS_NOT_FOUND = "previous_response_not_found"
ROUTES = {      # for server/openapi.py
    ("post", "/v1/responses"): (ResponsesRequest, ResponseObject, True),
    ("get", "/v1/responses/{response_id}"): (None, ResponseObject, False),
}


def install(app, state, store: ResponseStore | None = None) -> None:
    store = state.responses = store if store is not None else ResponseStore()

    @app.post("/v1/responses")
    async def create(request: Request):
        tenant = state.tenancy.authenticate(request)
        req = await parse_body(state, request, ResponsesRequest)
        state.tenancy.begin(tenant, req)
        return await create_response(state, store, req, request, tenant.name)

    path = "/v1/responses/{response_id}"

    @app.get(path)
    async def retrieve(response_id: str, request: Request):
        tenant = state.tenancy.authenticate(request, limit=False)
        asked = sorted(set(request.query_params) & {"stream", "include", "include[]", "starting_after"})
        if asked:
            raise APIError(f"{asked[0]}: not supported (a stored response is returned whole)", param=asked[0])
        entry = store.get(response_id, tenant.name)
        if entry is None:
            raise _not_found(response_id)
        return JSONResponse(entry.response)

    @app.delete(path)
    async def delete(response_id: str, request: Request):
        tenant = state.tenancy.authenticate(request, limit=False)
        if not store.delete(response_id, tenant.name):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return APIError(f"no stored response has the id {response_id!r}", 404, param="response_id", code=NOT_FOUND)


def conversation(store: ResponseStore, req: ResponsesRequest, tenant: str) -> list:
    """The conversation's input items: the previous response's (its input and output), then `input`."""
    items = req.input_items()
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id, tenant)
        if prev is None:
            raise APIError(f"previous_response_id: no stored response has the id {req.previous_response_id!r} "
                           "(it was made with store false, evicted, deleted, or never existed)",
                           param="previous_response_id", code=PREVIOUS_NOT_FOUND)
        items = list(prev.items) + items
    if len(items) > MAX_MESSAGES:
        raise APIError(f"input: the conversation has {len(items)} items with the previous response's, over "
                       f"{MAX_MESSAGES}", param="input")
    return items


def chat_request(req: ResponsesRequest, items: list) -> ChatCompletionRequest:
    """The chat request this response is made as."""
    if req.forced_tool_call() and req.text is not None and req.text.response_format() is not None:
        raise APIError("text.format: give at most one output constraint, got tool_choice and text.format (a forced "
                       "call's arguments follow the function's schema)", param="text.format",
                       code=CONSTRAINTS_CODE)
    choice = req.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    body = {"messages": chat_messages(req.instructions, items),
            "tools": [t.chat_tool() for t in req.tools] if req.tools else None,
            "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "response_format": req.text.response_format() if req.text is not None else None,
            "temperature": req.temperature, "top_p": req.top_p,
            "max_completion_tokens": req.max_output_tokens, "user": req.user, "cache_salt": req.cache_salt,
            "stream": req.stream}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:        # (the Responses schema admits no body chat refuses)
        raise validation_error_to_api_error(e) from None


async def create_response(state, store: ResponseStore, req: ResponsesRequest, request: Request, tenant: str):
    if state.chat is None:
        raise APIError("this model has no tokenizer, so /v1/responses is not available; use "
                       "/v1/completions with token ids")
    items = conversation(store, req, tenant)
    chat = chat_request(req, items)
    job = await prepare_chat(state, chat, {"max_tokens": "max_output_tokens", "prompt": "input"})
    output = job.new_output()
    rid = new_id("resp")
    shell = response_shell(req, rid, state.model_name)
    sub = Submission(state, rid, stream=req.stream)
    if not await submit(state, sub, job, req.cache_salt, request):
        return Response(status_code=499)

    def done(final) -> None:
        if req.store and final.status in ("completed", "incomplete"):
            try:
                turn = as_input_items(final.output)
            except ValidationError:         # (an output no request could send back)
                logger.warning("response %s is not stored: its output is not valid input", final.id)
                return
            store.put(tenant, final.model_dump(), items + turn)

    if req.stream:
        return StreamingResponse(stream_response(sub, shell, output, done), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, RESPONSE_ID_HEADER: rid})
    final = await collect_or_disconnect(sub, request)
    if final is None:
        return Response(status_code=499)
    out = final[sub.request_ids[0]]
    c = out.outputs[0]
    message, _ = output.message(c.text, c.finish_reason, c.token_ids)
    status, _ = status_of(c.finish_reason)
    resp = finish(shell, c.finish_reason, output_items(message.content, message.tool_calls, status,
                                                       message.reasoning_content),
                  usage(len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens or 0,
                        output.reasoning_tokens))
    done(resp)
    return JSONResponse(resp.model_dump(), headers={RESPONSE_ID_HEADER: rid})
