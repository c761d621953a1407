"""`kvserve bench serve` against a live `kvserve serve`: the numbers it reports are sane and agree
with what the server itself counted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server.live import ROOT, STORIES_HF, LiveServer


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
    before = server.metrics()
    p = bench("--base-url", server.base_url, "--model", str(STORIES_HF), "--dataset-name", "random",
              "--random-input-len", "32", "--random-output-len", "12", "--num-prompts", "16",
              "--request-rate", "40", "--max-concurrency", "8", "--ignore-eos", "--seed", "3",
              "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--save-result", str(out), "--save-detailed")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "P99 TTFT (ms):" in p.stdout and "Request goodput (req/s):" in p.stdout
    after = server.metrics()
    res = json.loads(out.read_text())
    [s] = res["runs"]["kvserve"]
    assert s["model"] == "stories260K-hf"         # asked of /v1/models, since --model was a directory
    assert (s["completed"], s["failed"]) == (16, 0)
    assert s["total_output_tokens"] == 16 * 12
    # the server counted exactly the tokens the client was told about
    assert after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] == 16 * 12
    assert after["kvserve:prompt_tokens_total"] - before["kvserve:prompt_tokens_total"] == s["total_input_tokens"]
    assert s["max_concurrent_requests"] <= 8
    assert s["good_requests"] == 16                # generous SLOs: everything is good
    assert s["request_throughput"] * s["duration_s"] == pytest.approx(16)
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < s[f"p50_{m}_ms"] <= s[f"p90_{m}_ms"] <= s[f"p99_{m}_ms"]
    assert s["p50_ttft_ms"] < s["p50_e2el_ms"]
    for r in s["requests"]:
        assert r["success"] and r["usage_reported"]
        assert r["output_len"] == 12
        assert 0 < r["ttft"] < r["e2e"]
        assert len(r["itl"]) == 11               # kvserve streams one chunk per generated token
        assert r["tpot"] * 11 == pytest.approx(r["e2e"] - r["ttft"])
        assert r["ttft"] + sum(r["itl"]) <= r["e2e"] + 1e-9


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
