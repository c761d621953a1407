"""Hermes / Qwen tool calls (`--tool-call-parser hermes`): each call a JSON object in tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

the format of kvserve's default tool prompt (tool_calls/prompt.py) too. The object is read with
a JSON decoder from the opening tag on, so a tag inside a string in it is text, and the block
ends at the first closing tag after it. A block whose JSON is not a call of a known function
stays content (it ends at the first closing tag); the last block may lack its closing tag. JSON
that does not decode might be unfinished, so a stream holds the calls after it to the end."""
from __future__ import annotations

import json
import re

from kvserve.tool_calls.base import ToolParser, call_from_object

START, END = "<tool_call>", "</tool_call>"
_SPACE = re.compile(r"[ \t\n\r]*")          # JSON's whitespace, as json.loads skips it
_DECODER = json.JSONDecoder()


def _block(text: str, pos: int, names, final: bool):
    """The block whose opening tag ends at `pos`: (its call or None, where it ends), or None
    while more text could still change it (before `final` only)."""
    try:
        value, end = _DECODER.raw_decode(text, _SPACE.match(text, pos).end())
    except ValueError:          # broken, or not all there yet
        value, end = None, None
    if end is not None:
        after = _SPACE.match(text, end).end()
        if text.startswith(END, after):
            return call_from_object(value, names), after + len(END)
        if after == len(text) and final:        # an unclosed last block
            return call_from_object(value, names), after
    close = text.find(END, end or pos)
    if close >= 0 and (final or end is not None):
        return None, close + len(END)
    return (None, len(text)) if final else None


class HermesParser(ToolParser):
    name = "hermes"
    marker = START

    def parse_section(self, section, names, final):
        calls, content, pos, scan = [], [], 0, 0
        while (start := section.find(START, scan)) >= 0:
            block = _block(section, start + len(START), names, final)
            if block is None:
                break
            call, scan = block
            if call:
                calls.append(call)
                content.append(section[pos:start])
                pos = scan
        content.append(section[pos:])
        return calls, "".join(content)
