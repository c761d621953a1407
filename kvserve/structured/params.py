"""StructuredOutputsParams: what a request's output must match, as vLLM names it.

Exactly one field is set. The request is checked here for what needs no tokenizer (types, a JSON
text that parses, the size bound, and the rule, reference and depth bounds of bounds.py); the
grammar itself is checked by compiling it against the
model's tokenizer (`kvserve.structured.check_structured_outputs`, called by the frontend's
Processor). `key` is the canonical (format, text, after_reasoning) grammars are compiled and cached by.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, field

from kvserve.structured.bounds import check_bounds
from kvserve.structured.reasoning_grammar import LEADS as REASONING_LEADS

# The largest spec a request may give, in bytes of its canonical text (a JSON schema, a regex,
# a grammar, the JSON list of choices): compile time and matcher memory grow with it.
MAX_STRUCTURED_SPEC_BYTES = 128 * 1024
ANY_JSON_OBJECT = '{"type":"object"}'
FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A JSON schema (`json`: a dict or its JSON text; True means any JSON object), a regular
    expression (`regex`, Rust regex syntax, anchored at both ends), one of a list of strings
    (`choice`), a context-free grammar (`grammar`: Lark, or llama.cpp's GBNF) or any JSON object
    (`json_object=True`). Bad input raises ValueError."""

    json: dict | str | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # "deepseek_r1" or "qwen3": the constraint starts after the model's <think>...</think>
    # (--reasoning-parser; structured/reasoning_grammar.py)
    after_reasoning: str | None = None
    key: tuple[str, str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        given = [name for name in FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}.")
        if self.after_reasoning not in (None, *REASONING_LEADS):
            raise ValueError(f"structured_outputs.after_reasoning must be one of {', '.join(REASONING_LEADS)} "
                             f"(or None), got {self.after_reasoning!r}.")
        fmt, text = _canonical(given[0], getattr(self, given[0]))
        object.__setattr__(self, "key", (fmt, text, self.after_reasoning or ""))
        size = len(text.encode("utf-8"))
        if size > MAX_STRUCTURED_SPEC_BYTES:
            raise ValueError(f"structured_outputs.{given[0]} is {size} bytes; the limit is "
                             f"{MAX_STRUCTURED_SPEC_BYTES}: give a smaller schema or grammar.")
        check_bounds(given[0], fmt, text)

    @property
    def kind(self) -> str:
        """The field that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in FIELDS if getattr(self, name) is not None)


def _canonical(name: str, value) -> tuple[str, str]:
    """(llguidance's grammar format, the spec's canonical text) for the set field."""
    if name == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs.json_object must be True (or None), got {value!r}.")
        return "json_schema", ANY_JSON_OBJECT
    if name == "json":
        if value is True:
            return "json_schema", ANY_JSON_OBJECT
        if isinstance(value, str):
            try:
                value = _json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}.") from None
        if not isinstance(value, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (an object, or its JSON "
                             f"text) or True for any JSON object, got {type(value).__name__}.")
        try:
            # (keys keep their order: the grammar writes properties in the schema's order)
            return "json_schema", _json.dumps(value, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json is not a JSON value: {e}.") from None
    if name == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) for c in value)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings, "
                             f"got {value!r}.")
        return "choice", _json.dumps(list(value), separators=(",", ":"))
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}.")
    return name, value
