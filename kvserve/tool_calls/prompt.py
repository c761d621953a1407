"""How tools reach a model whose chat template has no `tools` variable: kvserve's default tool
prompt, a system message in the Hermes format (which the `hermes` parser reads back):

    You can call functions to help with the user's request. The functions, as JSON, are listed
    between <tools> and </tools>:
    <tools>
    {"type": "function", "function": {"name": "get_weather", ...}}
    </tools>
    To call a function, answer with its name and arguments as a JSON object between
    <tool_call> and </tool_call>:
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

It goes before the conversation's own system message (in the same message) or becomes the
first message. Such a template cannot write the history's tool calls either, so an assistant
message's `tool_calls` are written into its content in the same format; `tool` messages keep
their role and content.
"""
from __future__ import annotations

import json

TOOL_PROMPT_HEAD = ("You can call functions to help with the user's request. The functions, as "
                    "JSON, are listed between <tools> and </tools>:\n<tools>\n")
TOOL_PROMPT_TAIL = ("\n</tools>\nTo call a function, answer with its name and arguments as a JSON "
                    "object between <tool_call> and </tool_call>:\n<tool_call>\n"
                    '{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
                    "</tool_call>")


def tool_prompt(tools: list[dict]) -> str:
    """The default tool prompt for `tools` (Hugging Face's {"type": "function", ...} dicts)."""
    return TOOL_PROMPT_HEAD + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + TOOL_PROMPT_TAIL


def call_text(call: dict) -> str:
    """One history call ({"function": {"name", "arguments": dict}}) in the prompt's format."""
    f = call["function"]
    return "<tool_call>\n" + json.dumps({"name": f["name"], "arguments": f["arguments"]},
                                        ensure_ascii=False) + "\n</tool_call>"


def with_tool_prompt(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` for a template without `tools`: the tool prompt first (when there are tools),
    and each assistant message's tool calls written into its content."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(call_text(c) for c in m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{m['content']}\n{calls}" if m.get("content") else calls
        out.append(m)
    if tools:
        prompt = tool_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{prompt}\n\n{out[0]['content']}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
