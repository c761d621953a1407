"""A response as server-sent events, OpenAI's Responses stream (each event `event: <type>` and
its JSON, with `type` and a `sequence_number` from 0):

    response.created, response.in_progress
    per output item, as it first shows in the answer:
        message:       response.output_item.added, response.content_part.added,
                       response.output_text.delta ...
        function_call: response.output_item.added, response.function_call_arguments.delta ...
        reasoning:     response.output_item.added, response.reasoning_text.delta ... (--reasoning-parser)
    at the end, per item in order:
        message:       response.output_text.done, response.content_part.done, response.output_item.done
        function_call: response.function_call_arguments.done, response.output_item.done
        reasoning:     response.reasoning_text.done, response.output_item.done
    response.completed (status "completed") or response.incomplete (any other), whose response
    is what the same request gets unstreamed; a failure in the engine ends with response.failed.

The text is the choice output's deltas (server/openai/tool_output.py), as /v1/chat/completions
streams it.
"""
from __future__ import annotations

import json
from typing import Callable

from kvserve.server.openai.protocol import APIError
from kvserve.server.openai.responses.items import (
    OutputFunctionCall, OutputMessage, OutputReasoning, OutputTextPart, ReasoningTextPart, ResponseObject, finish,
    new_id, status_of, usage)


class _Events:
    def __init__(self):
        self.seq = 0

    def __call__(self, type_: str, **fields) -> str:
        body = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def stream_response(sub, shell: ResponseObject, output, done: Callable[[ResponseObject], None]):
    """The events of `sub`'s one engine request (its outputs are deltas); `output`: its
    ChoiceOutput; `done(final)` is called with the finished response before the last event."""
    ev = _Events()
    yield ev("response.created", response=shell.model_dump())
    yield ev("response.in_progress", response=shell.model_dump())
    items: list = []                            # OutputMessage | OutputFunctionCall, in order
    message: OutputMessage | None = None
    thought: OutputReasoning | None = None
    calls: dict[int, OutputFunctionCall] = {}   # the reader's call index -> its item
    prompt = cached = completion = 0
    finish_reason = None
    try:
        async for out in sub.outputs():
            prompt, cached = len(out.prompt_token_ids), out.num_cached_tokens or 0
            for c in out.outputs:
                completion += len(c.token_ids)
                finish_reason = c.finish_reason or finish_reason
                delta, _ = output.delta(c.text, c.finish_reason, c.token_ids)
                if delta.reasoning_content:
                    if thought is None:
                        thought = OutputReasoning(id=new_id("rs"), status="in_progress", content=[])
                        items.append(thought)
                        yield ev("response.output_item.added", output_index=len(items) - 1, item=thought.model_dump())
                        thought.content.append(ReasoningTextPart(text=""))
                    thought.content[0].text += delta.reasoning_content
                    yield ev("response.reasoning_text.delta", item_id=thought.id, output_index=items.index(thought),
                             content_index=0, delta=delta.reasoning_content)
                if delta.content:
                    if message is None:
                        message = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
                        items.append(message)
                        yield ev("response.output_item.added", output_index=len(items) - 1,
                                 item=message.model_dump())
                        part = OutputTextPart(text="")
                        yield ev("response.content_part.added", item_id=message.id, output_index=len(items) - 1,
                                 content_index=0, part=part.model_dump())
                        message.content.append(part)
                    message.content[0].text += delta.content
                    yield ev("response.output_text.delta", item_id=message.id, output_index=items.index(message),
                             content_index=0, delta=delta.content, logprobs=[])
                for d in delta.tool_calls or ():
                    call = calls.get(d.index)
                    if call is None:
                        call = calls[d.index] = OutputFunctionCall(
                            id=new_id("fc"), status="in_progress", call_id=d.id, name=d.function.name, arguments="")
                        items.append(call)
                        yield ev("response.output_item.added", output_index=len(items) - 1, item=call.model_dump())
                    if d.function is not None and d.function.arguments:
                        call.arguments += d.function.arguments
                        yield ev("response.function_call_arguments.delta", item_id=call.id,
                                 output_index=items.index(call), delta=d.function.arguments)
        status, _ = status_of(finish_reason)
        for i, item in enumerate(items):
            item.status = status
            if isinstance(item, OutputReasoning):
                yield ev("response.reasoning_text.done", item_id=item.id, output_index=i, content_index=0,
                         text=item.content[0].text)
            elif isinstance(item, OutputMessage):
                text = item.content[0].text
                yield ev("response.output_text.done", item_id=item.id, output_index=i, content_index=0,
                         text=text, logprobs=[])
                yield ev("response.content_part.done", item_id=item.id, output_index=i, content_index=0,
                         part=item.content[0].model_dump())
            else:
                yield ev("response.function_call_arguments.done", item_id=item.id, output_index=i,
                         name=item.name, arguments=item.arguments)
            yield ev("response.output_item.done", output_index=i, item=item.model_dump())
        final = finish(shell, finish_reason, items, usage(prompt, completion, cached, output.reasoning_tokens))
        done(final)
        yield ev("response.completed" if final.status == "completed" else "response.incomplete",
                 response=final.model_dump())
    except APIError as e:
        failed = shell.model_copy(update={"status": "failed", "error": {"code": "server_error", "message": e.message}})
        yield ev("response.failed", response=failed.model_dump())
    finally:
        sub.abort_unfinished()
