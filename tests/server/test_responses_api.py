"""`POST /v1/responses` over a live stories260K server with the official SDK: a string and items
(with instructions) as input, greedy text and usage equal to /v1/chat/completions' for the same
messages, max_output_tokens making a response incomplete, the stream's events in order and the
SDK's stream helper giving the unstreamed response, previous_response_id continuing a stored
conversation (and GET / DELETE of stored responses), text.format json_schema, function tools
forced and a function_call_output round trip, and unsupported fields refused; the store's
bounds in process; with tenants, one's stored responses beyond another's reach and surviving its
burst (the store per tenant: test_responses_store.py)."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from kvserve.server.openai.responses.protocol import MessageItem
from kvserve.server.openai.responses.store import ResponseStore

from .live import STORIES_HF, LiveServer

MODEL = "stories260K-hf"
# A template that reads tools and tool results (as tests/server/test_tool_calls_api.py's).
TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}.\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}Assistant:{% for c in m.tool_calls %} <tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}\n"
    "{% elif m.role == 'tool' %}Result: {{ m.content }}\n"
    "{% else %}{{ m.role | capitalize }}: {{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
PROMPT = "Tell me a story."
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                "parameters": WEATHER}}]
PET = {"type": "object", "properties": {
    "kind": {"type": "string", "enum": ["cat", "dog", "bird"]},
    "age": {"type": "integer", "minimum": 1, "maximum": 20},
    "happy": {"type": "boolean"}}, "required": ["kind", "age", "happy"], "additionalProperties": False}
PET_FORMAT = {"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    happy: bool


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--enable-auto-tool-choice", "--max-num-seqs", "8", "--chat-template", TEMPLATE)
    yield srv
    assert srv.stop() == 0, srv.log()


def create(client, **kw):
    return client.responses.create(**{"model": MODEL, "input": PROMPT, "max_output_tokens": 16,
                                      "temperature": 0, **kw})


def chat(client, messages, max_tokens=16, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def post(server, body: dict, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=60, trust_env=False)


def test_a_string_and_items_with_instructions_give_chats_greedy_text(client):
    r = create(client, metadata={"run": "1"}, user="u1")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text and r.output_text
    assert r.usage.output_tokens == 16 and r.usage.total_tokens == r.usage.input_tokens + 16
    assert (r.temperature, r.max_output_tokens, r.metadata, r.user) == (0, 16, {"run": "1"}, "u1")
    c = chat(client, [{"role": "user", "content": PROMPT}])
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens

    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "developer", "content": "Be brief."},
             {"role": "user", "content": PROMPT}]
    r = create(client, input=items, instructions="You tell stories.", max_output_tokens=24)
    c = chat(client, [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "developer", "content": "Be brief."},
                      {"role": "user", "content": PROMPT}], max_tokens=24)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.instructions == "You tell stories."


def test_stream_events_in_order_and_the_helper_gives_the_unstreamed_response(client):
    whole = create(client, max_output_tokens=12)
    events = list(create(client, max_output_tokens=12, stream=True))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    n = types.count("response.output_text.delta")
    assert n > 1 and types[4:4 + n] == ["response.output_text.delta"] * n
    assert types[4 + n:] == ["response.output_text.done", "response.content_part.done",
                             "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == events[4 + n].text == final.output_text == whole.output_text
    assert final.status == "incomplete" and final.usage.output_tokens == whole.usage.output_tokens == 12
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"

    # a response that completes: the SDK's helper accumulates it, and parses it
    kw = dict(model=MODEL, input=PROMPT, temperature=0, max_output_tokens=64)
    done = client.responses.create(**kw, text=PET_FORMAT)
    assert done.status == "completed" and done.completed_at is not None
    with client.responses.stream(**kw, text=PET_FORMAT) as stream:
        kinds = [e.type for e in stream]
        helper = stream.get_final_response()
    assert kinds[-1] == "response.completed"
    assert helper.output_text == done.output_text and helper.usage.output_tokens == done.usage.output_tokens
    jsonschema.validate(json.loads(done.output_text), PET)
    parsed = client.responses.parse(**kw, text_format=Pet).output_parsed
    assert isinstance(parsed, Pet)


def test_json_schema_and_json_object_formats(client):
    r = create(client, text=PET_FORMAT, max_output_tokens=64)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), PET)
    c = chat(client, [{"role": "user", "content": PROMPT}], max_tokens=64,
             response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}})
    assert r.output_text == c.choices[0].message.content
    # json_object: the text starts as a JSON object (stories260K may not close it within the budget)
    r = create(client, text={"format": {"type": "json_object"}}, max_output_tokens=8)
    assert r.output_text.lstrip().startswith("{")


def test_previous_response_id_continues_the_stored_conversation(client, server):
    first = create(client)
    second = create(client, input="And then?", previous_response_id=first.id)
    history = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    c = chat(client, history)
    assert second.usage.input_tokens == c.usage.prompt_tokens > first.usage.input_tokens + 16
    assert second.output_text == c.choices[0].message.content
    assert second.previous_response_id == first.id
    # a third turn carries both earlier turns
    third = create(client, input="The end.", previous_response_id=second.id, max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens + 16
    # stored: GET gives it back; DELETE forgets it
    got = client.responses.retrieve(first.id)
    assert got.output_text == first.output_text and got.usage == first.usage
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    # the unknown, the deleted, and a response made with store false: 400 naming the field
    unstored = create(client, store=False)
    for rid in ("resp_unknown", first.id, unstored.id):
        r = post(server, {"input": "x", "previous_response_id": rid})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text


def test_store_is_bounded_in_entries_and_bytes():
    items = [MessageItem(role="user", content="hello")]
    store = ResponseStore(max_entries=3, max_bytes=10_000)
    for i in range(5):
        assert store.put("t", {"id": f"r{i}", "text": "x" * 10}, items)
    assert len(store) == 3 and store.get("r0", "t") is None and store.get("r1", "t") is None
    assert store.get("r4", "t").response["text"] == "x" * 10
    assert store.get("r4", "other tenant") is None
    big = {"id": "big", "text": "y" * 4000}
    for i in range(3):
        assert store.put("t", {**big, "id": f"big{i}"}, items)
    assert store.nbytes <= 10_000 and store.get("big0", "t") is None and store.get("big2", "t") is not None
    assert [r for r in ("r2", "r3", "r4") if store.get(r, "t")] == []     # evicted for the bytes
    assert not store.put("t", {"id": "huge", "text": "z" * 20_000}, items)    # over the bound alone
    assert store.get("huge", "t") is None and store.nbytes <= 10_000
    assert store.delete("big2", "t") and not store.delete("big2", "t")


def test_a_forced_function_call_and_its_output_round_trip(client, server):
    r = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=60)
    assert r.status == "completed", r
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # streamed: the same call, its arguments in pieces
    with client.responses.stream(model=MODEL, input=PROMPT, temperature=0, max_output_tokens=60, tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (streamed,) = final.output
    types = [e.type for e in events]
    n = types.count("response.function_call_arguments.delta")
    assert n > 1 and types == ["response.created", "response.in_progress", "response.output_item.added",
                               *["response.function_call_arguments.delta"] * n,
                               "response.function_call_arguments.done", "response.output_item.done",
                               "response.completed"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == events[-3].arguments == streamed.arguments == call.arguments
    assert streamed.call_id and streamed.name == "get_weather" and streamed.status == "completed"
    # the call and its result sent back: the prompt is chat's render of the same history
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    back = create(client, input=[{"role": "user", "content": PROMPT}, call.model_dump(exclude_none=True), result],
                  tools=TOOLS)
    history = [{"role": "user", "content": PROMPT},
               {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                   "name": "get_weather", "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]
    c = chat(client, history, tools=CHAT_TOOLS)
    assert back.usage.input_tokens == c.usage.prompt_tokens
    assert back.output_text == (c.choices[0].message.content or "")
    # the same through previous_response_id: only the result is new
    cont = create(client, input=[result], previous_response_id=r.id, tools=TOOLS)
    assert cont.usage.input_tokens == c.usage.prompt_tokens and cont.output_text == back.output_text
    # a result that answers no call
    bad = post(server, {"input": [{**result, "call_id": "call_nope"}], "tools": TOOLS})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_tools", bad.text


UNSUPPORTED = [
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt_cache_key": "k"}, "prompt_cache_key"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.type"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"tools": TOOLS, "tool_choice": "required", "text": PET_FORMAT}, "text.format"),
    ({"max_output_tokens": 10_000}, "max_output_tokens"),
]


def test_unsupported_fields_are_400s_naming_them(server):
    before = server.wait_idle()
    for extra, param in UNSUPPORTED:
        r = post(server, {"input": PROMPT, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"], (extra, err)
    assert post(server, {"input": PROMPT, "reasoning": None, "include": [], "background": False,
                         "truncation": "disabled", "max_output_tokens": 2}).status_code == 200
    after = server.wait_idle()
    # nothing refused reached the engine (the one served request: its prompt alone)
    assert after["kvserve:prompt_tokens_total"] - before["kvserve:prompt_tokens_total"] < 40


def test_stored_responses_are_their_tenants_own():
    """With a keys file, one tenant cannot read, continue or delete another's response."""
    from fastapi.testclient import TestClient

    from kvserve.config import EngineConfig
    from kvserve.frontend.llm_engine import LLMEngine
    from kvserve.server.app import build_app
    from kvserve.server.tenants import TenantRegistry

    app = build_app(LLMEngine(EngineConfig(model=str(STORIES_HF))), MODEL,
                    api_keys=TenantRegistry.from_dict({"key-a": "alice", "key-b": "bob"}))
    alice, bob = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
    with TestClient(app) as c:
        body = {"input": PROMPT, "max_output_tokens": 4, "temperature": 0}
        assert c.post("/v1/responses", json=body).status_code == 401
        rid = c.post("/v1/responses", json=body, headers=alice).json()["id"]
        assert c.get(f"/v1/responses/{rid}", headers=bob).status_code == 404
        r = c.post("/v1/responses", json={**body, "previous_response_id": rid}, headers=bob)
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
        assert c.delete(f"/v1/responses/{rid}", headers=bob).status_code == 404
        assert c.post("/v1/responses", json={**body, "previous_response_id": rid}, headers=alice).status_code == 200
        assert c.get(f"/v1/responses/{rid}", headers=alice).json()["id"] == rid


