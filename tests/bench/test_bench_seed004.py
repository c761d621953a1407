"""Seed 004's measurement list in `kvserve bench serve`: the concurrency sweep's parsing and plot, cost
per million tokens, and the gauges scraped from /metrics. Each figure is checked another way."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from kvserve.bench.seed004 import (MetricsSampler, add_costs, cost_per_million, format_concurrency_table,
                                   format_extras, parse_concurrencies, parse_metrics, plot_concurrency)


def test_parse_concurrencies():
    assert parse_concurrencies("1, 8,32") == [1, 8, 32]
    for bad in ("0", "", "1,-2"):
        with pytest.raises(ValueError):
            parse_concurrencies(bad)


def test_cost_per_million_by_tokens_per_hour():
    # $2/hour, 1,000 output tokens in 10 s: 100 tok/s = 360,000 tokens an hour for $2, so 1M tokens
    # cost 2 / 0.36 = $5.56
    assert cost_per_million(2.0, 10.0, 1000) == pytest.approx(2.0 / 0.36)
    s = {"duration_s": 10.0, "total_input_tokens": 4000, "total_output_tokens": 1000}
    add_costs(s, 2.0)
    assert s["cost_per_1m_input_tokens"] == pytest.approx(2.0 / (400 * 3600 / 1e6))
    assert s["cost_per_1m_tokens"] == pytest.approx(2.0 / (500 * 3600 / 1e6))
    assert "Cost per 1M output tokens" in format_extras(s)
    add_costs(t := {"duration_s": 1.0, "total_input_tokens": 1, "total_output_tokens": 1}, None)
    assert "cost_per_hour" not in t


def test_parse_metrics_reads_the_servers_gauges():
    from kvserve.server.metrics import ServerMetrics

    class Snap:
        kv_cache_usage = 0.25
    m = ServerMetrics("m")
    m.update_stats(Snap())
    got = parse_metrics(m.render().decode())
    assert got["kv_cache_usage"] == 0.25
    # independent: this process's resident set from /proc (no children here)
    import os
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert got["resident_memory_bytes"] >= 0.8 * rss
    # vLLM's name for the same gauge
    assert parse_metrics('vllm:gpu_cache_usage_perc{model_name="x"} 0.5\n')["kv_cache_usage"] == 0.5


def test_sampler_mean_and_max_over_scrapes():
    values = iter([0.1, 0.4, 0.7] + [0.7] * 100)

    def handler(request):
        return httpx.Response(200, text=f'kvserve:kv_cache_usage_perc{{model_name="m"}} {next(values)}\n')

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            s = MetricsSampler("http://x/metrics", interval=0.01)
            s.start(client)
            while len(s.samples) < 3:
                await asyncio.sleep(0.005)
            s.samples[:] = s.samples[:3]
            s._stop.set()
            await s._task
            return s.summary(), list(s.samples)
    summary, samples = asyncio.run(go())
    vals = [x["kv_cache_usage"] for x in samples][:3]
    assert vals == [0.1, 0.4, 0.7]
    assert summary["kv_cache_usage"]["max"] == 0.7


def test_sampler_without_metrics_endpoint_yields_nothing():
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(404))) as c:
            s = MetricsSampler("http://x/metrics", interval=0.01)
            s.start(c)
            await asyncio.sleep(0.03)
            return await s.stop()
    assert asyncio.run(go()) == {}


def test_concurrency_table_and_plot(tmp_path):
    rows = [{"max_concurrency": c, "request_throughput": c / 2, "output_throughput": 10.0 * c,
             "p95_ttft_ms": 5.0 * c, "p95_itl_ms": 2.0, "p95_e2el_ms": 50.0 * c,
             "server_metrics": {"kv_cache_usage": {"mean": 0.1, "max": 0.02 * c, "samples": 3}}}
            for c in (1, 8, 32)]
    table = format_concurrency_table(rows, "95")
    assert "p95 TTFT ms" in table and "| 32 | 16.00 | 320.0 | 160.0 | 2.0 | 1600.0 | 64.0 |" in table
    png = plot_concurrency({"kvserve": rows}, str(tmp_path / "c.png"), "95")
    assert (tmp_path / "c.png").stat().st_size > 10_000 and png.endswith("c.png")


def test_resident_memory_counts_the_engine_child_process():
    # the engine core runs in a child process: a child holding 200 MiB adds about that much
    import subprocess
    import sys
    import time

    from kvserve.server.memory_metrics import process_tree_rss
    before = process_tree_rss()
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; x = bytearray(200 << 20); "
                              "x[::4096] = b'1' * len(x[::4096]); print(1, flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        time.sleep(0.1)
        assert process_tree_rss() - before >= 180 << 20
        assert process_tree_rss(child.pid) >= 200 << 20
    finally:
        child.kill()
        child.wait()


def test_cuda_gauges_from_nvidia_smi(tmp_path, monkeypatch):
    # no GPU here: a stand-in nvidia-smi that prints memory.used, memory.total in MiB
    from kvserve.server.metrics import ServerMetrics
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '1024, 81559'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    got = parse_metrics(ServerMetrics("m").render().decode())
    assert got["cuda_memory_used_bytes"] == 1024 * 2**20 and got["cuda_memory_total_bytes"] == 81559 * 2**20
