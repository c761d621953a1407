"""Schema fuzz (issue 9, issue 26 finding 11): schemathesis generates requests from the server's
own /openapi.json (which carries the pydantic request schemas), valid and invalid ones, a bounded
number per route with a fixed seed, against a live stories260K server. The schema says what the
server does: a request it calls valid gets a 2xx or one of the semantic 4xx no schema can state
(`SEMANTIC_ERROR_CODES`: context length, token ids outside the vocabulary, ...), one it calls
invalid never gets a 2xx, and none gets a 5xx. Afterwards the server is healthy, still exact, and
holds no KV block. A table of bodies checks the same agreement in process, case by case."""
from __future__ import annotations

import json

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.server.openai.protocol import SEMANTIC_ERROR_CODES

from .live import STORIES_HF, LiveServer, reference_llm

schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

EXAMPLES = 50          # per route and mode: ~300 requests, ~20 s with the server's start
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--enable-auto-tool-choice", "--max-num-seqs", "32", "--max-model-len", "128")   # short answers: a bounded run
    yield srv
    assert srv.stop() == 0, srv.log()


def test_schema_fuzz_agrees_with_the_server_and_leaves_it_clean(server):
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    session = requests.Session()
    session.trust_env = False                   # no proxy for 127.0.0.1
    server_errors, disagreements, seen = [], [], {}

    for result in schema.get_all_operations():
        op = result.ok()
        # (a GET route here has no parameter to make invalid)
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
        for mode in modes:
            @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                resp = case.call(base_url=server.base_url, session=session, timeout=60)
                key = (op.label, mode.value, resp.status_code // 100)
                seen[key] = seen.get(key, 0) + 1
                if resp.status_code >= 500:
                    server_errors.append((op.label, resp.status_code, case.as_curl_command(),
                                          resp.text[:300]))
                elif mode == GenerationMode.NEGATIVE and resp.status_code < 300:
                    disagreements.append(("invalid but served", op.label, case.as_curl_command()))
                elif mode == GenerationMode.POSITIVE and resp.status_code >= 400 and \
                        _error_code(resp) not in SEMANTIC_ERROR_CODES:
                    disagreements.append(("valid but refused", op.label, resp.text[:300],
                                          case.as_curl_command()[:600]))

            run()

    assert not server_errors, (server_errors[:3], server.log())
    assert not disagreements, (len(disagreements), disagreements[:3])
    # the fuzz reached the engine: valid requests were served (2xx), invalid ones refused (4xx)
    assert seen.get(("POST /v1/completions", "positive", 2)), seen
    assert seen.get(("POST /v1/chat/completions", "positive", 2)), seen
    assert seen.get(("POST /v1/completions", "negative", 4)), seen

    # afterwards: healthy, exact, and no KV block in use
    assert httpx.get(server.base_url + "/health", trust_env=False).json() == {"status": "ok"}
    with reference_llm() as llm:
        want = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0].text
    r = httpx.post(server.base_url + "/v1/completions", trust_env=False, timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 32, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    m = server.wait_idle(timeout=30)
    assert m["kvserve:num_kv_blocks_free"] == m["kvserve:num_kv_blocks_total"]


def _error_code(resp) -> str | None:
    try:
        return resp.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


# (body, valid by the schema): each a place where schema and server once disagreed
CASES = [
    ({"prompt": "hi", "n": 2.0, "max_tokens": 3.0}, True),       # integral numbers are integers
    ({"prompt": [5.0, 6]}, True),
    ({"prompt": "hi", "n": "2"}, False),                          # no strings for numbers
    ({"prompt": "hi", "echo": 1}, False),                         # no numbers for booleans
    ({"prompt": "hi", "temperature": "0.5"}, False),
    ({"prompt": "hi", "n": 2.5}, False),
    ({"prompt": []}, False),
    ({"prompt": [[1, 2], []]}, False),
    ({"prompt": [-3, 5]}, False),
    ({"prompt": "hi", "stop": ""}, False),
    ({"prompt": "hi", "stop": ["a", ""]}, False),
    ({"prompt": "hi", "seed": -5}, False),
    ({"prompt": "hi", "seed": -1}, True),
    ({"prompt": "hi", "n": 16, "seed": 2**64 - 16}, True),
    ({"prompt": "hi", "seed": 2**64 - 1}, False),                 # seed + i must stay 64-bit
    ({"prompt": "hi", "suffix": "x"}, False),
    ({"prompt": "hi", "suffix": ""}, True),
    ({"prompt": "hi", "best_of": 1}, True),
    ({"prompt": "hi", "best_of": 2, "n": 2}, False),
    ({"prompt": "hi", "best_of": 1, "n": 2}, False),
    ({"prompt": "hi", "max_tokens": 0}, False),                   # 0 only with echo
    ({"prompt": "hi", "max_tokens": 0, "echo": True}, True),
    ({"prompt": "hi", "max_tokens": 2, "min_tokens": 2}, True),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_logprobs": 2}, False),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_logprobs": 2,
      "logprobs": True}, True),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [{"type": "function"}]},
     False),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": []}, True),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2}, True),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, False),
    ({"messages": [{"role": "user", "content": "hi", "name": 7}]}, False),
    ({"prompt": "hi", "max_tokens": 2, "length_penalty": 0.0}, False),      # only with beam search
    ({"prompt": "hi", "max_tokens": 2, "length_penalty": 1.0}, True),
    ({"prompt": "hi", "max_tokens": 2, "n": 2, "use_beam_search": True, "length_penalty": 0.5}, True),
    ({"prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"transfer_id": ""}}, False),
]


@pytest.fixture(scope="module")
def client():
    """An in-process stories260K server with a 128-token context."""
    from fastapi.testclient import TestClient

    from kvserve.config import EngineConfig
    from kvserve.frontend.llm_engine import LLMEngine
    from kvserve.server.app import build_app

    app = build_app(LLMEngine(EngineConfig(model=str(STORIES_HF), max_model_len=128)), "stories")
    with TestClient(app) as c:
        yield c


def test_schema_and_server_agree_case_by_case(client):
    import jsonschema_rs

    doc = client.get("/openapi.json").json()
    wrong = []
    for body, valid in CASES:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        validator = jsonschema_rs.validator_for({**schema, "components": doc["components"]})
        r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        got = (validator.is_valid(body), r.status_code < 300)
        if got != (valid, valid):
            wrong.append((body, got, r.text[:200]))
    assert not wrong, wrong


def test_semantic_400s_carry_their_codes(client):
    """The 4xx a valid body can still get name themselves, so clients (and the fuzz above) can
    tell them from a schema violation."""
    def code(body):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = client.post(path, json=body)
        assert r.status_code in (400, 404), r.text
        return r.json()["error"]["code"]

    assert code({"prompt": [1, 99999]}) == "engine_rejected"
    assert code({"prompt": "hi", "stop_token_ids": [512]}) == "engine_rejected"
    assert code({"prompt": "hi", "max_tokens": 500}) == "context_length_exceeded"
    assert code({"prompt": "hi", "truncate_prompt_tokens": 4096}) == "context_length_exceeded"
    assert code({"prompt": "hi", "kv_transfer_params": {"transfer_id": "t", "stream_to": "h:1"}}) == "engine_rejected"
    assert code({"prompt": "hi", "n": 2, "use_beam_search": True, "response_format": {"type": "json_object"}}
                ) == "sampling_params_conflict"
    assert code({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 500}) == \
        "context_length_exceeded"
    assert code({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}) == "min_tokens_exceeds_max_tokens"
    assert code({"prompt": "hi", "model": "gpt-9"}) == "model_not_found"
