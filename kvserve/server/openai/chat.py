"""`POST /v1/chat/completions`: the messages rendered with the chat template (and the tools,
server/openai/tool_choice.py), one engine request with `n` samples, and each choice's text as an
assistant message -- content, or tool calls (server/openai/tool_output.py) -- whole or streamed."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.frontend.processor import ContextLengthError
from kvserve.server.limits import context_error
from kvserve.server.openai.chat_renderer import render_options, request_renderer, template_messages
from kvserve.server.openai.logprobs import chat_logprobs, prompt_logprobs_table
from kvserve.server.openai.prompts import engine_salt, max_tokens_for, request_ids, truncate_prompt
from kvserve.server.openai.protocol import (
    APIError, ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse)
from kvserve.server.openai.sampling import sampling_params
from kvserve.server.openai.streaming import SSE_HEADERS, stream_chat, usage_of
from kvserve.server.submission import Submission, collect_or_disconnect
from kvserve.server.openai.tool_choice import tool_plan
from kvserve.server.openai.tool_output import ChoiceOutput


@dataclass
class ChatJob:
    """A chat request made ready for the engine: its prompt, its SamplingParams, how each choice's
    text becomes a message (`new_output()`), and chat's `echo` text."""
    text: str
    ids: list[int]
    params: object
    new_output: Callable[[], ChoiceOutput]
    echo: str | None


async def chat_prompt(state, req, request=None):
    """(tool plan, template messages, prompt text, token ids) of a chat request -- or of anything
    with its prompt fields (messages, tools, tool_choice, add_generation_prompt,
    continue_final_message, chat_template_kwargs, add_special_tokens: /tokenize's) -- rendered
    and tokenized off the event loop when large, the text bounded before it is tokenized.
    `request`: the HTTP request, told of the template variables left out (render_options)."""
    if state.chat is None:
        raise APIError("this model has no tokenizer, so chat is not available; use /v1/completions "
                       "with token ids")
    plan = tool_plan(req, state.tool_call_parser, state.tokenizer)
    tools = plan.template_tools
    messages = template_messages(req)
    size = sum(len(m["content"]) for m in messages) + sum(len(str(t)) for t in tools or ())
    chat = request_renderer(state, req)         # (vLLM's request chat_template, documents)
    options = render_options(chat, req, request)
    text = await state.tokenization.call(size, lambda: chat.render(
        messages, req.add_generation_prompt, tools, **options))
    try:
        state.tokenization.check_text_fits(text)
    except ContextLengthError as e:
        raise context_error(e) from None
    ids = await state.tokenization.call(len(text), lambda: chat.encode_chat(
        text, messages, req.add_generation_prompt, tools, req.add_special_tokens, **options))
    return plan, messages, text, ids


async def prepare_chat(state, req: ChatCompletionRequest, renames: dict | None = None,
                       request=None) -> ChatJob:
    """Render, tokenize (off the event loop when large) and bound `req`; `renames` maps chat's
    field names to a caller's in the context-length error (the Responses API's)."""
    plan, messages, text, ids = await chat_prompt(state, req, request)
    plan.check_generating()
    kept = truncate_prompt(state, req, ids)      # vLLM's truncate_prompt_tokens
    text, ids = (text, ids) if kept is ids else (None, kept)
    try:
        max_tokens = max_tokens_for(state, len(ids), req.requested_max_tokens(), req.min_tokens)
        cap = state.generation_defaults.get("max_tokens")      # generation_config's max_new_tokens
        if req.requested_max_tokens() is None and cap is not None:
            max_tokens = max(min(max_tokens, cap), req.min_tokens)
    except APIError as e:
        for old, new in (renames or {}).items():
            e.param = new if e.param == old else e.param
            e.message = e.message.replace(old, new)
        raise
    k = req.top_logprobs or 0
    # A parser's markers may be special tokens: kept in the text, unless the request says.
    keep_special = plan.keeps_special_tokens and "skip_special_tokens" not in req.model_fields_set
    constraint = plan.constraint or req.constraint()
    if constraint is not None and state.reasoning is not None:     # the answer's, after the thought
        constraint = {**constraint, "after_reasoning": state.reasoning.name}
    params = sampling_params(req, max_tokens, k if req.logprobs else None, req.prompt_logprobs, defaults=state.generation_defaults,
                             constraint=constraint, keep_special_tokens=keep_special)
    # vLLM's echo: an answer to a conversation ending in the assistant's own words starts with them.
    echo = messages[-1]["content"] if req.echo and messages[-1]["role"] == "assistant" else None
    stop_text = special_text(state.tokenizer) if keep_special else None
    decode = functools.partial(state.tokenizer.decode, skip_special_tokens=False)    # (the thought's tokens)
    return ChatJob(text, ids, params, lambda: ChoiceOutput(plan.reader(), stop_text, state.reasoning, decode), echo)


async def submit(state, sub: Submission, job: ChatJob, cache_salt: str | None, request: Request) -> bool:
    """Queue the job's one engine request; False when the client left first (aborted)."""
    try:
        item = {"prompt_token_ids": job.ids, "prompt": job.text}
        if cache_salt is not None:
            item["cache_salt"] = cache_salt
        if not await sub.add_all([(item, job.params)], request):
            sub.abort_unfinished()
            return False
    except BaseException:
        sub.abort_unfinished()      # rejected, or the client left while we waited
        raise
    return True


async def chat_completions(state, req: ChatCompletionRequest, request: Request):
    job = await prepare_chat(state, req, request=request)
    k = req.top_logprobs or 0
    new_output, echo = job.new_output, job.echo
    rid, engine_prefix, headers = request_ids("chatcmpl", req, request)
    created = int(time.time())
    sub = Submission(state, engine_prefix, stream=req.stream)
    if not await submit(state, sub, job, engine_salt(req), request):
        return Response(status_code=499)

    if req.stream:
        return StreamingResponse(stream_chat(state, req, sub, rid, created, k, new_output, echo),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    final = await collect_or_disconnect(sub, request)
    if final is None:
        return Response(status_code=499)
    out = final[sub.request_ids[0]]
    choices = []
    for c in out.outputs:
        lp = None
        if req.logprobs and c.logprobs is not None:
            lp = ChatChoiceLogprobs(content=chat_logprobs(state, out.prompt_token_ids, c.token_ids, c.logprobs, k,
                                                          req.skip_special_tokens, req.return_tokens_as_token_ids))
        message, finish_reason = new_output().message(c.text, c.finish_reason, c.token_ids)
        if echo is not None and message.content is not None:
            message.content = echo + message.content
        choices.append(ChatCompletionChoice(index=c.index, message=message, logprobs=lp,
                                            finish_reason=finish_reason, stop_reason=c.stop_reason))
    plp = prompt_logprobs_table(state, out, req.return_tokens_as_token_ids) if req.prompt_logprobs is not None else None
    body = ChatCompletionResponse(id=rid, created=created, model=state.model_name, choices=choices,
                                  usage=usage_of([out]), prompt_logprobs=plp).model_dump()
    return JSONResponse(body, headers=headers) if headers else body


def special_text(tokenizer):
    """token id -> the text a special token writes ("" for any other token)."""
    special = getattr(tokenizer, "special_ids", frozenset())
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False) if token_id in special else ""
