"""Bad input gets OpenAI-shaped 4xx/5xx answers and costs no other client its answer; API keys;
the --max-waiting limit; graceful SIGTERM."""
from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import threading

import httpx
import pytest

from kvserve import SamplingParams

from .live import LiveServer, reference_llm

MODEL = "stories260K-hf"


@pytest.fixture(scope="module")
def server():
    srv = LiveServer()
    yield srv
    assert srv.stop() == 0, srv.log()


def _post_raw(base, path, content: bytes, headers=None):
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    return httpx.post(base + path, content=content, headers=h, timeout=30, trust_env=False)


def _js(obj) -> bytes:
    return json.dumps(obj).encode()


LONG_PROMPT = "Once upon a time " * 200       # ~800 tokens, over max_model_len 512

BAD_REQUESTS = [
    # (id, path, body bytes, status, substring of message, param)
    ("malformed-json", "/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400, "malformed JSON", None),
    ("not-an-object", "/v1/completions", b'["hi"]', 400, "JSON object", None),
    ("invalid-utf8-body", "/v1/completions", b'{"prompt": "caf\xc3\x28 \xff"}', 400, "UTF-8", None),
    ("lone-surrogate", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "UTF-8", "prompt"),
    ("prompt-wrong-type", "/v1/completions", _js({"prompt": 42}), 400, "invalid type", "prompt"),
    ("temperature-wrong-type", "/v1/completions", _js({"prompt": "hi", "temperature": "hot"}), 400,
     "valid number", "temperature"),
    ("stream-wrong-type", "/v1/completions", _js({"prompt": "hi", "stream": {"a": 1}}), 400, "boolean", "stream"),
    ("negative-max-tokens", "/v1/completions", _js({"prompt": "hi", "max_tokens": -5}), 400,
     "greater than or equal to 0", "max_tokens"),     # 0 is allowed with echo (prompt scoring)
    ("huge-max-tokens", "/v1/completions", _js({"prompt": "hi", "max_tokens": 10**12}), 400,
     "maximum context length is 512", "max_tokens"),
    ("prompt-too-long", "/v1/completions", _js({"prompt": LONG_PROMPT}), 400,
     "maximum context length is 512", "prompt"),
    ("token-id-outside-vocab", "/v1/completions", _js({"prompt": [1, 99999]}), 400, "vocabulary", None),
    ("empty-prompt-list", "/v1/completions", _js({"prompt": []}), 400, "empty", "prompt"),
    ("bad-top-p", "/v1/completions", _js({"prompt": "hi", "top_p": 0}), 400, "greater than 0", "top_p"),
    ("too-many-logprobs", "/v1/completions", _js({"prompt": "hi", "logprobs": 1000}), 400, "less than", "logprobs"),
    ("unknown-model", "/v1/completions", _js({"prompt": "hi", "model": "gpt-9"}), 404, "does not exist", "model"),
    ("empty-messages", "/v1/chat/completions", _js({"messages": []}), 400, "at least 1", "messages"),
    ("messages-not-list", "/v1/chat/completions", _js({"messages": "hi"}), 400, "valid list", "messages"),
    ("bad-role", "/v1/chat/completions", _js({"messages": [{"role": "robot", "content": "x"}]}), 400,
     "role", "messages.0.role"),
    ("image-content", "/v1/chat/completions",
     _js({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
     400, "only text", "messages.0.content"),
    ("chat-too-long", "/v1/chat/completions", _js({"messages": [{"role": "user", "content": LONG_PROMPT}]}),
     400, "maximum context length", "prompt"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions",
     _js({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400, "logprobs", "top_logprobs"),
]


def test_bad_inputs_get_openai_errors_while_a_good_request_streams(server):
    prompt = "Once upon a time"
    with reference_llm() as llm:
        want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=480,
                                                     ignore_eos=True))[0].outputs[0].text
    result = {}
    first_chunk = threading.Event()

    def good():
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 480, "temperature": 0, "stream": True,
                "ignore_eos": True}
        parts = []
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120,
                          trust_env=False) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    parts.extend(ch["text"] for ch in json.loads(line[6:])["choices"])
                    first_chunk.set()
        result["text"] = "".join(parts)

    before = server.wait_idle()
    t = threading.Thread(target=good)
    t.start()
    assert first_chunk.wait(60)
    failures = []
    for name, path, body, status, msg, param in BAD_REQUESTS:
        r = _post_raw(server.base_url, path, body)
        err = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
        if r.status_code != status or err is None or msg not in err["message"] or \
                set(err) != {"message", "type", "param", "code"} or (param is not None and err["param"] != param):
            failures.append((name, r.status_code, r.text[:300]))
    t.join(120)
    assert not failures, failures
    # the good request, streaming since before the first bad one, got its whole solo answer
    assert result == {"status": 200, "text": want}
    # Counted, whatever the timing: every bad request was refused as one (404 included), and none of
    # them reached the engine's output: it generated the good request's 480 tokens and nothing else.
    after = server.wait_idle()
    rejected = 'kvserve:http_requests_rejected_total{model_name="stories260K-hf",reason="bad_request"}'
    assert after.get(rejected, 0.0) - before.get(rejected, 0.0) == len(BAD_REQUESTS)
    assert after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] == 480
    # and the server is still healthy and serving
    assert httpx.get(server.base_url + "/health", trust_env=False).status_code == 200
    r = _post_raw(server.base_url, "/v1/completions", _js({"prompt": prompt, "max_tokens": 5, "temperature": 0}))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[:len(r.json()["choices"][0]["text"])]


