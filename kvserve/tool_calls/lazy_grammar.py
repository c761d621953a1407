"""Strict functions under tool_choice "auto": llama.cpp's lazy grammar, in llguidance's Lark.
The model writes what it likes until it opens a call with its parser's marker; from there the
call is held to one of the functions (a strict function's parameters exactly, as
tool_calls/forced.py closes them; any other's to a JSON object), and after it only more calls
(with parallel_tool_calls) or the end may follow, so a call always parses and validates.

    hermes       text <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    mistral      text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    llama3_json  [<|python_tag|>]{"name": ..., "parameters": {...}}; ...   (the whole answer), or
                 content that does not open with "{" or "<"

Text with no call never holds the marker (llguidance's `&`/`~` terminals), so a marker always
starts a call. A marker the tokenizer has as one token (llguidance reads added tokens as
special) is that token too (`<[id]>`; `tokens` from structured/reasoning_grammar.marker_tokens).
"""
from __future__ import annotations

import json
import re

from kvserve.tool_calls.forced import parameters_of
from kvserve.tool_calls.hermes import END as HERMES_END
from kvserve.tool_calls.hermes import START as HERMES_START
from kvserve.tool_calls.llama3_json import PYTHON_TAG
from kvserve.tool_calls.mistral import MARKER as MISTRAL_MARKER

# JSON as the forced calls write it (structured/compiler.py's JSON_OPTIONS)
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MARKERS = {"hermes": (HERMES_START, HERMES_END), "mistral": (MISTRAL_MARKER,), "llama3_json": (PYTHON_TAG,)}


def _rx(text: str) -> str:
    """`text` as a regex inside Lark's /.../."""
    return re.sub(r"([\\.+*?()|\[\]{}^$/-])", r"\\\1", text)


def _marker(text: str, tokens: dict[str, int]) -> str:
    """A Lark alternative for a marker: its text, or its one token."""
    return json.dumps(text) + (f" | <[{tokens[text]}]>" if text in tokens else "")


def _call_schema(functions: list[dict], arguments_key: str) -> dict:
    calls = [{"type": "object", "properties": {
                 "name": {"const": f["name"]},
                 arguments_key: parameters_of(f) if f.get("strict") else {"type": "object"}},
              "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


def lazy_call_grammar(parser: str, functions: list[dict], parallel: bool, tokens: dict[str, int]) -> str:
    """The Lark grammar of an "auto" answer whose calls keep to `functions` ({"name", "parameters",
    "strict"}) in `parser`'s syntax."""
    if parser not in MARKERS:
        raise ValueError(f"no lazy tool-call grammar for the parser {parser!r}")
    if parser == "llama3_json":
        call = _json(_call_schema(functions, "parameters"))
        more = '(";" ws call)*' if parallel else ""
        rules = ["start: CONTENT | ws (tag)? call " + more, f"tag: {_marker(PYTHON_TAG, tokens)}",
                 f"call: {call}", "CONTENT: /(?s:[^{<\\s].*)/"]
    else:
        opening = MARKERS[parser][0]
        if parser == "hermes":
            call = f"ws {_json(_call_schema(functions, 'arguments'))} ws close"
            closing = [f"close: {_marker(HERMES_END, tokens)}"]
        else:
            schema = {"type": "array", "minItems": 1, "items": _call_schema(functions, "arguments")}
            if not parallel:
                schema["maxItems"] = 1
            call, closing = f"ws {_json(schema)}", []
        more = "(ws open call)*" if parallel and parser == "hermes" else ""
        head = "head_text" + (f" | FREE <[{tokens[opening]}]>" if opening in tokens else "")
        rules = ["start: FREE | head call " + more, f"head: {head}",
                 f"head_text[lazy]: /(?s:.*){_rx(opening)}/", f"open: {_marker(opening, tokens)}",
                 f"call: {call}", *closing,
                 f"FREE: /(?s:.*)/ & ~/(?s:.*){_rx(opening)}(?s:.*)/"]
    return "%llguidance {}\n" + "\n".join([*rules, "ws: /[ \\t\\r\\n]{0,4}/", ""])
