"""The tool-call readers: each parser on its model family's syntax, a stream (split anywhere)
saying exactly what the whole text says, markers inside arguments read as text, and the
forced-call reader against json.loads."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvserve.tool_calls import PARSERS, tool_parser
from kvserve.tool_calls.auto import AutoCalls
from kvserve.tool_calls.base import assemble
from kvserve.tool_calls.forced import NamedCall, RequiredCalls, closed, required_schema

NAMES = {"get_weather", "add"}
WEATHER = {"name": "get_weather", "arguments": {"city": "Paris"}}
ADD = {"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}\"]"}]}}


def read(parser: str, text: str, cuts=(), max_calls=None):
    """(content, [(name, arguments dict)]) of `text` fed in pieces split at `cuts`."""
    reader = AutoCalls(tool_parser(parser), NAMES, max_calls)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    updates = [reader.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [reader.finish()]
    content, calls = assemble(updates)
    return content, [(c.name, json.loads(c.arguments)) for c in calls], calls


def hermes(*calls) -> str:
    return "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls)


UNKNOWN_WITH_TAG = '<tool_call>{"name": "unknown", "arguments": {"x": "</tool_call>"}} x</tool_call>'
CASES = [
    ("hermes", "Let me look.\n" + hermes(WEATHER, ADD), "Let me look.", [WEATHER, ADD]),
    ("hermes", hermes(WEATHER), None, [WEATHER]),
    ("hermes", "<tool_call>" + json.dumps(WEATHER), None, [WEATHER]),           # unclosed last block
    ("hermes", "no calls here, only <tool> talk", "no calls here, only <tool> talk", []),
    ("hermes", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),        # not a known function
    ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    ("hermes", "<tool_call>{broken</tool_call>" + hermes(WEATHER).rstrip(), "<tool_call>{broken</tool_call>",
     [WEATHER]),                                                                # a broken block, then a call
    ("hermes", UNKNOWN_WITH_TAG + hermes(ADD).rstrip(), UNKNOWN_WITH_TAG, [ADD]),     # not a call, then one
    ("llama3_json", json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}), None, [WEATHER]),
    ("llama3_json", "<|python_tag|>" + json.dumps(WEATHER) + "; " + json.dumps(ADD), None, [WEATHER, ADD]),
    ("llama3_json", 'The answer is {"name": "add"}', 'The answer is {"name": "add"}', []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("mistral", "[TOOL_CALLS]" + json.dumps([WEATHER, ADD]), None, [WEATHER, ADD]),
    ("mistral", 'Sure [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Sure", [WEATHER]),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parser_reads_its_syntax(parser, text, content, calls):
    got_content, got_calls, raw = read(parser, text)
    assert got_content == (content or "")
    assert got_calls == [(c["name"], c["arguments"]) for c in calls]
    ids = [c.id for c in raw]
    assert len(set(ids)) == len(ids)
    if parser == "mistral":
        assert all(len(i) == 9 and i.isalnum() for i in ids)
    else:
        assert all(i.startswith("call_") for i in ids)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_a_stream_split_anywhere_says_what_the_whole_text_says(case, cuts):
    parser, text, _, _ = case
    whole_content, whole_calls, _ = read(parser, text)
    content, calls, _ = read(parser, text, cuts)
    assert (content, calls) == (whole_content, whole_calls)


def test_content_streams_before_the_call_and_a_partial_marker_is_held():
    reader = AutoCalls(tool_parser("hermes"), NAMES)
    assert reader.feed("Hello <tool").content == "Hello"      # the space and '<tool' held
    assert reader.feed("_call>" + json.dumps(WEATHER)).calls == []    # incomplete: nothing yet
    u = reader.feed("</tool_call>")
    assert [(d.index, d.name, json.loads(d.arguments)) for d in u.calls] == [(0, "get_weather", WEATHER["arguments"])]
    assert reader.finish().content == ""


def test_parallel_tool_calls_false_keeps_one_call():
    _, calls, _ = read("hermes", hermes(WEATHER, ADD), max_calls=1)
    assert calls == [("get_weather", WEATHER["arguments"])]


def test_unknown_parser_is_a_value_error():
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("qwen9")
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral"}


# -- forced calls ---------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) |
    st.text(alphabet=st.characters(codec="utf-8"), max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
call_objects = st.lists(st.tuples(st.sampled_from(sorted(NAMES)), st.dictionaries(st.text(max_size=5), json_values,
                                                                                  max_size=3), st.booleans()),
                        min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(calls=call_objects, indent=st.sampled_from([None, 1]), cuts=st.lists(st.integers(0, 2000), max_size=20))
def test_required_reader_streams_names_then_the_arguments_text(calls, indent, cuts):
    items = [({"parameters": args, "name": name} if reverse else {"name": name, "parameters": args})
             for name, args, reverse in calls]
    text = json.dumps(items, indent=indent, ensure_ascii=bool(indent))
    reader = RequiredCalls()
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    updates = [reader.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [reader.finish()]
    for d in (d for u in updates for d in u.calls):     # a call's first piece: its id and name
        assert (d.name is not None) == (d.id is not None)
    firsts = [d.index for u in updates for d in u.calls if d.name is not None]
    assert firsts == list(range(len(items)))
    content, got = assemble(updates)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(n, a) for n, a, _ in calls]


def test_named_reader_is_the_whole_text_as_arguments():
    reader = NamedCall("add")
    first = reader.feed('{"a":')
    assert first.calls[0].name == "add" and first.calls[0].id.startswith("call_")
    _, calls = assemble([first, reader.feed(" 1}"), reader.finish()])
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1}')]


def test_required_schema_admits_exactly_calls_of_the_functions():
    functions = [{"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                "required": ["a"]}}, {"name": "now"}]
    schema = required_schema(functions, parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "add", "parameters": {"a": 1}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "add", "parameters": {"a": "x"}}], [{"name": "sub", "parameters": {}}],
                [{"name": "add", "parameters": {"a": 1}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):     # one call only, without parallel_tool_calls
        jsonschema.validate(ok, required_schema(functions, parallel=False))


def test_forced_calls_close_open_objects_only():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": ["object", "null"]}}},
        "open": {"type": "object", "additionalProperties": True},
        "c": {"type": "string", "enum": [{"type": "object"}]}}}
    got = closed(schema)
    assert got["additionalProperties"] is False
    assert got["properties"]["a"]["additionalProperties"] is False
    assert got["properties"]["a"]["properties"]["b"]["additionalProperties"] is False
    assert got["properties"]["open"]["additionalProperties"] is True       # what the schema says stays
    assert got["properties"]["c"]["enum"] == [{"type": "object"}]          # data is not a schema
    assert "additionalProperties" not in schema                            # the request's own is untouched
    jsonschema.validate({"a": {"b": None}}, got)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": {"x": 1}}, got)


# -- markers inside arguments ---------------------------------------------------------------------
def test_a_closing_tag_inside_an_argument_string_does_not_end_the_hermes_call():
    text = '<tool_call>{"name": "add", "arguments": {"x": "</tool_call>"}}</tool_call>'
    for cut in range(len(text) + 1):
        content, calls, _ = read("hermes", text, [cut])
        assert (content, calls) == ("", [("add", {"x": "</tool_call>"})]), cut


MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
           "{", "}", "[", "]", '"', "\\", ";", ",", "é", "\u2028", "\U0001F600", "\n"]
marked_text = st.lists(st.sampled_from(MARKERS) | st.text(alphabet=st.characters(codec="utf-8"), max_size=3),
                       max_size=5).map("".join)
marked_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | marked_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(marked_text, inner, max_size=3), max_leaves=6)
marked_calls = st.lists(st.tuples(st.sampled_from(sorted(NAMES)), st.dictionaries(marked_text, marked_values,
                                                                                  max_size=3)),
                        min_size=1, max_size=3)


def written(parser: str, calls, before: str, after: str, draw) -> tuple[str, str]:
    """The text a model of `parser`'s family writes for `calls` between `before` and `after`,
    and the content the reader gives back (what precedes the calls loses its trailing space)."""
    dumps = lambda v: json.dumps(v, ensure_ascii=draw(st.booleans()))
    space = lambda: draw(st.sampled_from(["", " ", "\n"]))
    if parser == "hermes":
        blocks = [f"<tool_call>{space()}{dumps({'name': n, 'arguments': dumps(a) if draw(st.booleans()) else a})}"
                  f"{space()}</tool_call>" for n, a in calls]
        if not after and draw(st.booleans()):      # an unclosed last block
            blocks[-1] = blocks[-1][:-len("</tool_call>")]
        body = "".join(blocks)
    elif parser == "llama3_json":
        before = ""                                 # the answer starts with the calls
        after = after if not after or after[0].isalpha() else ""     # and what follows is no JSON
        key = draw(st.sampled_from(["parameters", "arguments"]))
        body = draw(st.sampled_from(["", "<|python_tag|>"])) + draw(st.sampled_from([";", "; ", ";\n"])).join(
            dumps({"name": n, key: a}) for n, a in calls)
    else:
        if draw(st.booleans()):
            body = "[TOOL_CALLS]" + dumps([{"name": n, "arguments": a} for n, a in calls])
        else:
            body = "".join(f"[TOOL_CALLS]{n}[ARGS]{dumps(a)}" for n, a in calls)
    return before + body + after, before.rstrip() + (after if after.strip() else "")


@settings(max_examples=80, deadline=None)
@given(parser=st.sampled_from(sorted(PARSERS)), calls=marked_calls, before=marked_text, after=marked_text,
       data=st.data())
def test_markers_inside_arguments_neither_end_nor_start_a_call(parser, calls, before, after, data):
    """Arguments whose strings hold every parser's markers come back exactly, read whole and read
    as a stream split anywhere, and so does the content around the calls."""
    assume(not any(m in before + after for m in ("<tool_call>", "[TOOL_CALLS]")))
    text, content = written(parser, calls, before, after, data.draw)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert read(parser, text)[:2] == read(parser, text, cuts)[:2] == (content, calls)
