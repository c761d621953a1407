"""`kvserve bench serve` against a live `kvserve serve`: the numbers it reports are sane and agree
with what the server itself counted."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from kvserve.bench.serve import arrival_gaps

from tests.server.live import ROOT, STORIES_HF, LiveServer


@pytest.fixture(scope="module")
def server():
    srv = LiveServer()
    yield srv
    assert srv.stop() == 0, srv.log()


def bench(*argv) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NO_PROXY="*")
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "serve", "--disable-tqdm", *argv],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_random_dataset_metrics_are_sane(server, tmp_path):
    out = tmp_path / "r.json"
    before = server.wait_idle()
    p = bench("--base-url", server.base_url, "--model", str(STORIES_HF), "--dataset-name", "random",
              "--random-input-len", "32", "--random-output-len", "12", "--num-prompts", "16",
              "--request-rate", "40", "--max-concurrency", "8", "--ignore-eos", "--seed", "3",
              "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--save-result", str(out), "--save-detailed")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "P99 TTFT (ms):" in p.stdout and "Request goodput (req/s):" in p.stdout
    # (bounded wait: the engine loop publishes its counters just after the last chunk goes out)
    after = server.wait_idle()

    def served(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    res = json.loads(out.read_text())
    [s] = res["runs"]["kvserve"]
    reqs = s["requests"]
    assert s["model"] == "stories260K-hf"         # asked of /v1/models, since --model was a directory
    assert (s["completed"], s["failed"]) == (16, 0) and len(reqs) == 16
    # ignore_eos: every request got exactly the 12 tokens it asked for, as one streamed chunk each,
    # so 11 gaps between chunks per request
    for r in reqs:
        assert r["success"] and r["usage_reported"], r
        assert r["output_len"] == 12
        assert len(r["itl"]) == r["output_len"] - 1
    assert s["total_output_tokens"] == sum(r["output_len"] for r in reqs) == 16 * 12
    assert s["total_input_tokens"] == sum(r["prompt_len"] for r in reqs)
    # the server counted exactly what the client was told: tokens, finished requests, and as many
    # first tokens and inter-token gaps as the client timed
    assert served("kvserve:generation_tokens_total") == 16 * 12
    assert served("kvserve:prompt_tokens_total") == s["total_input_tokens"]
    assert served('kvserve:request_success_total{finished_reason="length",model_name="stories260K-hf"}') == 16
    assert served("kvserve:time_to_first_token_seconds_count") == 16
    assert served("kvserve:inter_token_latency_seconds_count") == sum(len(r["itl"]) for r in reqs)
    # the report's statistics are numpy's over the per-request values it saved (ms)
    per_request = {"ttft": [r["ttft"] for r in reqs], "tpot": [r["tpot"] for r in reqs],
                   "itl": [x for r in reqs for x in r["itl"]], "e2el": [r["e2e"] for r in reqs]}
    for m, vals in per_request.items():
        ms = np.asarray(vals) * 1000
        assert s[f"mean_{m}_ms"] == pytest.approx(ms.mean(), rel=1e-9), m
        for q in (50, 90, 99):
            assert s[f"p{q}_{m}_ms"] == pytest.approx(np.percentile(ms, q), rel=1e-9), (m, q)
    # Poisson arrivals at 40 req/s, seed 3: no request started before its scheduled arrival, so the
    # k-th earliest start is no earlier than the k-th arrival (a sender that ignored the rate would
    # start everything at t = 0), and the pass lasted until the last request ended
    arrivals = np.cumsum(arrival_gaps(16, 40.0, 1.0, random.Random(3)))
    starts = sorted(r["start"] for r in reqs)
    assert all(st >= a - 1e-3 for st, a in zip(starts, arrivals)), (starts, arrivals.tolist())
    assert s["duration_s"] >= max(r["start"] + r["e2e"] for r in reqs) - 1e-6
    assert s["max_concurrent_requests"] <= 8
    assert s["good_requests"] == 16                # generous SLOs: everything is good


def test_chat_dataset_and_sweep_with_compare(server, tmp_path):
    plot = tmp_path / "curve.png"
    out = tmp_path / "sweep.json"
    p = bench("--base-url", server.base_url, "--dataset-name", "chat", "--chat-turns", "2", "--num-prompts", "6",
              "--random-input-len", "8", "--random-output-len", "6", "--sweep-rates", "5,inf",
              "--compare", server.base_url, "--compare-label", "same-server", "--plot", str(plot),
              "--save-result", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"kvserve", "same-server"}
    for rows in res["runs"].values():
        assert [r["request_rate"] for r in rows] == [5.0, "inf"]
        for r in rows:
            assert (r["completed"], r["failed"]) == (6, 0)
            # turn 2 resends turn 1 and its answer, so there are more prompt tokens than 6 short turns
            assert r["total_input_tokens"] > 6 * 8
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert "| rate (req/s) |" in p.stdout and "knee of kvserve" in p.stdout


def test_errors_are_counted_not_fatal(server, tmp_path):
    out = tmp_path / "e.json"
    # max_tokens beyond the 512-token context: every request is refused with HTTP 400
    p = bench("--base-url", server.base_url, "--random-input-len", "8", "--random-output-len", "600",
              "--num-prompts", "3", "--save-result", str(out))
    assert p.returncode == 1
    [s] = json.loads(out.read_text())["runs"]["kvserve"]
    assert (s["completed"], s["failed"]) == (0, 3)
    assert sum(s["errors"].values()) == 3
    assert all(m.startswith("HTTP 400: This model's maximum context length is 512") for m in s["errors"])
