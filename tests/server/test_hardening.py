"""Issue 9, server hardening, against live servers on 127.0.0.1: bounded work per request
(prompts per request, prompt bytes before tokenizing, list fields), Content-Type, a KV pool
smaller than max_model_len, and the small ones (deep JSON, non-finite floats, a batch larger
than --max-waiting, 405's Allow, no exception text in bodies, the OpenAPI bodies, a non-ASCII
API key). Each test failed before its fix."""
from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import pytest
from types import SimpleNamespace

from kvserve import SamplingParams
from kvserve.config import EngineConfig
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.request import Request, RequestStatus
from kvserve.server.app import build_app
from kvserve.server.limits import DEFAULT_MAX_PROMPTS_PER_REQUEST

from .live import STORIES_HF, LiveServer, reference_llm

PROMPT = "Once upon a time"
NON_ASCII_KEY = "clé-ключ-鍵"


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--max-num-seqs", "8")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def tight():
    """24 KV blocks of 16 tokens (384 token slots, max_model_len 512), room for 8 waiters."""
    srv = LiveServer("--num-kv-blocks", "24", "--block-size", "16", "--max-waiting", "8")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def keyed():
    srv = LiveServer(env={"KVSERVE_API_KEY": NON_ASCII_KEY})
    yield srv
    assert srv.stop() == 0, srv.log()


def post(base: str, body, path: str = "/v1/completions", headers: dict | None = None, timeout=60):
    h = {"Content-Type": "application/json", **(headers or {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base + path, content=content, headers=h, timeout=timeout, trust_env=False)


def error(r) -> dict:
    assert r.headers.get("content-type", "").startswith("application/json"), (r.status_code, r.text[:200])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# ---------------------------------------------------------------- defect 2: prompts per request


def test_prompts_per_request_are_bounded(server):
    n = DEFAULT_MAX_PROMPTS_PER_REQUEST
    r = post(server.base_url, {"prompt": [[5]] * (n + 1), "max_tokens": 1})
    assert r.status_code == 400
    err = error(r)
    assert err["param"] == "prompt" and f"at most {n} prompts" in err["message"]
    # 300,000 one-token prompts (the 1.5 MB body) are refused by their count, before
    # any of them reaches the engine
    before = server.wait_idle()
    r = post(server.base_url, {"prompt": [[5]] * 300_000, "max_tokens": 1})
    assert r.status_code == 400
    err = error(r)
    assert err["code"] == "too_many_prompts" and err["message"].endswith("got 300000"), err
    after = server.wait_idle()
    assert after["kvserve:prompt_tokens_total"] == before["kvserve:prompt_tokens_total"]
    # the limit itself is served, in chunks that leave the event loop free
    r = post(server.base_url, {"prompt": [PROMPT] * n, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == n
    assert len({c["text"] for c in r.json()["choices"]}) == 1


def test_client_leaving_a_big_batch_aborts_all_of_it(server):
    server.wait_idle()
    before = server.metrics()
    body = {"prompt": [PROMPT] * DEFAULT_MAX_PROMPTS_PER_REQUEST, "max_tokens": 400, "ignore_eos": True}
    try:
        post(server.base_url, body, timeout=1.0)
    except httpx.TimeoutException:
        pass                                        # the client is gone
    after = server.wait_idle(timeout=30)
    generated = after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"]
    assert generated < DEFAULT_MAX_PROMPTS_PER_REQUEST * 400 // 4, generated
    assert httpx.get(server.base_url + "/health", trust_env=False).json() == {"status": "ok"}


def test_client_leaving_while_prompts_are_added_stops_adding_and_aborts_the_rest():
    """In process: a client that is gone after the first chunk of prompts was queued gets no
    more prompts added, and those already added are aborted."""
    from kvserve.server.limits import ADD_CHUNK
    from kvserve.server.openai.completions import completions
    from kvserve.server.openai.protocol import CompletionRequest

    state = build_app(LLMEngine(EngineConfig(model=str(STORIES_HF))), "stories").state.kvserve
    added, aborted = [], []
    real_add, real_abort = state.core_client.add_request, state.core_client.abort

    async def add(rid, *a, **k):
        added.append(rid)
        return await real_add(rid, *a, **k)

    def abort(rid):
        aborted.append(rid)
        real_abort(rid)

    state.core_client.add_request, state.core_client.abort = add, abort

    class GoneClient:
        headers: dict = {}

        async def is_disconnected(self):
            return True

    async def main():
        state.core_client.start()
        req = CompletionRequest.model_validate({"prompt": [PROMPT] * (3 * ADD_CHUNK), "max_tokens": 400,
                                                "ignore_eos": True})
        return await completions(state, req, GoneClient())

    try:
        resp = asyncio.run(main())
    finally:
        state.core_client.shutdown()
    assert resp.status_code == 499
    assert len(added) == ADD_CHUNK and sorted(aborted) == sorted(added)


# ---------------------------------------------------------------- defect 3: huge prompts


def _stream(base: str, out: dict, started: threading.Event):
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}
    parts = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120, trust_env=False) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                parts.append(json.loads(line[6:])["choices"][0]["text"])
                started.set()
    out["text"] = "".join(parts)


def test_a_huge_prompt_is_refused_before_tokenizing_and_stalls_no_one(server):
    with reference_llm() as llm:
        want = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=480,
                                                     ignore_eos=True))[0].outputs[0].text
    huge = "Once upon a time there was a cat. " * 600_000           # 20 MB
    out, started = {}, threading.Event()
    t = threading.Thread(target=_stream, args=(server.base_url, out, started))
    t.start()
    assert started.wait(60)
    for path, body in (("/v1/completions", {"prompt": huge}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})):
        r = post(server.base_url, body, path=path)
        assert r.status_code == 400, r.text[:300]
        err = error(r)
        assert err["code"] == "context_length_exceeded" and "maximum context length is 512" in err["message"]
        # "at least N tokens": refused by its UTF-8 length (`check_text_fits`), never tokenized (a
        # tokenized prompt's error gives its exact count; tokenizing this one took ~30 s)
        assert re.search(r"your prompt has at least \d+ tokens", err["message"]), err["message"]
        assert httpx.get(server.base_url + "/health", trust_env=False, timeout=10).status_code == 200
    t.join(120)
    assert not t.is_alive() and out["text"] == want      # the stream beside them is unharmed


