"""How tools reach the model: a template's own `tools` variable (Hugging Face's convention, the
history's arguments as dicts), else kvserve's default tool prompt with the history's calls
written into the content."""
from __future__ import annotations

import json

from kvserve.frontend.chat_template import ChatRenderer
from kvserve.tool_calls.prompt import TOOL_PROMPT_HEAD, tool_prompt, with_tool_prompt

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [CALL]},
           {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}\n"
    "{% endfor %}")


class _Tok:
    bos_token = eos_token = ""


def test_a_template_with_tools_gets_them_and_the_calls_as_dicts():
    r = ChatRenderer(_Tok(), TOOLS_TEMPLATE)
    assert r.accepts_tools
    text = r.render(HISTORY, tools=TOOLS)
    assert text.startswith("TOOLS:get_weather;user: Weather in Paris?")
    assert 'CALL get_weather {"city": "Paris"}' in text
    assert TOOL_PROMPT_HEAD not in text
    assert not r.render(HISTORY[:1]).startswith("TOOLS")       # no tools: the template's `if tools` is false


def test_a_template_without_tools_gets_the_default_prompt_and_inline_calls():
    r = ChatRenderer(_Tok())            # the fallback template (no `tools` variable)
    assert not r.accepts_tools
    text = r.render(HISTORY, tools=TOOLS)
    assert text.startswith("System: " + tool_prompt(TOOLS))
    assert json.dumps(TOOLS[0]) in text
    assert 'Assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "Tool: sunny" in text
    # without tools the history's calls are still written out, and no prompt is added
    bare = r.render(HISTORY)
    assert TOOL_PROMPT_HEAD not in bare and "<tool_call>" in bare


def test_the_tool_prompt_joins_the_conversations_system_message():
    out = with_tool_prompt([{"role": "system", "content": "Be terse."}, HISTORY[0]], TOOLS)
    assert [m["role"] for m in out] == ["system", "user"]
    assert out[0]["content"] == tool_prompt(TOOLS) + "\n\nBe terse."
    assert with_tool_prompt(HISTORY[:1], None) == HISTORY[:1]
