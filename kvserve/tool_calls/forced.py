"""`tool_choice="required"` and a named function: the call is enforced by a JSON schema built
from the functions' parameter schemas (so it works on any model), and read back as it streams.

    named:     the arguments object itself          schema: the function's parameters
    required:  [{"name": ..., "parameters": {...}}, ...]   one or more (one without
               parallel_tool_calls), each item the name of one function and its parameters

(vLLM's shapes.) An object schema that leaves `additionalProperties` open is closed: the
arguments hold the declared parameters only (OpenAI's strict function calling), so a small model
cannot wander off into properties nobody asked for. The engine masks every token that would
leave the schema, so the text is always a prefix of valid JSON of that shape, and the readers
below stream it: the name first, then each step's argument text as a fragment."""
from __future__ import annotations

import json

from kvserve.tool_calls.base import CallDelta, Update, call_id

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples"})     # keys whose values are data


def parameters_of(function: dict) -> dict:
    """The function's parameter schema, its open objects closed (module docstring)."""
    return closed(function.get("parameters") or EMPTY_PARAMETERS)


def closed(schema):
    """`schema` with `"additionalProperties": false` on every object schema that does not say."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _NOT_SCHEMAS else closed(v) for k, v in schema.items()}
    kind = schema.get("type")
    if (kind == "object" or isinstance(kind, list) and "object" in kind) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def required_schema(functions: list[dict], parallel: bool) -> dict:
    """The JSON schema of `tool_choice="required"` over `functions` ({"name", "parameters"})."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                               "parameters": parameters_of(f)},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema = {"type": "array", "minItems": 1,
              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedCall:
    """The whole output is the arguments of one call of `name`."""

    def __init__(self, name: str):
        self.name = name
        self.started = False

    def feed(self, delta: str) -> Update:
        piece = CallDelta(0, delta)
        if not self.started:
            self.started = True
            piece.id, piece.name = call_id(), self.name
        return Update(calls=[piece])

    def finish(self) -> Update:
        return self.feed("") if not self.started else Update()


class RequiredCalls:
    """An incremental reader of `[{"name": "f", "parameters": {...}}, ...]`: each item's name
    once its string closes, and the raw text of its `parameters` value as it comes (held until
    the name is known, should the model write the keys the other way round)."""

    def __init__(self):
        self.depth = 0                  # [ and { open around the current character: 2 = in a call
        self.index = -1                 # the call being read
        self.in_string = self.escape = False
        self.key_text: str | None = None    # the raw text of a key being read
        self.key: str | None = None         # a key read, its value not yet begun
        self.value_key: str | None = None   # the key whose value is being read
        self.value = ""                     # that value's raw text so far
        self.nesting = 0                    # brackets open inside that value
        self.names: dict[int, str] = {}
        self.pending: dict[int, str] = {}   # argument text of a call whose name is not out yet

    def feed(self, delta: str) -> Update:
        out = Update()
        for ch in delta:
            if self.value_key is not None and self._value_char(ch, out):
                continue
            self._structure_char(ch)
        return out

    def finish(self) -> Update:
        return Update()

    def _value_char(self, ch: str, out: Update) -> bool:
        """Read `ch` as part of a value; False when it ends a scalar without being part of it."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
        elif self.nesting == 0 and self.value and ch in ",}":
            self._value_done(out)
            return False
        elif ch.isspace() and not self.value:
            return True
        elif ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.nesting += 1
        elif ch in "]}":
            self.nesting -= 1
        self.value += ch
        if self.value_key == "parameters":
            self._arguments(ch, out)
        if self.nesting == 0 and not self.in_string and (ch in "]}" or ch == '"'):
            self._value_done(out)
        return True

    def _structure_char(self, ch: str) -> None:
        if self.key_text is not None:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.key = json.loads(f'"{self.key_text}"')
                self.key_text = None
                return
            self.key_text += ch
        elif ch == '"' and self.depth == 2:
            self.key_text = ""
        elif ch == ":" and self.depth == 2 and self.key is not None:
            self.value_key, self.key, self.value, self.nesting = self.key, None, "", 0
        elif ch in "[{":
            self.depth += 1
            self.index += self.depth == 2
        elif ch in "]}":
            self.depth -= 1

    def _value_done(self, out: Update) -> None:
        if self.value_key == "name":
            name = json.loads(self.value)
            self.names[self.index] = name
            out.calls.append(CallDelta(self.index, self.pending.pop(self.index, ""), call_id(), name))
        self.value_key = None

    def _arguments(self, text: str, out: Update) -> None:
        if self.index not in self.names:
            self.pending[self.index] = self.pending.get(self.index, "") + text
        elif out.calls and out.calls[-1].index == self.index:
            out.calls[-1].arguments += text
        else:
            out.calls.append(CallDelta(self.index, text))