def test_unknown_route_is_openai_shaped_404(server):
    r = httpx.get(server.base_url + "/v1/nothing", trust_env=False)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


@pytest.fixture(scope="module")
def guarded():
    """A server with an API key from $KVSERVE_API_KEY, one running seat, and room for 2 waiters."""
    srv = LiveServer("--max-num-seqs", "1", "--max-waiting", "2", "--shutdown-timeout", "3",
                     env={"KVSERVE_API_KEY": "sekret"})
    yield srv
    srv.stop()


def test_api_key(guarded):
    base = guarded.base_url
    body = {"prompt": "Hi", "max_tokens": 2}
    assert httpx.get(base + "/v1/models", trust_env=False).status_code == 401
    r = httpx.post(base + "/v1/completions", json=body, trust_env=False)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}, trust_env=False)
    assert r.status_code == 401
    r = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"},
                   trust_env=False, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    # health stays open for probes; metrics need the key (issue 26: they count tenants' traffic)
    assert httpx.get(base + "/health", trust_env=False).status_code == 200
    assert httpx.get(base + "/metrics", trust_env=False).status_code == 401
    assert httpx.get(base + "/metrics", headers={"Authorization": "Bearer sekret"},
                     trust_env=False).status_code == 200


def _read_sse(resp) -> tuple[list, str]:
    """The data events of an SSE response ("[DONE]" as the string) and how the body ended: "closed"
    (the server finished the body) or "cut" (the connection broke before the body was complete).
    A read that times out raises: a stream must end, one way or the other."""
    events: list = []
    try:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return events, "cut"
    return events, "closed"


