"""Logs a person can read (issue 25): one line per finished request (server/request_log.py),
the periodic stats line, and `--metrics-prefix vllm`. A live server logging at INFO (its log
file is read), and in process with caplog, on stories260K."""
from __future__ import annotations

import json
import logging
import re
import signal
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.server.app import build_app
from kvserve.server.request_log import StatsLine

from .live import STORIES_HF, LiveServer

BODY = {"model": "stories260K-hf", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}
LINE = re.compile(r"request (\S+) finished: (.*)")


def finished_lines(text: str) -> dict[str, dict[str, str]]:
    """{request id: {field: value}} of the request lines in a log."""
    out = {}
    for m in LINE.finditer(text):
        out[m.group(1)] = dict(kv.split("=", 1) for kv in m.group(2).split(", "))
    return out


def wait_for_log(server: LiveServer, pred, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = server.log_path.read_text(errors="replace")
        if pred(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"not in the log within {timeout} s:\n{text[-3000:]}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--log-level", "info", "--log-stats-interval", "0.3", "--metrics-prefix", "vllm")
    yield s
    s.stop()


def test_a_request_logs_one_line_with_its_tokens_times_and_reason(server):
    r = httpx.post(server.base_url + "/v1/completions", json=BODY, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    rid, usage = r.json()["id"] + "-0", r.json()["usage"]
    text = wait_for_log(server, lambda t: f"request {rid} finished" in t)
    assert text.count(f"request {rid} finished") == 1
    line = finished_lines(text)[rid]
    assert line["reason"] == "length"
    assert int(line["prompt_tokens"]) == usage["prompt_tokens"] and int(line["output_tokens"]) == 8
    ttft, e2e = float(line["ttft"].removesuffix("ms")), float(line["e2e"].removesuffix("ms"))
    assert 0 < ttft <= e2e < 60_000
    assert "user" not in line and "tenant" not in line      # none given, no keys file


def test_a_stream_logs_its_user_and_an_aborted_stream_logs_abort(server):
    body = {**BODY, "stream": True, "user": "alice\nINFO forged"}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60,
                      trust_env=False) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    rid = events[0]["id"] + "-0"
    text = wait_for_log(server, lambda t: f"request {rid} finished" in t)
    line = finished_lines(text)[rid]
    assert line["reason"] == "length" and line["output_tokens"] == "8"
    assert line["user"] == repr("alice\nINFO forged")       # one line: the newline is escaped
    # Closed after its first chunk: aborted with what it had made; many samples keep it busy.
    long = {**BODY, "stream": True, "max_tokens": 480, "n": 16, "temperature": 1.0}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=long, timeout=60,
                      trust_env=False) as r:
        first = next(ln for ln in r.iter_lines() if ln.startswith("data: {"))
    rid = json.loads(first[6:])["id"] + "-0"
    text = wait_for_log(server, lambda t: f"request {rid} finished" in t)
    line = finished_lines(text)[rid]
    assert line["reason"] == "abort" and line["n"] == "16", line
    assert 0 < int(line["output_tokens"]) < 16 * 480 and text.count(f"request {rid} finished") == 1


def test_the_stats_line_shows_throughput_and_engine_state(server):
    for _ in range(3):
        assert httpx.post(server.base_url + "/v1/completions", json=BODY, timeout=60,
                          trust_env=False).status_code == 200
    pattern = re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) "
                         r"tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, Swapped: \d+ reqs, "
                         r"KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%")
    text = wait_for_log(server, lambda t: any(float(g) > 0 for _, g in pattern.findall(t)))
    assert any(float(p) > 0 for p, _ in pattern.findall(text))


def test_vllm_prefix_serves_vllms_names_and_no_kvserve_duplicates(server):
    assert httpx.post(server.base_url + "/v1/completions", json=BODY, timeout=60,
                      trust_env=False).status_code == 200
    m = server.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count", "vllm:request_success_total",
                 "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total"):
        assert name in m, name
    assert m['vllm:request_success_total{finished_reason="length",model_name="stories260K-hf"}'] >= 1
    # vLLM's time_per_output_token is its inter-token latency: one sample per gap
    assert m["vllm:time_per_output_token_seconds_count"] == m["vllm:inter_token_latency_seconds_count"]
    assert m["vllm:generation_tokens_total"] >= 8
    kvserve = {k.split("{")[0] for k in m if k.startswith("kvserve:")}
    mapped = {"num_requests_running", "kv_cache_usage_perc", "prompt_tokens_total", "request_success_total",
              "time_to_first_token_seconds_count", "time_per_output_token_seconds_count"}
    assert not {f"kvserve:{n}" for n in mapped} & kvserve
    assert {"kvserve:num_kv_blocks_free", "kvserve:engine_steps_total"} <= kvserve     # no vLLM name


