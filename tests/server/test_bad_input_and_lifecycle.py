"""Bad input gets OpenAI-shaped 4xx/5xx answers and costs no other client its answer; API keys;
the --max-waiting limit; graceful SIGTERM."""
from __future__ import annotations

import json
import signal
import threading
import time

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
     "greater than or equal to 1", "max_tokens"),
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
    # all of that happened while the good request was being generated
    assert server.metrics()["kvserve:num_requests_running"] == 1
    t.join(120)
    assert not failures, failures
    assert result == {"status": 200, "text": want}
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
    # health and metrics stay open for probes and scrapers
    assert httpx.get(base + "/health", trust_env=False).status_code == 200
    assert httpx.get(base + "/metrics", trust_env=False).status_code == 200


def test_max_waiting_then_graceful_sigterm(guarded):
    base, auth = guarded.base_url, {"Authorization": "Bearer sekret"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    client = httpx.Client(trust_env=False, timeout=120, headers=auth)
    streams = []
    for _ in range(3):       # one runs (max-num-seqs 1), two wait (max-waiting 2)
        cm = client.stream("POST", base + "/v1/completions", json=body)
        resp = cm.__enter__()
        assert resp.status_code == 200
        streams.append((cm, resp))
    deadline = time.monotonic() + 20
    while guarded.metrics()["kvserve:num_requests_waiting"] < 2:
        assert time.monotonic() < deadline, guarded.metrics()
        time.sleep(0.05)
    r = client.post(base + "/v1/completions", json=dict(body, stream=False))
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "server_overloaded"
    assert guarded.metrics()['kvserve:http_requests_rejected_total{model_name="stories260K-hf",reason="overloaded"}'] == 1

    # SIGTERM with requests in flight: they end (finished or aborted after --shutdown-timeout 3),
    # new connections are refused, and the process exits 0.
    t0 = time.monotonic()
    guarded.proc.send_signal(signal.SIGTERM)
    ended = []
    for cm, resp in streams:
        try:
            for _ in resp.iter_lines():
                pass
            ended.append("complete")
        except httpx.HTTPError:
            ended.append("cut")
        finally:
            try:
                cm.__exit__(None, None, None)
            except httpx.HTTPError:
                pass
    assert guarded.proc.wait(30) == 0, guarded.log()
    assert time.monotonic() - t0 < 25
    assert len(ended) == 3
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/health", trust_env=False, timeout=5)
    client.close()