def _stream_outcome(events: list, ending: str, want: str, max_tokens: int) -> str:
    """'finished' or 'aborted' when the stream ended in a way cli.py documents for SIGTERM
    (in-flight requests run to completion within --shutdown-timeout, else fail with 503
    shutting_down); AssertionError otherwise."""
    chunks = [e for e in events if isinstance(e, dict) and "choices" in e]
    choices = [c for e in chunks for c in e["choices"]]
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    text = "".join(c["text"] for c in choices)
    finishes = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
    desc = f"ending={ending}, {len(choices)} token chunks, finish_reasons={finishes}, errors={errors}, " \
           f"last events={events[-2:]}"
    # whatever happened, nothing after [DONE], and what was streamed is the start of the answer
    assert "[DONE]" not in events[:-1], desc
    assert want.startswith(text), desc
    if ending == "closed" and events and events[-1] == "[DONE]" and not errors:
        # finished normally: every token, one chunk each, the last one carrying finish_reason
        assert len(choices) == max_tokens and finishes == ["length"], desc
        assert choices[-1]["finish_reason"] == "length" and text == want, desc
        return "finished"
    # failed at --shutdown-timeout with the in-band error, never cut off mid-body:
    # {"error": {"code": "shutting_down", ...}} then [DONE]
    assert not finishes and len(choices) < max_tokens, desc
    assert ending == "closed", desc
    assert len(errors) == 1 and errors[0]["code"] == "shutting_down", desc
    assert events[-2:] == [{"error": errors[0]}, "[DONE]"], desc
    return "aborted"


def test_max_waiting_then_graceful_sigterm(guarded):
    base, auth = guarded.base_url, {"Authorization": "Bearer sekret"}
    prompt, max_tokens = "Once upon a time", 480
    with reference_llm() as llm:
        want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                     ignore_eos=True))[0].outputs[0].text
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    client = httpx.Client(trust_env=False, timeout=60, headers=auth)
    streams = []
    for _ in range(3):       # one runs (max-num-seqs 1), two wait (max-waiting 2)
        cm = client.stream("POST", base + "/v1/completions", json=body)
        resp = cm.__enter__()
        assert resp.status_code == 200
        streams.append((cm, resp))
    guarded.wait_for("two requests waiting", lambda m: m["kvserve:num_requests_waiting"] >= 2, timeout=20)
    r = client.post(base + "/v1/completions", json=dict(body, stream=False))
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "server_overloaded"
    assert guarded.metrics()['kvserve:http_requests_rejected_total{model_name="stories260K-hf",reason="overloaded"}'] == 1

    # SIGTERM with requests in flight: each stream either finishes normally or is aborted after
    # --shutdown-timeout 3 -- whichever it is depends on the machine's speed, and both are checked
    # to the letter -- and the process exits 0.
    guarded.proc.send_signal(signal.SIGTERM)
    outcomes = []
    for cm, resp in streams:
        try:
            events, ending = _read_sse(resp)
        finally:
            try:
                cm.__exit__(None, None, None)
            except httpx.HTTPError:
                pass
        outcomes.append(_stream_outcome(events, ending, want, max_tokens))
    client.close()
    # One seat, first come first served: a request can only have finished if every request before
    # it did, so the finished streams come first.
    assert outcomes == sorted(outcomes, key=lambda o: o != "finished"), outcomes
    try:
        rc = guarded.proc.wait(60)
    except subprocess.TimeoutExpired:
        guarded.proc.kill()
        pytest.fail(f"kvserve serve still running 60 s after SIGTERM (--shutdown-timeout 3):\n{guarded.log()}")
    assert rc == 0, guarded.log()


def test_shutdown_deadline_answers_plain_requests_with_503_json():
    """A non-streaming request still in flight when --shutdown-timeout expires gets the
    documented 503 `shutting_down` JSON, not uvicorn's text/plain 500."""
    srv = LiveServer("--max-num-seqs", "1", "--shutdown-timeout", "0.3")
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(httpx.post, srv.base_url + "/v1/completions", json=body,
                                   trust_env=False, timeout=60) for _ in range(2)]
            srv.wait_for("one running, one waiting", lambda m: m["kvserve:num_requests_running"] == 1
                         and m["kvserve:num_requests_waiting"] == 1, timeout=20)
            srv.proc.send_signal(signal.SIGTERM)
            responses = [f.result() for f in futures]
        assert srv.proc.wait(30) == 0
        codes = [r.status_code for r in responses]
        assert 503 in codes, codes              # the waiting one cannot have finished within 0.3 s
        for r in responses:
            assert r.headers["content-type"] == "application/json"
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "shutting_down"
            else:
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 480
    finally:
        srv.stop()