def test_a_request_failed_by_the_shutdown_deadline_logs_error():
    s = LiveServer("--log-level", "info", "--log-stats-interval", "0", "--shutdown-timeout", "0.2")
    try:
        long = {**BODY, "stream": True, "max_tokens": 480, "n": 16, "temperature": 1.0}
        with httpx.stream("POST", s.base_url + "/v1/completions", json=long, timeout=60,
                          trust_env=False) as r:
            lines = r.iter_lines()
            rid = json.loads(next(ln for ln in lines if ln.startswith("data: {"))[6:])["id"] + "-0"
            s.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert any("shutting_down" in ln for ln in rest), rest[-3:]
        text = wait_for_log(s, lambda t: f"request {rid} finished" in t)
    finally:
        s.stop()
    line = finished_lines(text)[rid]
    assert line["reason"] == "error" and "shutting down" in line["error"], line
    assert "throughput" not in text                         # --log-stats-interval 0


# ---------------------------------------------------------------------- in process


def app(**kw):
    return build_app(LLMEngine(EngineConfig(model=str(STORIES_HF))), "stories260K-hf", **kw)


def test_disable_log_requests_logs_none_and_the_default_names_stay(caplog):
    with caplog.at_level(logging.INFO, logger="kvserve"):
        with TestClient(app(log_requests=False, log_stats_interval=0)) as client:
            assert client.post("/v1/completions", json=BODY).status_code == 200
            text = client.get("/metrics").text
    assert not [r for r in caplog.records if "finished:" in r.getMessage()]
    assert not [r for r in caplog.records if "throughput" in r.getMessage()]
    assert "kvserve:num_requests_running{" in text and "kvserve:time_per_output_token_seconds_count{" in text
    assert "vllm:" not in text


def test_a_tenants_request_line_names_its_tenant(caplog, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-alice": {"tenant": "acme"}}}))
    with caplog.at_level(logging.INFO, logger="kvserve.requests"):
        with TestClient(app(api_keys=str(keys), log_stats_interval=0)) as client:
            r = client.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-alice"},
                            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                  "ignore_eos": True, "user": "bob"})
            assert r.status_code == 200, r.text
    lines = finished_lines("\n".join(r.getMessage() for r in caplog.records))
    assert len(lines) == 1
    (line,) = lines.values()
    assert line["tenant"] == "'acme'" and line["user"] == "'bob'" and line["output_tokens"] == "3"
    assert int(line["prompt_tokens"]) == r.json()["usage"]["prompt_tokens"]


def test_an_idle_engines_stats_line_goes_to_debug(caplog):
    class Snap:
        num_running = num_waiting = num_swapped = 0
        kv_cache_usage, prompt_tokens_total, generation_tokens_total = 0.25, 100, 40
        prefix_cache_queries_total = prefix_cache_hits_total = num_preemptions_total = 0

    class Client:
        last_stats = Snap()

    clock = iter([0.0, 2.0, 4.0, 6.0]).__next__
    line = StatsLine(Client(), clock)
    busy = Snap()
    busy.prompt_tokens_total, busy.generation_tokens_total = 300, 140
    busy.prefix_cache_queries_total, busy.prefix_cache_hits_total = 200, 50
    Client.last_stats = busy
    with caplog.at_level(logging.DEBUG, logger="kvserve.server"):
        first, second, third = line.log(), line.log(), line.log()
    assert "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 50.0 tokens/s" in first
    assert "KV cache usage: 25.0%, Prefix cache hit rate: 25.0%" in first
    assert "Avg prompt throughput: 0.0" in second and "Avg prompt throughput: 0.0" in third
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO, logging.DEBUG]


def test_bad_settings_are_refused():
    engine = LLMEngine(EngineConfig(model=str(STORIES_HF)))
    with pytest.raises(ValueError, match="metrics prefix"):
        build_app(engine, "stories", metrics_prefix="prom")
    with pytest.raises(ValueError, match="log_stats_interval"):
        build_app(engine, "stories", log_stats_interval=-1)
