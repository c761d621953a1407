"""Structured outputs over the OpenAI API of a live stories260K server, with the official SDK:
`response_format` (json_schema, json_object, text), vLLM's `structured_outputs` and `guided_*`
fields, llama.cpp's `grammar` and `json_schema`, `chat.completions.parse()` with a Pydantic
model, and bad input refused at once with nothing queued. (json_object on a model that closes
its objects: test_tool_calls_default_model.py; stories260K writes stories into its strings.)"""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from .live import LiveServer

MODEL = "stories260K-hf"
MESSAGES = [{"role": "user", "content": "Tell me about Lily."}]
PET = {"type": "object", "properties": {
    "kind": {"type": "string", "enum": ["cat", "dog", "bird"]},
    "age": {"type": "integer", "minimum": 1, "maximum": 20},
    "happy": {"type": "boolean"}}, "required": ["kind", "age", "happy"], "additionalProperties": False}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    happy: bool


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--max-num-seqs", "16")
    yield srv
    assert srv.stop() == 0, srv.log()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=120, trust_env=False)


def test_json_schema_response_format_validates_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, max_tokens=64,
                                          temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PET)
    pieces = [ch.delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=fmt, max_tokens=64, temperature=0, stream=True)
        for ch in chunk.choices]
    assert "".join(pieces) == choice.message.content
    # sampled: every one of several samples validates
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, max_tokens=64,
                                          temperature=1.0, seed=5, n=4)
    for c in resp.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PET)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet,
                                               max_tokens=64, temperature=0)
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog", "bird")


@pytest.mark.parametrize("body,check", [
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"guided_regex": "(Lily|Tom) is [0-9]"}, lambda t: re.fullmatch("(Lily|Tom) is [0-9]", t)),
    ({"grammar": 'root ::= "The " ("cat" | "dog") " sat."'}, lambda t: t in ("The cat sat.", "The dog sat.")),
    ({"guided_grammar": 'root ::= [a-c]{1,3} "!"'}, lambda t: re.fullmatch("[a-c]{1,3}!", t)),
    ({"json_schema": PET}, lambda t: jsonschema.validate(json.loads(t), PET) is None),
    ({"guided_json": PET}, lambda t: jsonschema.validate(json.loads(t), PET) is None),
    ({"structured_outputs": {"json": PET}}, lambda t: jsonschema.validate(json.loads(t), PET) is None),
])
def test_every_constraint_field_on_completions_and_chat(server, body, check):
    for path, extra in (("/v1/completions", {"prompt": "Once upon a time"}), ("/v1/chat/completions",
                                                                           {"messages": MESSAGES})):
        r = post(server, path, {**extra, **body, "max_tokens": 60, "temperature": 0})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        text = c["text"] if "text" in c else c["message"]["content"]
        assert c["finish_reason"] == "stop" and check(text), (path, text)


def test_text_response_format_is_no_constraint(server):
    plain = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0})
    text = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                                            "response_format": {"type": "text"}})
    assert text.status_code == 200 and text.json()["choices"] == plain.json()["choices"]


BAD = [
    ({"response_format": {"type": "xml"}}, "unknown type 'xml'", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema: Field required", None),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "give at most one output constraint: got response_format and guided_regex", "conflicting_output_constraints"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of", None),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag: not supported", None),
    ({"guided_regex": "(unclosed"}, "regex", "invalid_structured_output"),
    ({"grammar": "root ::= undefined_rule"}, "undefined_rule", "invalid_structured_output"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "no-such-type",
     "invalid_structured_output"),
]


def test_bad_constraints_are_400s_at_once_with_nothing_queued(server):
    before = server.wait_idle()
    for body, message, code in BAD:
        for path, extra in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": MESSAGES})):
            r = post(server, path, {**extra, **body, "max_tokens": 8})
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert message in err["message"] and err["code"] == code, (body, err)
    after = server.wait_idle()
    for counter in ("kvserve:prompt_tokens_total", "kvserve:generation_tokens_total"):
        assert after[counter] == before[counter], counter          # none of them reached a step
    # and the server serves on
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}).status_code == 200