def test_one_tenants_burst_evicts_only_its_own_stored_responses():
    """The review's case, with `kvserve serve`'s store flags at small bounds: alice's burst past
    her quota and the global bound leaves bob's responses readable and continuable."""
    import argparse

    from fastapi.testclient import TestClient

    from kvserve.config import EngineConfig
    from kvserve.frontend.llm_engine import LLMEngine
    from kvserve.server.app import build_app
    from kvserve.server.cli import add_cli_args, response_store
    from kvserve.server.tenants import TenantRegistry

    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args(["--max-stored-responses", "12", "--max-stored-responses-per-tenant", "8"])
    app = build_app(LLMEngine(EngineConfig(model=str(STORIES_HF))), MODEL, responses_store=response_store(args),
                    api_keys=TenantRegistry.from_dict({"key-a": "alice", "key-b": "bob"}))
    alice, bob = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
    body = {"input": PROMPT, "max_output_tokens": 1, "temperature": 0}
    with TestClient(app) as c:
        def make(headers, n):
            return [c.post("/v1/responses", json=body, headers=headers).json()["id"] for _ in range(n)]

        def readable(headers, rids):
            return [r for r in rids if c.get(f"/v1/responses/{r}", headers=headers).status_code == 200]

        bobs = make(bob, 4)
        alices = make(alice, 14)            # past her quota of 8: her own oldest go
        assert readable(bob, bobs) == bobs and readable(alice, alices) == alices[-8:]
        # the store is full (8 + 4): bob's next evicts from alice, who holds the most
        bobs += make(bob, 1)
        assert readable(bob, bobs) == bobs and readable(alice, alices) == alices[-7:]
        assert len(app.state.kvserve.responses) == 12
        r = c.post("/v1/responses", json={**body, "previous_response_id": bobs[0]}, headers=bob)
        assert r.status_code == 200, r.text
        r = c.post("/v1/responses", json={**body, "previous_response_id": alices[0]}, headers=alice)
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
