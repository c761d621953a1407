"""Rules between two fields of a request, which no field's own type or bounds can state.

`Implies` (`top_logprobs` needs `logprobs: true`) is one definition for two uses: the served
schema's JSON Schema `if`/`then` (in the request model's `allOf`) and the check run once the
fields validated, so /openapi.json and the server cannot disagree on it. `min_tokens` against
`max_tokens` compares two numbers, which JSON Schema cannot: it is one of the
semantic 400s of docs/serving/fields.md, with its own error code.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from pydantic_core import PydanticCustomError

RULE_ERROR = "cross_field"           # pydantic error types, read by body.py
MIN_TOKENS_CODE = "min_tokens_exceeds_max_tokens"
CONSTRAINTS_CODE = "conflicting_output_constraints"
# vLLM's and llama-server's extension fields (server/openai/extension_fields.py): a llama-server
# alias given beside kvserve's name with another value, and their rules between fields
EXTENSION_RULE_CODE = "extension_field_conflict"
NOT_NULL = {"not": {"type": "null"}}


class Implies(NamedTuple):
    """When `field` holds a value `when` admits, `other` must be `need`. `when` is a JSON Schema:
    `{"const": v}`, `NOT_NULL` (any value but null) or `{"not": {"enum": [...]}}` (any other value)."""
    field: str
    when: dict
    other: str
    need: Any
    message: str

    def applies(self, value) -> bool:
        if self.when is NOT_NULL:
            return value is not None
        if "not" in self.when:
            return value not in self.when["not"]["enum"]
        return value == self.when["const"]

    def json_schema(self, other_default) -> dict:
        then: dict = {"properties": {self.other: {"const": self.need}}}
        if other_default != self.need:            # left out, `other` takes its default
            then["required"] = [self.other]
        return {"if": {"properties": {self.field: self.when}, "required": [self.field]}, "then": then}


def check_rules(req, rules: tuple[Implies, ...]) -> None:
    """Raise the first rule `req` breaks as a pydantic error (param: the rule's field)."""
    for rule in rules:
        if rule.applies(getattr(req, rule.field)) and getattr(req, rule.other) != rule.need:
            raise PydanticCustomError(RULE_ERROR, rule.message, {"param": rule.field})


def rules_schema(rules: tuple[Implies, ...]):
    """A `json_schema_extra` that adds `rules` to a model's schema as an `allOf` of if/then."""
    def extra(schema: dict, model) -> None:
        schema["allOf"] = [r.json_schema(model.model_fields[r.other].default) for r in rules]
    return extra


def min_tokens_error(min_tokens: int, max_tokens: int) -> PydanticCustomError:
    """min_tokens > max_tokens: two fields no JSON Schema can compare (docs/serving/fields.md)."""
    return PydanticCustomError(MIN_TOKENS_CODE, "min_tokens ({min_tokens}) must not exceed max_tokens "
                               "({max_tokens})", {"param": "min_tokens", "min_tokens": min_tokens,
                                                  "max_tokens": max_tokens})


def conflicting_constraints_error(given: list[str]) -> PydanticCustomError:
    """Two output constraints at once (server/openai/structured_fields.py). A rule over eight nullable
    fields, which JSON Schema can state but its generators (schemathesis) cannot take: one of
    docs/serving/fields.md's semantic 400s, with its own error code."""
    return PydanticCustomError(CONSTRAINTS_CODE, "give at most one output constraint: got {given}",
                               {"param": given[1], "given": " and ".join(given)})
