"""Seed 004's measurement list against a live `kvserve serve`: a concurrency sweep that keeps each cap,
cost per million tokens, and the server's KV-cache and memory gauges read from /metrics."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.server.live import ROOT, STORIES_HF, LiveServer


@pytest.fixture(scope="module")
def server():
    srv = LiveServer()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_concurrency_sweep_cost_and_server_gauges(server, tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NO_PROXY="*")
    p = subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "serve", "--disable-tqdm",
                        "--base-url", server.base_url, "--model", str(STORIES_HF), "--random-input-len", "32",
                        "--random-output-len", "8", "--num-prompts", "8", "--ignore-eos",
                        "--sweep-concurrency", "1,4", "--metric-percentiles", "50,95",
                        "--machine-cost-per-hour", "2.5", "--metrics-interval", "0.05", "--save-detailed",
                        "--save-result", str(out), "--plot", str(png)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "| concurrency |" in p.stdout and "p95 TTFT ms" in p.stdout and png.exists()
    rows = json.loads(out.read_text())["runs"]["kvserve"]
    assert [r["max_concurrency"] for r in rows] == [1, 4]
    for r, cap in zip(rows, (1, 4)):
        assert r["completed"] == 8
        # independent: the most requests whose [start, start + e2e] intervals overlap never pass the cap
        events = sorted([(q["start"], 1) for q in r["requests"]] + [(q["start"] + q["e2e"], -1)
                                                                    for q in r["requests"]],
                        key=lambda e: (e[0], e[1]))
        live = peak = 0
        for _, d in events:
            live += d
            peak = max(peak, live)
        assert peak <= cap
        # cost: $2.5 an hour buys (tokens / duration) * 3600 tokens
        per_hour = r["total_output_tokens"] / r["duration_s"] * 3600
        assert r["cost_per_1m_output_tokens"] == pytest.approx(2.5 / per_hour * 1e6)
        m = r["server_metrics"]
        assert m["resident_memory_bytes"]["max"] > 10 * 2**20 and m["resident_memory_bytes"]["samples"] >= 1
        assert 0.0 <= m["kv_cache_usage"]["max"] <= 1.0
