"""Tool calls in model text: the readers of the models' own syntax (`--tool-call-parser`,
vLLM's names: hermes, llama3_json, mistral) for `tool_choice="auto"`, the JSON schemas and
readers that enforce `"required"` and a named function, and the default tool prompt.

Everything here works on dicts and strings; the server (kvserve/server/openai/tool_choice.py) turns
requests into them and updates into OpenAI's wire format."""
from __future__ import annotations

from kvserve.tool_calls.hermes import HermesParser
from kvserve.tool_calls.llama3_json import Llama3JsonParser
from kvserve.tool_calls.mistral import MistralParser

PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
DEFAULT_TOOL_CALL_PARSER = "hermes"


def tool_parser(name: str):
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}: use one of {sorted(PARSERS)}.")
    return PARSERS[name]()
