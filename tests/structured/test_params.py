"""StructuredOutputsParams and SamplingParams(structured_outputs=...) refuse what no grammar can
be built from, at construction, with a sentence that says what to change; `key` is canonical."""
from __future__ import annotations

import pickle

import pytest

from kvserve import SamplingParams
from kvserve.structured import MAX_STRUCTURED_SPEC_BYTES, StructuredOutputsParams as SO


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, r"exactly one .*got \['regex', 'choice'\]"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1, 2]"}, "must be a JSON schema"),
    ({"json": False}, "must be a JSON schema"),
    ({"json": {"x": float("nan")}}, "not a JSON value"),
    ({"json_object": False}, "json_object must be True"),
    ({"choice": []}, "non-empty list of strings"),
    ({"choice": ["a", 1]}, "non-empty list of strings"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"grammar": 3}, "grammar must be a non-empty string"),
    ({"regex": "a" * (MAX_STRUCTURED_SPEC_BYTES + 1)}, f"the limit is {MAX_STRUCTURED_SPEC_BYTES}"),
    ({"json": {"enum": ["x" * MAX_STRUCTURED_SPEC_BYTES]}}, "structured_outputs.json is"),
])
def test_bad_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SO(**kwargs)


def test_key_is_canonical_and_params_travel():
    a = SO(json={"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}})
    b = SO(json='{"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}')
    # one text for a dict and its JSON; properties stay in the schema's order (the output's order)
    assert a.key == b.key == ("json_schema", '{"type":"object","properties":{"b":{"type":"integer"},'
                                             '"a":{"type":"string"}}}', "")
    assert SO(json=True).key == SO(json_object=True).key == ("json_schema", '{"type":"object"}', "")
    assert SO(choice=["yes", "no"]).key == ("choice", '["yes","no"]', "") and SO(regex="a+").kind == "regex"
    c = pickle.loads(pickle.dumps(a))           # the core may be in another process
    assert c == a and c.key == a.key


def test_sampling_params_take_only_structured_outputs_params_and_no_beams():
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams, got dict"):
        SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="not supported with beam search"):
        SamplingParams(use_beam_search=True, structured_outputs=SO(regex="a"))
    assert SamplingParams(structured_outputs=SO(regex="a")).structured_outputs.key == ("regex", "a", "")