# ---------------------------------------------------------------- defect 4: list fields


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "stop_token_ids": list(range(500)) * 8_000}, "stop_token_ids"),   # 4 million
    ({"prompt": "hi", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "hi", "stop": "x" * 1025}, "stop"),
    ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"prompt": list(range(3, 500)) * 600}, "prompt"),                                  # 300k ids
    ({"prompt": [[5, 6]] * 10 + [list(range(3, 500)) * 2]}, "prompt"),
], ids=["stop_token_ids", "stop-count", "stop-length", "logit_bias", "token-list", "token-lists"])
def test_list_fields_are_bounded(server, body, param):
    r = post(server.base_url, body)
    assert r.status_code == 400 and error(r)["param"] == param, r.text[:300]


def test_messages_are_bounded(server):
    msgs = [{"role": "user", "content": "hi"}] * 2049
    r = post(server.base_url, {"messages": msgs}, path="/v1/chat/completions")
    assert r.status_code == 400 and error(r)["param"] == "messages", r.text[:300]


def test_stop_token_check_is_a_set_lookup():
    """The per-step check: one frozenset lookup, kept in step with assignments."""
    p = SamplingParams(stop_token_ids=list(range(1024)), max_tokens=50)
    assert p.stop_token_id_set == frozenset(range(1024))
    p.stop_token_ids = [7]
    assert p.stop_token_id_set == {7}
    sched = SimpleNamespace(max_model_len=512)
    req = Request("r", [1, 2], p, 0.0, eos_token_id=2)
    req.token_ids.append(7)                    # append the sampled token as the scheduler does
    assert Scheduler.stop_status(sched, req, 7) == RequestStatus.FINISHED_STOPPED and req.stop_reason == 7


