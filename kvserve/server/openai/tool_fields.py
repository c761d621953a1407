"""OpenAI's tool-calling schemas: the request's `tools` and `tool_choice`, the history's
assistant `tool_calls` and `tool` messages, and the calls of a response (whole, and as a
stream's deltas). What is done with them is server/openai/tool_choice.py's."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, Field, WithJsonSchema

from kvserve.server.openai.wire_types import Strict, Text

MAX_TOOLS = 128                     # OpenAI's limit
MAX_TOOL_CALLS_PER_MESSAGE = 128
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]     # OpenAI's
OBJECT_SCHEMA = {"type": "object", "properties": {"type": {"const": "object"}}, "required": ["type"]}


def _object_schema(schema: dict) -> dict:
    if schema.get("type") != "object":
        raise ValueError('a function\'s parameters must be a JSON Schema of an object ({"type": '
                         '"object", "properties": {...}})')
    return schema


ParametersSchema = Annotated[dict, AfterValidator(_object_schema), WithJsonSchema(OBJECT_SCHEMA)]


class FunctionDefinition(Strict):
    name: FunctionName
    description: Optional[Text] = None
    parameters: Optional[ParametersSchema] = None       # absent: no parameters
    strict: Optional[bool] = None


class ToolParam(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class FunctionCallParam(Strict):
    name: Text
    arguments: Text                         # JSON text of the arguments (as the model wrote them)


class ToolCallParam(Strict):
    id: Text
    type: Literal["function"]
    function: FunctionCallParam


class ToolFields(Strict):
    """The chat request's tool fields."""
    tools: Optional[Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[ToolChoice] = None        # default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True


ToolCallsParam = Annotated[list[ToolCallParam], Field(max_length=MAX_TOOL_CALLS_PER_MESSAGE)]


# ---------------------------------------------------------------- responses


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    """A piece of call `index`: id, type and name on its first piece, then argument text."""
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None
