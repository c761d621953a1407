"""The Responses API's objects: the response (what it echoes of the request, its status and
usage) and its output items, and a conversation's items as the chat messages the template reads.

    one choice's ChatMessage (server/openai/tool_output.py)  ->  output items:
        reasoning   {"type": "reasoning", "content": [{"type": "reasoning_text", "text"}]} (--reasoning-parser)
        content     {"type": "message", "role": "assistant", "content": [{"type": "output_text", ...}]}
        tool calls  {"type": "function_call", "call_id", "name", "arguments"} each
    items  ->  chat messages:
        message               {"role", "content"}           (its text parts joined)
        function_call         an assistant message's tool_calls (calls in a row: one message)
        function_call_output  {"role": "tool", "tool_call_id", "content"}
        reasoning             left out (reasoning models' templates drop earlier thoughts)

A finish of "length" is status "incomplete" (`incomplete_details.reason` "max_output_tokens"),
an aborted one "cancelled"; every output item carries the response's status."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, TypeAdapter

from kvserve.server.openai.protocol import INVALID_TOOLS, NO_MESSAGE_CODE, APIError
from kvserve.server.openai.responses.protocol import (
    FunctionCallItem, FunctionCallOutputItem, FunctionToolChoice, InputItem, MessageItem, ResponsesRequest,
    text_of)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputTextPart(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str
    content: list[OutputTextPart]


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The model's thought (--reasoning-parser, server/openai/reasoning.py), ahead of its answer."""
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: str
    summary: list = Field(default_factory=list)
    content: list[ReasoningTextPart]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: str
    call_id: str
    name: str
    arguments: str


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict          # {"cached_tokens": n}
    output_tokens: int
    output_tokens_details: dict         # {"reasoning_tokens": n}
    total_tokens: int


class ResponseObject(BaseModel):
    """The response, as `POST /v1/responses` and `GET /v1/responses/{id}` give it."""
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: Optional[int] = None
    status: Literal["in_progress", "completed", "incomplete", "cancelled", "failed"]
    error: Optional[dict] = None                    # {"code", "message"} when failed
    incomplete_details: Optional[dict] = None       # {"reason": "max_output_tokens"}
    model: str
    output: list[Union[OutputReasoning, OutputMessage, OutputFunctionCall]] = Field(default_factory=list)
    usage: Optional[ResponseUsage] = None
    # the request's settings
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    metadata: dict = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    store: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Union[str, dict] = "auto"
    tools: list[dict] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    user: Optional[str] = None


def response_shell(req: ResponsesRequest, rid: str, model: str) -> ResponseObject:
    """The response before any output: in progress, echoing the request's settings."""
    choice: Any = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, FunctionToolChoice):
        choice = choice.model_dump()
    text = {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)} \
        if req.text is not None and req.text.format is not None else {"format": {"type": "text"}}
    return ResponseObject(
        id=rid, created_at=int(time.time()), status="in_progress", model=model,
        instructions=req.instructions, max_output_tokens=req.max_output_tokens, metadata=req.metadata or {},
        parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
        store=req.store, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, text=text, tool_choice=choice,
        tools=[t.model_dump() for t in req.tools or ()], user=req.user)


def usage(prompt: int, completion: int, cached: int, reasoning: int = 0) -> ResponseUsage:
    """`reasoning`: how many of the output tokens are the thought's (--reasoning-parser)."""
    return ResponseUsage(input_tokens=prompt, input_tokens_details={"cached_tokens": cached},
                         output_tokens=completion, output_tokens_details={"reasoning_tokens": reasoning},
                         total_tokens=prompt + completion)


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a choice's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def finish(resp: ResponseObject, finish_reason: str | None, output: list, use: ResponseUsage) -> ResponseObject:
    """`resp` done: its status, output and usage."""
    status, details = status_of(finish_reason)
    return resp.model_copy(update={"status": status, "incomplete_details": details, "output": output,
                                   "usage": use, "completed_at": int(time.time()) if status == "completed" else None})


def output_items(content: str | None, calls, status: str, reasoning: str | None = None) -> list:
    """The output items of one answer: its thought, its content as a message, then each tool call."""
    items: list = []
    if reasoning:
        items.append(OutputReasoning(id=new_id("rs"), status=status, content=[ReasoningTextPart(text=reasoning)]))
    if content:
        items.append(OutputMessage(id=new_id("msg"), status=status, content=[OutputTextPart(text=content)]))
    for c in calls or ():
        items.append(OutputFunctionCall(id=new_id("fc"), status=status, call_id=c.id, name=c.function.name,
                                        arguments=c.function.arguments))
    return items


_ITEMS = TypeAdapter(list[InputItem])


def as_input_items(output: list) -> list:
    """A response's output items as input items (for the next turn of the conversation)."""
    return _ITEMS.validate_python([o.model_dump() for o in output])


def chat_messages(instructions: str | None, items: list) -> list[dict]:
    """The conversation's chat messages (ChatMessageParam's shape): the instructions as a system
    message first. A function_call_output must answer a call made earlier in the conversation."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions is not None else []
    calls: set[str] = set()
    for it in items:
        if isinstance(it, MessageItem):
            out.append({"role": it.role, "content": text_of(it.content)})
        elif isinstance(it, FunctionCallItem):
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments}}
            calls.add(it.call_id)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(it, FunctionCallOutputItem):
            if it.call_id not in calls:
                raise APIError(f"input: the function_call_output of call_id {it.call_id!r} answers no "
                               "function_call before it in the conversation", param="input", code=INVALID_TOOLS)
            out.append({"role": "tool", "tool_call_id": it.call_id, "content": text_of(it.output)})
    if not out:             # (only reasoning items, which are left out)
        raise APIError("input holds no message, only reasoning items: give a message too", param="input",
                       code=NO_MESSAGE_CODE)
    return out