# ---------------------------------------------------------------- defect 5: Content-Type


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", None])
def test_post_routes_require_json_content_type(server, ctype):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1})):
        headers = {"Content-Type": ctype} if ctype else {}
        r = httpx.post(server.base_url + path, content=json.dumps(body).encode(), headers=headers,
                       trust_env=False, timeout=30)
        assert r.status_code == 415 and error(r)["code"] == "unsupported_media_type", (ctype, r.text)
    r = post(server.base_url, {"prompt": "hi", "max_tokens": 1},
             headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


# ---------------------------------------------------------------- defect 7: a small KV pool


def test_small_kv_pool_lowers_the_served_context(tight):
    models = httpx.get(tight.base_url + "/v1/models", trust_env=False).json()
    assert models["data"][0]["max_model_len"] == 384                 # 24 x 16, not 512
    assert re.search(r"KV cache holds 384 tokens, fewer than max_model_len 512", tight.log())
    r = post(tight.base_url, {"prompt": PROMPT, "max_tokens": 450})
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded"
    assert "maximum context length is 384" in error(r)["message"]
    # what fits is served whole (before: 380 of 450 tokens, finish_reason "length")
    r = post(tight.base_url, {"prompt": PROMPT, "max_tokens": 370, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 370, r.text[:300]


# ---------------------------------------------------------------- defect 9: the small ones


def test_deeply_nested_json_is_400(server):
    for depth in (100_000, 2_000):
        r = post(server.base_url, b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}")
        assert r.status_code == 400, (depth, r.status_code, r.text[:200])
        error(r)
    assert httpx.get(server.base_url + "/health", trust_env=False).status_code == 200


FLOATS = {"temperature": "100", "top_p": "1", "min_p": "1", "presence_penalty": "2",
          "frequency_penalty": "2", "repetition_penalty": "100"}


@pytest.mark.parametrize("field", sorted(FLOATS))
def test_float_fields_must_be_finite_and_in_range(server, field):
    for raw in (b"1e308", b"-1e308", b"1e400", b"Infinity", b"NaN", b"-Infinity"):
        body = b'{"prompt": "hi", "max_tokens": 1, "' + field.encode() + b'": ' + raw + b"}"
        r = post(server.base_url, body)
        assert r.status_code == 400, (field, raw, r.text)
        msg = error(r)["message"]
        if raw in (b"1e308",):
            assert f"less than or equal to {FLOATS[field]}" in msg, msg
        if raw in (b"NaN", b"Infinity", b"-Infinity", b"1e400"):
            assert "finite" in msg and "less than" not in msg, msg


def test_batch_larger_than_max_waiting_is_400(tight):
    r = post(tight.base_url, {"prompt": [PROMPT] * 9, "max_tokens": 1})
    assert r.status_code == 400 and "--max-waiting" in error(r)["message"] and "retry-after" not in r.headers
    r = post(tight.base_url, {"prompt": [PROMPT] * 8, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_405_keeps_its_allow_header(server):
    r = httpx.get(server.base_url + "/v1/completions", trust_env=False)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert error(r)["code"] == "method_not_allowed"


def test_non_ascii_api_key_matches_a_utf8_client(keyed):
    good = {"Authorization": b"Bearer " + NON_ASCII_KEY.encode("utf-8")}
    r = post(keyed.base_url, {"prompt": PROMPT, "max_tokens": 2}, headers=good)
    assert r.status_code == 200, r.text
    for wrong in (b"Bearer " + NON_ASCII_KEY.encode("latin-1", "replace"), b"Bearer cl\xc3\xa9"):
        r = post(keyed.base_url, {"prompt": PROMPT, "max_tokens": 2}, headers={"Authorization": wrong})
        assert r.status_code == 401 and error(r)["code"] == "invalid_api_key"


def test_openapi_describes_the_bodies(server):
    doc = httpx.get(server.base_url + "/openapi.json", trust_env=False).json()
    schemas = doc["components"]["schemas"]
    for path, req, resp in (("/v1/completions", "CompletionRequest", "CompletionResponse"),
                            ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse")):
        op = doc["paths"][path]["post"]
        body_schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert body_schema == {"$ref": f"#/components/schemas/{req}"}
        for status, model in (("200", resp), ("400", "ErrorResponse"), ("500", "ErrorResponse")):
            assert op["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert req in schemas and resp in schemas
    props = schemas["CompletionRequest"]["properties"]
    assert "prompt" in props and "repetition_penalty" in props
    assert "prompt" in schemas["CompletionRequest"]["required"]
    # every $ref resolves inside the document
    for ref in re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(doc)):
        assert ref in schemas, ref


def test_internal_errors_show_an_id_not_the_exception(caplog):
    """An unexpected exception in a handler: 500 with an error id, the exception in the log."""
    from fastapi.testclient import TestClient

    app = build_app(LLMEngine(EngineConfig(model=str(STORIES_HF))), "stories")
    state = app.state.kvserve

    def broken(*a, **k):
        raise RuntimeError("secret internal detail /etc/passwd")

    state.chat.render = broken
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500
    msg = r.json()["error"]["message"]
    assert "secret" not in msg and "RuntimeError" not in msg
    eid = re.search(r"error id (err-[0-9a-f]+)", msg).group(1)
    assert any(eid in rec.getMessage() and "secret internal detail" in rec.getMessage()
               for rec in caplog.records)
