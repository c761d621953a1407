"""Mistral tool calls (`--tool-call-parser mistral`): after the `[TOOL_CALLS]` token, either a
JSON array of calls (tokenizers before v11) or each call as name, `[ARGS]`, arguments (v11 on):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

`[TOOL_CALLS]` is a special token, so the server keeps special tokens in the text of a request
this parser reads; call ids are 9 letters and digits, as Mistral's templates want them. From
the first thing that is not a call of a known function on, the section is content."""
from __future__ import annotations

import json
import re

from kvserve.tool_calls.base import ToolParser, call_from_object, decode_objects

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"\s*([A-Za-z0-9_-]{1,64})" + re.escape(ARGS))


class MistralParser(ToolParser):
    name = "mistral"
    id_kind = "mistral"
    marker = MARKER

    def parse_section(self, section, names, final):
        calls, pos = [], 0
        while section.startswith(MARKER, pos):
            got, end = _calls_after_marker(section, pos + len(MARKER), names)
            if end is None:             # incomplete or not calls: content from this marker on
                break
            calls += got
            pos = end
        return calls, section[pos:] if final else ""


def _calls_after_marker(text: str, pos: int, names) -> tuple[list, int | None]:
    """The calls one `[TOOL_CALLS]` introduces, and where they end (None: not complete calls)."""
    stripped = len(text) - len(text[pos:].lstrip())
    if text.startswith("[", stripped):
        objects, end = decode_objects(text, stripped + 1, ",")
        if not text.startswith("]", end) or not objects:
            return [], None
        calls = [call_from_object(obj, names) for obj, _ in objects]
        return (calls, end + 1) if all(calls) else ([], None)
    m = _NAME.match(text, pos)
    if m is None:
        return [], None
    try:
        args, end = json.JSONDecoder().raw_decode(text, m.end())
    except ValueError:
        return [], None
    call = call_from_object({"name": m.group(1), "arguments": args}, names)
    return ([call], end) if call else ([], None)
