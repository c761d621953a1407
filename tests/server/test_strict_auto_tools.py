"""Strict functions under tool_choice "auto" (issue 35, item 3): the call is constrained from the
parser's start marker on (tool_calls/lazy_grammar.py), so the openai SDK's
`chat.completions.parse(tools=[pydantic_function_tool(X)])` returns validated arguments. The
grammar is checked against llguidance on stories260K's tokenizer (markers as text), the server on
a tiny random Qwen3 whose tokenizer has <tool_call> (id 512) and </tool_call> (513) as tokens,
with logit_bias pushing <tool_call> where the model may open a call."""
from __future__ import annotations

import json
from typing import Literal

import llguidance as llg
import openai
import pydantic
import pytest
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.engine.engine_core import EngineCore
from kvserve.model.tokenizers.tokenizer import HFTokenizer
from kvserve.server.app import build_app
from kvserve.structured.compiler import ll_tokenizer
from kvserve.tool_calls.lazy_grammar import lazy_call_grammar

from tests.conftest import build_random_model
from tests.server.live import STORIES_HF

TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}.\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer"}}, "required": ["city", "days"]}
FUNCTIONS = [{"name": "get_weather", "parameters": WEATHER, "strict": True},
             {"name": "add", "parameters": {"type": "object"}}]


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int


@pytest.mark.parametrize("parser, text, ok", [
    ("hermes", "Plain content.", True),
    ("hermes", 'Let me see.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>', True),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>', False),
    ("hermes", "text <tool_call> then text", False),             # a marker always starts a call
    ("hermes", '<tool_call>{"name": "add", "arguments": {"q": 1}}</tool_call>\n'
               '<tool_call>{"name": "add", "arguments": {}}</tool_call>', True),     # not strict: any object
    ("hermes", '<tool_call>{"name": "add", "arguments": {}}</tool_call> and text', False),   # calls end it
    ("hermes", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', False),
    ("mistral", "Hi", True),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}]', True),
    ("mistral", "a[TOOL_CALLS]nope", False),
    ("llama3_json", "Hi", True),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}', True),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}', False),
])
def test_the_lazy_grammar_holds_only_calls(parser, text, ok):
    llt = ll_tokenizer(HFTokenizer(STORIES_HF), 512, 2)
    m = llg.LLMatcher(llt, llg.grammar_from("lark", lazy_call_grammar(parser, FUNCTIONS, True, {})), log_level=0)
    assert not m.is_error(), m.get_error()
    assert bool(m.consume_tokens(llt.tokenize_str(text)) and m.is_accepting()) == ok


def test_one_call_without_parallel_tool_calls():
    llt = ll_tokenizer(HFTokenizer(STORIES_HF), 512, 2)
    two = ('<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name": "add", "arguments": {}}'
           '</tool_call>')
    m = llg.LLMatcher(llt, llg.grammar_from("lark", lazy_call_grammar("hermes", FUNCTIONS, False, {})), log_level=0)
    assert not (m.consume_tokens(llt.tokenize_str(two)) and m.is_accepting())


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = build_random_model("qwen3", tmp_path_factory.mktemp("qwen3-tools"), added_tokens=("<tool_call>", "</tool_call>"))
    engine = EngineCore(EngineConfig(model=str(model)))
    with TestClient(build_app(engine, "m", chat_template=TEMPLATE)) as c:
        yield c


def test_sdk_parse_with_a_strict_tool_under_auto(client):
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    kw = dict(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], temperature=0,
              tools=[openai.pydantic_function_tool(Weather)], parallel_tool_calls=False, max_tokens=60,
              logit_bias={512: 100})
    choice = sdk.chat.completions.parse(**kw).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "Weather"
    assert isinstance(call.function.parsed_arguments, Weather)
    # the same request streamed: the same call
    with sdk.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.tool_calls[0].function.parsed_arguments == call.function.parsed_arguments
    # with parallel calls the model may go on calling; every call is whole and validates
    many = client.post("/v1/chat/completions", json={**{k: v for k, v in kw.items() if k != "tools"},
                                                     "parallel_tool_calls": True, "logit_bias": {"512": 100},
                                                     "max_tokens": 200,
                                                     "tools": [openai.pydantic_function_tool(Weather)]}).json()
    calls = many["choices"][0]["message"]["tool_calls"] or []      # (an unfinished last call is content)
    assert calls, many
    for c in calls:
        Weather.model_validate(json.loads(c["function"]["arguments"]))
