"""Hermes / Qwen tool calls (`--tool-call-parser hermes`): each call a JSON object in tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

the format of kvserve's default tool prompt (tool_calls/prompt.py) too. A block whose JSON is
not a call of a known function stays content; the last block may lack its closing tag."""
from __future__ import annotations

import json
import re

from kvserve.tool_calls.base import ToolParser, call_from_object

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.S)


def _call(body: str, names):
    try:
        return call_from_object(json.loads(body), names)
    except ValueError:
        return None


class HermesParser(ToolParser):
    name = "hermes"
    marker = START

    def parse_section(self, section, names, final):
        calls, content, pos = [], [], 0
        for m in _BLOCK.finditer(section):
            content.append(section[pos:m.start()])
            call = _call(m.group(1), names)
            calls.append(call) if call else content.append(m.group(0))
            pos = m.end()
        rest = section[pos:]
        i = rest.find(START)
        if final and i >= 0:                # an unclosed last block
            call = _call(rest[i + len(START):], names)
            if call:
                calls.append(call)
                rest = rest[:i]
        content.append(rest)
        return calls, "".join(content)
