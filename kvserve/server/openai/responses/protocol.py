"""`POST /v1/responses`'s request schema (OpenAI's Responses API, the part kvserve serves):

    model, input (a string, or items: messages, function_call, function_call_output),
    instructions, max_output_tokens, temperature, top_p, stream, previous_response_id, store,
    tools (function tools), tool_choice, parallel_tool_calls, text.format, metadata, user,
    cache_salt (vLLM's)

Every other field is refused with a 400 naming it (the model forbids unknown fields, so the
served schema says so too); `reasoning`, `include`, `background` and `truncation` are taken only
at the value that asks for nothing (null, [], false, "disabled"). Errors name the Responses
field (`input.2.content`), without pydantic's union members (`ResponsesRequest.model_validate`
raises the APIError itself, which body.py's `parse_body` passes on)."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationError

from kvserve.sample.params import INT64_MAX, MAX_TEMPERATURE
from kvserve.server.openai.protocol import MAX_CACHE_SALT_CHARS, MAX_CONTENT_PARTS, MAX_MESSAGES, APIError
from kvserve.server.openai.tool_fields import MAX_TOOLS, FunctionName, ParametersSchema
from kvserve.server.openai.wire_types import Strict, Text

MAX_METADATA_PAIRS = 16           # OpenAI's limits on metadata
Id = Annotated[Text, Field(min_length=1, max_length=256)]
ItemStatus = Optional[Literal["in_progress", "completed", "incomplete"]]


# ---------------------------------------------------------------- input items


class InputText(Strict):
    type: Literal["input_text"]
    text: Text


class OutputText(Strict):
    """An assistant's text as a response gave it (its annotations and logprobs describe it)."""
    type: Literal["output_text"]
    text: Text
    annotations: Optional[list] = None
    logprobs: Optional[list] = None


ContentPart = Annotated[Union[InputText, OutputText], Field(discriminator="type")]
Content = Union[Text, Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]]


def text_of(content) -> str:
    """A message's content as one text (its parts joined, as chat joins them)."""
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(Strict):
    type: Optional[Literal["message"]] = None       # (absent in the SDK's easy input messages)
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: Optional[Id] = None
    status: ItemStatus = None


class FunctionCallItem(Strict):
    """A call the model made (a previous response's output item, sent back)."""
    type: Literal["function_call"]
    call_id: Id
    name: FunctionName
    arguments: Text                     # JSON text, as the model wrote it
    id: Optional[Id] = None
    status: ItemStatus = None


class FunctionCallOutputItem(Strict):
    """The result of call `call_id`: a tool message."""
    type: Literal["function_call_output"]
    call_id: Id
    output: Union[Text, Annotated[list[InputText], Field(max_length=MAX_CONTENT_PARTS)]]
    id: Optional[Id] = None
    status: ItemStatus = None


class ReasoningTextInput(Strict):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(Strict):
    """A thought of a previous response (--reasoning-parser), sent back: accepted, and left out of
    the next prompt, as reasoning models' chat templates leave out earlier turns' thoughts."""
    type: Literal["reasoning"]
    id: Optional[Id] = None
    summary: Annotated[list, Field(max_length=MAX_CONTENT_PARTS)] = []
    content: Optional[Annotated[list[ReasoningTextInput], Field(max_length=MAX_CONTENT_PARTS)]] = None
    encrypted_content: Optional[Text] = None
    status: ItemStatus = None


def _item_kind(value) -> str | None:
    if isinstance(value, dict):
        return value.get("type") or "message"
    return getattr(value, "type", None) or "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_kind)]


# ---------------------------------------------------------------- tools and text


class FunctionTool(Strict):
    type: Literal["function"]
    name: FunctionName
    description: Optional[Text] = None
    parameters: Optional[ParametersSchema] = None
    strict: Optional[bool] = None       # absent: not enforced under "auto" (chat's rule)

    def chat_tool(self) -> dict:
        f = {"name": self.name, "description": self.description, "parameters": self.parameters,
             "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in f.items() if v is not None}}


class FunctionToolChoice(Strict):
    type: Literal["function"]
    name: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], FunctionToolChoice]


class TextFormatText(Strict):
    type: Literal["text"]


