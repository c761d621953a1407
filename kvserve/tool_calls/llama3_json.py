"""Llama 3.x JSON tool calls (`--tool-call-parser llama3_json`): the whole answer is one or more
JSON objects, optionally after `<|python_tag|>`, separated by `;`,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An answer that starts with anything else is content; so is the section from its first object
that is not a call of a known function on."""
from __future__ import annotations

from kvserve.tool_calls.base import ToolParser, call_from_object, decode_objects

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def content_until(self, text, at_start):
        if not at_start:
            return len(text), False
        rest = text.lstrip()
        if not rest:
            return 0, False                 # only whitespace yet: undecided
        if rest.startswith("{") or rest.startswith(PYTHON_TAG):
            return 0, True
        if PYTHON_TAG.startswith(rest):
            return 0, False
        return len(text), False

    def parse_section(self, section, names, final):
        pos = len(section) - len(section.lstrip())
        if section.startswith(PYTHON_TAG, pos):
            pos += len(PYTHON_TAG)
        objects, end = decode_objects(section, pos, ";")
        calls = []
        for obj, start in objects:
            call = call_from_object(obj, names)
            if call is None:            # not a call: from here on it is content
                return calls, section[start:] if calls else section
            calls.append(call)
        return calls, (section[end:] if calls else section) if final else ""
