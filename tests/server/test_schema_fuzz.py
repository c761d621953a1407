"""Schema fuzz (issue 9): schemathesis generates requests from the server's own /openapi.json
(which carries the pydantic request schemas), valid and invalid ones, a bounded number per
route with a fixed seed, against a live stories260K server. No request may get a 5xx, and
afterwards the server is healthy, still exact, and holds no KV block."""
from __future__ import annotations

import httpx
import pytest

from kvserve import SamplingParams

from .live import LiveServer, reference_llm

schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

EXAMPLES = 50          # per route and mode: ~300 requests, ~20 s with the server's start
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--max-num-seqs", "32", "--max-model-len", "128")   # short answers: a bounded run
    yield srv
    assert srv.stop() == 0, srv.log()


def test_schema_fuzz_gets_no_5xx_and_leaves_the_server_clean(server):
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    session = requests.Session()
    session.trust_env = False                   # no proxy for 127.0.0.1
    server_errors, seen = [], {}

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

            run()

    assert not server_errors, (server_errors[:3], server.log())
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
