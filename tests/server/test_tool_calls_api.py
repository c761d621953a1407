"""Tool calling over the OpenAI API of a live stories260K server whose chat template reads `tools`
(a compact Hermes-style one, given with --chat-template): tool_choice "required" and named
(arguments that validate against the function's schema, streamed and not, the SDK's stream
helper assembling the deltas), "auto" reading a <tool_call> the output was forced into, a
conversation with tool results continuing, bad input refused, and LangChain on top."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest

from kvserve.model.tokenizers.tokenizer import HFTokenizer
from kvserve.server.openai.chat_renderer import ChatRenderer

from .live import STORIES_HF, LiveServer

MODEL = "stories260K-hf"
TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}.\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}Assistant:{% for c in m.tool_calls %} <tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}\n"
    "{% elif m.role == 'tool' %}Result: {{ m.content }}\n"
    "{% else %}{{ m.role | capitalize }}: {{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
ADD_PARAMS = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "boolean"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "add", "parameters": ADD_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--enable-auto-tool-choice", "--max-num-seqs", "16", "--chat-template", TEMPLATE)
    yield srv
    assert srv.stop() == 0, srv.log()


def create(client, **kw):
    return client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                             "max_tokens": 80, "temperature": 0, **kw})


def check_calls(calls, names=None):
    """Each call has an id, a known name, and arguments that validate; returns [(name, args)]."""
    out = []
    for c in calls:
        assert c.id and c.type == "function"
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    assert len({c.id for c in calls}) == len(calls)
    if names is not None:
        assert [n for n, _ in out] == names
    return out


def streamed_calls(client, **kw):
    """(the calls as the chunks' deltas add up, finish reason); name and id only on a call's first piece."""
    calls, finish = {}, None
    for chunk in create(client, stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id and d.function.name, d
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None, d
                calls[d.index]["arguments"] += d.function.arguments or ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_forced_calls_validate_streamed_and_not(client, tool_choice):
    kw = dict(tool_choice=tool_choice, parallel_tool_calls=False)     # (named: one call anyway)
    choice = create(client, **kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = check_calls(choice.message.tool_calls, ["get_weather"] if tool_choice == NAMED else None)
    assert len(calls) == 1
    assert streamed_calls(client, **kw) == (calls, "tool_calls")
    # sampled, several samples: every one a valid call
    for c in create(client, **kw, temperature=1.0, seed=3, n=3).choices:
        assert c.finish_reason == "tool_calls"
        check_calls(c.message.tool_calls)


def test_parallel_calls_run_until_the_model_closes_the_list(client):
    """stories260K never closes it: the calls come one after another until max_tokens, each whole
    one valid, and the stream says the same as the answer."""
    choice = create(client, tool_choice="required", max_tokens=120).choices[0]
    assert choice.finish_reason == "length"
    *whole, last = choice.message.tool_calls
    assert len(whole) >= 2
    check_calls(whole)
    pieces = {}
    for chunk in create(client, tool_choice="required", max_tokens=120, stream=True):
        for d in chunk.choices[0].delta.tool_calls or ():
            pieces[d.index] = pieces.get(d.index, "") + (d.function.arguments or "")
    assert [pieces[i] for i in sorted(pieces)] == [c.function.arguments for c in choice.message.tool_calls]


def test_sdk_stream_helper_and_parse_assemble_strict_calls(client):
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    kw = dict(model=MODEL, messages=MESSAGES, tools=strict, tool_choice="required", parallel_tool_calls=False,
              max_tokens=80, temperature=0)
    parsed = client.chat.completions.parse(**kw).choices[0].message.tool_calls
    with client.chat.completions.stream(**kw) as stream:
        fragments = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0]
    assert len(fragments) > 1                        # the arguments came in pieces
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.parsed_arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.parsed_arguments) for c in parsed]
    check_calls(parsed)


def test_auto_reads_a_tool_call_the_model_wrote(client):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "(Paris|Rome)", "days": [1-7]}}</tool_call>'
    regex = r"Let me check\. " + call.replace("{", r"\{").replace("}", r"\}")
    kw = dict(tool_choice="auto", extra_body={"structured_outputs": {"regex": regex}})
    choice = create(client, **kw).choices[0]
    assert choice.message.content == "Let me check."
    assert choice.finish_reason == "tool_calls"
    calls = check_calls(choice.message.tool_calls, ["get_weather"])
    assert streamed_calls(client, **kw) == (calls, "tool_calls")
    # no call in the text: plain content, and the finish reason the engine gave
    plain = create(client, tool_choice="auto", max_tokens=12).choices[0]
    assert plain.message.tool_calls is None and plain.message.content and plain.finish_reason == "length"
    # tool_choice none: the tools stay out of the prompt
    none = create(client, tool_choice="none", max_tokens=1)
    assert none.usage.prompt_tokens < create(client, max_tokens=1).usage.prompt_tokens


def test_a_conversation_with_tool_results_continues(client):
    first = create(client, tool_choice=NAMED).choices[0].message
    history = MESSAGES + [first.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "Sunny, 21 C"}]
    resp = create(client, messages=history, max_tokens=16)
    assert resp.choices[0].message.content and resp.choices[0].finish_reason in ("stop", "length")
    # the prompt is the template's render of the whole history, the call's arguments as a dict
    renderer = ChatRenderer(HFTokenizer(STORIES_HF), TEMPLATE)
    call = first.tool_calls[0]
    text = renderer.render(MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": call.id}], tools=TOOLS)
    written = json.dumps({"name": "get_weather", "arguments": json.loads(call.function.arguments)})
    assert f"Assistant: <tool_call>{written}</tool_call>Result: Sunny, 21 C\nAssistant:" in text
    assert resp.usage.prompt_tokens == len(renderer.encode(text))


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools", "invalid_tools"),
    ({"tools": [], "tool_choice": "required"}, "needs at least one function", "invalid_tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "two tools are named 'get_weather'", "invalid_tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}],
      "response_format": {"type": "json_object"}}, "cannot constrain the same answer", "invalid_tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "must be a JSON Schema of an object", None),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name", None),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "got response_format and tool_choice", "conflicting_output_constraints"),
    ({"tool_choice": "sometimes"}, "tool_choice: invalid type", None),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "only assistant messages", None),
]


def test_bad_tool_requests_are_400s(server):
    before = server.wait_idle()
    for body, message, code in BAD:
        r = httpx.post(server.base_url + "/v1/chat/completions", trust_env=False, timeout=60,
                       json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **body})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert message in err["message"] and err["code"] == code, (body, err)
    after = server.wait_idle()
    assert after["kvserve:prompt_tokens_total"] == before["kvserve:prompt_tokens_total"]


def test_langchain_bind_tools_and_with_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        """A pet."""
        kind: str = Field(json_schema_extra={"enum": ["cat", "dog"]})
        happy: bool

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=server.base_url + "/v1", api_key="unused",
                                      temperature=0, max_tokens=80, max_retries=0,
                                      http_client=httpx.Client(trust_env=False, timeout=120))
    pet = llm.with_structured_output(Pet).invoke("Tell me about a pet.")
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")

    def get_weather(city: Literal["Paris", "Rome"], tomorrow: bool) -> str:
        """Weather of a city, today or tomorrow."""
        return "sunny"

    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    msg = bound.invoke([HumanMessage("Weather in Paris?")])
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome")
    follow = llm.bind_tools([get_weather]).invoke(
        [HumanMessage("Weather in Paris?"), msg, ToolMessage("sunny", tool_call_id=call["id"])])
    assert follow.content and not follow.tool_calls


def test_escaped_special_tokens_with_tools():
    """--escape-special-tokens-in-content: the messages' special-token text stays plain text with
    tools in the prompt too; in the tools or the calls themselves it is refused."""
    from kvserve.server.openai.protocol import APIError

    tok = HFTokenizer(STORIES_HF)
    renderer = ChatRenderer(tok, escape_special_tokens=True)         # the fallback: the default tool prompt
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "a</s>b"}]
    text = renderer.render(messages, True, tools)
    ids = renderer.encode_chat(text, messages, True, tools)
    assert tok.eos_token_id not in ids and ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=False).endswith("User: a</s>b\nAssistant:")
    bad = [{"type": "function", "function": {"name": "f", "description": "x</s>"}}]
    with pytest.raises(APIError, match="special-token text"):
        renderer.encode_chat(renderer.render(messages, True, bad), messages, True, bad)
