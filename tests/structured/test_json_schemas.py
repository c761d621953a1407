"""Sampling under a JSON schema never leaves it: random small schemas (hypothesis: booleans,
bounded integers, short strings, enums, null, bounded arrays, objects with required keys,
nested), seeded samples at temperature 1 on stories260K; every output the grammar finished
parses and validates with `jsonschema`, and every output token was one a fresh matcher accepts."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.structured import StructuredOutputsParams as SO
from kvserve.structured.compiler import compile_matcher, ll_tokenizer
from tests.conftest import STORIES_HF

KEYS = ["a", "b", "name", "x y", "é"]
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
    st.lists(st.sampled_from(["red", "a b", 'x"y', "1", "ü"]), min_size=1, max_size=3, unique=True)
      .map(lambda v: {"enum": v}),
)


def containers(inner):
    return st.one_of(
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 3)),
        st.dictionaries(st.sampled_from(KEYS), inner, min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props),
                           "additionalProperties": False}))


SCHEMAS = st.recursive(LEAVES, containers, max_leaves=5).filter(lambda s: s.get("type") in ("object", "array"))


@pytest.fixture(scope="module")
def llm():
    return LLM(str(STORIES_HF), num_kv_blocks=512, max_num_seqs=8)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 1000))
def test_every_finished_output_validates(llm, schema, seed):
    so = SO(json=schema)
    out = llm.generate(["Tom said:"], SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=160,
                                                     structured_outputs=so))[0]
    ll = ll_tokenizer(llm.engine.tokenizer, llm.engine.model_config.vocab_size)
    finished = 0
    for c in out.outputs:
        fresh = compile_matcher(so, ll)
        assert all(fresh.consume_token(t) for t in c.token_ids), (schema, c.text)
        if c.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(c.text), schema)
    assert finished >= 3, (schema, [c.text for c in out.outputs])
