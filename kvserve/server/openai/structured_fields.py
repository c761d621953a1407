"""The request fields that constrain the output, on both endpoints, and the one
`StructuredOutputsParams` they become (the engine masks every token that would leave it):

    response_format {"type": "json_object"}                  OpenAI's: any JSON object
    response_format {"type": "json_object", "schema": {...}} llama-server's: that schema
    response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format {"type": "text"}                         no constraint
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}   vLLM's
    guided_json, guided_regex, guided_choice, guided_grammar     vLLM's older names
    json_schema, grammar (GBNF)                                   llama.cpp server's

At most one may be given (else a 400 naming them, code `conflicting_output_constraints`), and
`structured_outputs` holds exactly one key. A `json_schema`'s schema is enforced whether
`strict` is true or not. A schema, regex or grammar the compiler refuses is the engine's
ValueError: a 400 (`engine_rejected`) before anything is queued.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import ConfigDict, Field, model_validator

from kvserve.server.openai.wire_types import Strict, Text

MAX_CHOICES = 1024
Choices = Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)]
JsonSchemaValue = Union[dict, Text]         # a schema, or its JSON text (vLLM takes both)


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]
    schema_: Optional[dict] = Field(None, alias="schema")     # llama-server's: the object's schema


class JsonSchemaSpec(Strict):
    name: Annotated[Text, Field(min_length=1, max_length=64)]
    description: Optional[Text] = None
    schema_: dict = Field(alias="schema")
    strict: Optional[bool] = None           # the schema is enforced either way


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of its keys. vLLM's others (`structural_tag`,
    `whitespace_pattern`, `disable_*`) are refused, not ignored."""
    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1, "maxProperties": 1})

    json_: Union[dict, Text, Literal[True]] = Field(None, alias="json")    # True: any JSON object
    regex: Text = None
    choice: Choices = None
    grammar: Text = None                    # EBNF / GBNF
    json_object: Literal[True] = None

    @model_validator(mode="after")
    def _one_key(self):
        if len(self.model_fields_set) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self

    def params_kwargs(self) -> dict:
        (name,) = self.model_fields_set
        return {"json" if name == "json_" else name: getattr(self, name)}


class ConstraintFields(Strict):
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[JsonSchemaValue] = None
    guided_regex: Optional[Text] = None
    guided_choice: Optional[Choices] = None
    guided_grammar: Optional[Text] = None
    json_schema: Optional[dict] = None      # llama.cpp's
    grammar: Optional[Text] = None          # llama.cpp's GBNF

    def given_constraints(self) -> list[str]:
        """The constraint fields set (a response_format of type text is none)."""
        rf = self.response_format
        given = ["response_format"] if isinstance(rf, (JsonObjectFormat, JsonSchemaFormat)) else []
        return given + [f for f in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                    "guided_grammar", "json_schema", "grammar") if getattr(self, f) is not None]

    def constraint(self) -> dict | None:
        """The `StructuredOutputsParams` keyword of the one constraint given, or None."""
        rf = self.response_format
        if isinstance(rf, JsonObjectFormat):
            return {"json_object": True} if rf.schema_ is None else {"json": rf.schema_}
        if isinstance(rf, JsonSchemaFormat):
            return {"json": rf.json_schema.schema_}
        if self.structured_outputs is not None:
            return self.structured_outputs.params_kwargs()
        for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar"), ("json_schema", "json"), ("grammar", "grammar")):
            value = getattr(self, field)
            if value is not None:
                return {key: value}
        return None
