"""Server-sent events for /v1/completions and /v1/chat/completions: one path for both.

The outputs of a stream are deltas (frontend/output_processor.py, output kind "delta"): each
holds only the text, token ids and logprobs one engine step added, so a chunk costs what its
step made, whatever the stream's length. `_chunks` walks them once for both endpoints, keeping
per sequence the few tokens of context a logprob's text is read in (server/openai/logprobs.py)
and the counts usage needs; each endpoint only shapes its chunk. A chunk goes out for every step
that produced tokens, even when their text is held back (a partial UTF-8 character, a possible
stop string), so chunk times are token times for a benchmark client.
"""
from __future__ import annotations

import json

from kvserve.server.openai.logprobs import (CONTEXT_TOKENS, chat_logprobs, completion_logprobs, echo_logprobs,
                                            without_tokens)
from kvserve.server.openai.protocol import (
    APIError, ChatChoiceLogprobs, ChatCompletionStreamChoice, ChatCompletionStreamResponse, CompletionChoice,
    CompletionStreamResponse, DeltaMessage, UsageInfo)
from kvserve.server.openai.tool_output import ChoiceOutput

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(num_prompt: int, num_completion: int, num_cached: int | None) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                     total_tokens=num_prompt + num_completion,
                     prompt_tokens_details={"cached_tokens": num_cached} if num_cached is not None else None)


def usage_of(outputs: list, include_cached: bool = True) -> UsageInfo:
    """The usage of finished outputs: their prompts, completions and prefix-cache hits."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outputs)
    return usage(prompt, completion, cached if include_cached else None)


class _Counts:
    def __init__(self):
        self.prompt: dict[str, int] = {}
        self.completion = 0
        self.cached: dict[str, int] = {}

    def usage(self) -> UsageInfo:
        return usage(sum(self.prompt.values()), self.completion, sum(self.cached.values()))


async def _chunks(sub, counts: _Counts):
    """(output, completion delta, context tokens before it) for every sequence delta of every
    engine request of `sub`, in the order they come; the context is the last CONTEXT_TOKENS
    tokens (prompt, then earlier output) before the delta's first token."""
    tails: dict[tuple[str, int], list[int]] = {}
    async for out in sub.outputs():
        counts.prompt[out.request_id] = len(out.prompt_token_ids)
        counts.cached[out.request_id] = out.num_cached_tokens or 0
        for c in out.outputs:
            key = (out.request_id, c.index)
            tail = tails.get(key)
            if tail is None:
                tail = list(out.prompt_token_ids[-CONTEXT_TOKENS:])
            counts.completion += len(c.token_ids)
            yield out, c, tail
            tails[key] = (tail + list(c.token_ids))[-CONTEXT_TOKENS:]


def _chunk(response_cls, rid: str, created: int, model: str, choices, usage_info=None,
           strip_delta: bool = False) -> str:
    """One SSE chunk; `usage` only on the last one, and (chat) a delta without its unset keys."""
    obj = response_cls(id=rid, created=created, model=model, choices=choices, usage=usage_info).model_dump()
    if usage_info is None:
        obj.pop("usage")
    if strip_delta:
        for ch in obj["choices"]:
            ch["delta"] = _without_none(ch["delta"])
    return sse(obj)


def _without_none(value):
    """A delta without its unset keys, nested ones too (the SDK concatenates every string it is sent)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def _running_usage(req, counts: _Counts) -> UsageInfo | None:
    """vLLM's `stream_options.continuous_usage_stats`: every chunk carries the usage so far."""
    return counts.usage() if req.stream_options and req.stream_options.continuous_usage_stats else None


async def _events(body, chunk, req, counts: _Counts, sub):
    """The stream around an endpoint's chunks: the usage chunk when asked, [DONE], an engine
    error as an error event, and the engine requests aborted however the stream ends."""
    try:
        async for line in body:
            yield line
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], counts.usage())
        yield "data: [DONE]\n\n"
    except APIError as e:
        yield sse(e.body())
        yield "data: [DONE]\n\n"
    finally:
        sub.abort_unfinished()


def stream_completions(state, req, sub, rid_prefix: str, created: int, index_of: dict,
                       prompt_texts: list[str]):
    counts = _Counts()
    offsets: dict[tuple[str, int], int] = {}

    def chunk(choices, usage_info=None):
        return _chunk(CompletionStreamResponse, rid_prefix, created, state.model_name, choices,
                      usage_info or _running_usage(req, counts))

    async def body():
        # echo: the prompt's text first; with logprobs, once its prompt logprobs are in.
        echo_pending = set(index_of.values()) if req.echo else set()
        if req.echo and req.logprobs is None:
            for pi, text in enumerate(prompt_texts):
                for j in range(req.n):
                    yield chunk([CompletionChoice(index=pi * req.n + j, text=text)])
            echo_pending.clear()
        async for out, c, tail in _chunks(sub, counts):
            pi = index_of[out.request_id]
            if pi in echo_pending:
                echo_pending.discard(pi)
                lp = echo_logprobs(state, out, None, req.logprobs, req.skip_special_tokens,
                                   req.return_tokens_as_token_ids)
                for j in range(req.n):
                    offsets[(out.request_id, j)] = sum(len(t) for t in lp.tokens)
                    yield chunk([CompletionChoice(index=pi * req.n + j, text=prompt_texts[pi], logprobs=lp)])
            if req.max_tokens == 0:
                counts.completion -= len(c.token_ids)
                c = without_tokens(c)
            key = (out.request_id, c.index)
            lp = None
            if req.logprobs is not None and c.logprobs and c.token_ids:
                lp = completion_logprobs(state, tail, c.token_ids, c.logprobs, offsets.get(key, 0),
                                         req.logprobs, req.skip_special_tokens, req.return_tokens_as_token_ids)
                offsets[key] = offsets.get(key, 0) + sum(len(t) for t in lp.tokens)
            yield chunk([CompletionChoice(index=pi * req.n + c.index, text=c.text, logprobs=lp,
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)])

    return _events(body(), chunk, req, counts, sub)


def stream_chat(state, req, sub, rid: str, created: int, k: int, new_output=ChoiceOutput,
                echo: str | None = None):
    """`new_output()`: a choice's output (server/openai/tool_output.py): plain content, or its tool calls.
    `echo`: text each choice starts with (chat's echo), sent first."""
    counts = _Counts()

    def chunk(choices, usage_info=None):
        return _chunk(ChatCompletionStreamResponse, rid, created, state.model_name, choices,
                      usage_info or _running_usage(req, counts), strip_delta=True)

    async def body():
        outputs: dict[int, ChoiceOutput] = {}
        if echo is not None:
            for i in range(req.n):
                outputs[i] = new_output()
                yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=echo))])
        async for out, c, tail in _chunks(sub, counts):
            lp = None
            if req.logprobs and c.logprobs and c.token_ids:
                lp = ChatChoiceLogprobs(content=chat_logprobs(state, tail, c.token_ids, c.logprobs, k,
                                                              req.skip_special_tokens, req.return_tokens_as_token_ids))
            # The role on the first chunk of each choice, the finish reason on its last.
            first = c.index not in outputs
            if first:
                outputs[c.index] = new_output()
            delta, finish_reason = outputs[c.index].delta(c.text, c.finish_reason, c.token_ids)
            delta.role = "assistant" if first else None
            yield chunk([ChatCompletionStreamChoice(index=c.index, delta=delta, logprobs=lp,
                                                    finish_reason=finish_reason, stop_reason=c.stop_reason)])

    return _events(body(), chunk, req, counts, sub)