class TextFormatJsonObject(Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(Strict):
    type: Literal["json_schema"]
    name: Annotated[Text, Field(min_length=1, max_length=64)]
    schema_: dict = Field(alias="schema")
    description: Optional[Text] = None
    strict: Optional[bool] = None       # the schema is enforced either way


TextFormat = Annotated[Union[TextFormatText, TextFormatJsonObject, TextFormatJsonSchema],
                       Field(discriminator="type")]


class TextConfig(Strict):
    model_config = ConfigDict(extra="forbid")
    format: Optional[TextFormat] = None

    def response_format(self) -> dict | None:
        """chat's `response_format` of this format (None for plain text)."""
        f = self.format
        if isinstance(f, TextFormatJsonObject):
            return {"type": "json_object"}
        if isinstance(f, TextFormatJsonSchema):
            spec = {"name": f.name, "schema": f.schema_, "description": f.description, "strict": f.strict}
            return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
        return None


# ---------------------------------------------------------------- the request


class ResponsesRequest(Strict):
    """`POST /v1/responses`."""
    model_config = ConfigDict(extra="forbid")

    model: Optional[Text] = None
    input: Union[Text, Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]]
    instructions: Optional[Text] = None         # a system message before the conversation
    max_output_tokens: Optional[int] = Field(None, ge=1, le=INT64_MAX)
    temperature: Optional[float] = Field(None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    previous_response_id: Optional[Id] = None
    store: bool = True
    tools: Optional[Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[ToolChoice] = None    # default: "auto" with tools, else "none"
    parallel_tool_calls: Optional[bool] = None  # null: true
    text: Optional[TextConfig] = None
    metadata: Optional[Annotated[dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
                                 Field(max_length=MAX_METADATA_PAIRS)]] = None
    user: Optional[Text] = None
    cache_salt: Optional[Text] = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)  # vLLM's
    # OpenAI's fields kvserve does not do: only the value that asks for nothing.
    reasoning: None = None
    include: Optional[Annotated[list, Field(max_length=0)]] = None
    background: Optional[Literal[False]] = None
    truncation: Optional[Literal["disabled"]] = None

    @classmethod
    def model_validate(cls, obj, *args, **kwargs):
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as e:
            raise request_error(e) from None

    def input_items(self) -> list:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def forced_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, FunctionToolChoice)


# ---------------------------------------------------------------- errors

_UNSUPPORTED = {
    "reasoning": "not supported (the effort is the model's own; a server started with --reasoning-parser returns its thought as a reasoning item)",
    "include": "not supported (no extra output data is available: send [] or leave it out)",
    "background": "not supported (responses run in the foreground: send false or leave it out)",
    "truncation": 'only "disabled" is supported: kvserve never drops input; a conversation '
                  "over the context window is a 400",
    "conversation": "not supported (use previous_response_id)",
    "prompt": "not supported (no stored prompt templates)",
    "max_tool_calls": "not supported",
    "top_logprobs": "not supported on /v1/responses (use /v1/chat/completions)",
    "service_tier": "not supported",
    "stream_options": "not supported",
}
_HINTS = {
    "input": "expected a string or a list of input items",
    "tool_choice": 'expected "none", "auto", "required" or {"type": "function", "name": ...}',
    "output": "expected a string or a list of {\"type\": \"input_text\", \"text\": ...} parts",
    "content": "expected a string or a list of input_text / output_text parts; only text is supported",
}
# Discriminated unions' tags, which pydantic puts into an error's place after the item's index
# (or after `format`).
_TAGS = {"message", "function_call", "function_call_output", "input_text", "output_text",
         "text", "json_object", "json_schema"}


def _place(loc: tuple) -> list:
    """An error's place without pydantic's union members ('str', 'list[...]') and tags."""
    out = []
    for i, x in enumerate(loc):
        member = isinstance(x, str) and (x in ("str", "int", "bool", "float", "none") or x[:1].isupper()
                                         or "[" in x or x.startswith("function-"))   # (a model's name)
        tag = x in _TAGS and i > 0 and (isinstance(loc[i - 1], int) or loc[i - 1] == "format")
        if not (member or tag):
            out.append(x)
    return out


def _shape(e: dict) -> bool:
    return e["type"].endswith("_type") or e["type"] in ("literal_error", "missing", "none_required")


def request_error(err: ValidationError) -> APIError:
    """The first error, named by its place in the Responses request."""
    errors = err.errors()
    first = errors[0]
    same = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    union = len(same) > 1
    if union:               # the union member the value got furthest in
        first = max(same, key=lambda e: (len(_place(e["loc"])), not _shape(e)))
    loc = _place(first["loc"])
    param = ".".join(map(str, loc)) or None
    top = str(loc[0]) if loc else ""
    msg = first["msg"].removeprefix("Value error, ")
    if top in _UNSUPPORTED and len(loc) == 1:
        msg = _UNSUPPORTED[top]
    elif top == "metadata":
        param, msg = "metadata", (f"at most {MAX_METADATA_PAIRS} pairs of strings, keys of at most 64 "
                                  "characters and values of at most 512")
    elif first["type"] == "extra_forbidden":
        msg = ("not supported (text takes only format)" if top == "text" else
               "not supported by kvserve's /v1/responses (see the API reference for the fields it takes)")
    elif first["type"] == "union_tag_invalid":
        msg = f"unknown type {first['ctx']['tag']!r} (expected one of {first['ctx']['expected_tags']})"
    elif top == "tools" and loc[-1] == "type" and first["type"] == "literal_error":
        msg = ("only function tools are supported (built-in tools such as web_search, file_search "
               "or mcp are not)")
    elif top == "tool_choice" and loc[-1] == "type" and first["type"] == "literal_error":
        msg = f"only function tools can be chosen ({_HINTS['tool_choice']})"
    elif union and _shape(first) and str(loc[-1]) in _HINTS:
        msg = f"invalid type ({_HINTS[str(loc[-1])]})"
    return APIError(f"{param}: {msg}" if param else msg, param=param)
