"""Seed 004's measurement list for `kvserve bench serve`.

"Benchmark your server at 1, 8 and 32 concurrent requests, and plot throughput and p95 latency",
and measure "GPU memory use and KV cache utilisation" and "cost per million tokens":

  --sweep-concurrency 1,8,32   one pass per cap on requests in flight (all requests offered at
                               once, --max-concurrency C each pass); a table and a plot of output
                               throughput and latency at the chosen percentile against concurrency
                               (the largest of --metric-percentiles, e.g. 50,95 -> p95).
  --gpu-cost-per-hour X /      each pass's cost per million input tokens and per million output
  --machine-cost-per-hour X    tokens: X * duration / 3600 / tokens * 1e6 (the whole machine's
                               cost charged to that kind of token, as a per-token price is quoted),
                               and per million tokens of both kinds together.
  /metrics                     scraped every --metrics-interval seconds during a pass: KV-cache
                               utilisation, resident memory of the server and its engine processes,
                               CUDA memory in use (kvserve's names; vLLM's KV gauge and the standard
                               process_resident_memory_bytes where a server has those); mean and max.
"""
from __future__ import annotations

import asyncio
import math

# report key -> metric names that carry it (first found wins): kvserve's, then vLLM's
GAUGES = {
    "kv_cache_usage": ("kvserve:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "resident_memory_bytes": ("kvserve:resident_memory_bytes", "process_resident_memory_bytes"),
    "cuda_memory_used_bytes": ("kvserve:cuda_memory_used_bytes",),
    "cuda_memory_total_bytes": ("kvserve:cuda_memory_total_bytes",),
}


def percentile_name(p: float) -> str:
    """95 -> '95', 99.9 -> '99.9': the name report.summarize gives a percentile's keys (p95_ttft_ms)."""
    return str(int(p)) if float(p).is_integer() else str(p)


async def pass_with_metrics(run_pass, target, conversations, args, rate: float):
    """serve.run_pass, with the server's /metrics scraped every --metrics-interval seconds meanwhile
    (KV-cache utilisation, process and device memory over the run). Returns (results, duration,
    {gauge: {mean, max, samples}}) -- the last empty when the server has no /metrics."""
    import httpx

    if not args.metrics_interval:
        results, duration = await run_pass(target, conversations, args, rate)
        return results, duration, {}
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    sampler = MetricsSampler(target.base_url.rstrip("/") + "/metrics", args.metrics_interval, headers)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        sampler.start(client)
        results, duration = await run_pass(target, conversations, args, rate)
        return results, duration, await sampler.stop()


def parse_concurrencies(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; every cap a positive integer."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        c = int(part)
        if c < 1:
            raise ValueError(f"concurrencies must be positive integers, got {part}")
        out.append(c)
    if not out:
        raise ValueError("--sweep-concurrency needs at least one concurrency")
    return out


def cost_per_million(cost_per_hour: float, duration_s: float, tokens: float) -> float:
    """Dollars (or any currency) per million tokens when `tokens` took `duration_s` on a machine that
    costs `cost_per_hour`: cost_per_hour * duration / 3600 / tokens * 1e6 (nan without tokens)."""
    if tokens <= 0:
        return math.nan
    return cost_per_hour * duration_s / 3600.0 / tokens * 1e6


def add_costs(s: dict, cost_per_hour: float | None) -> None:
    """Put a pass's cost per million input, output and total tokens into its summary `s`."""
    if cost_per_hour is None:
        return
    d, i, o = s["duration_s"], s["total_input_tokens"], s["total_output_tokens"]
    s["cost_per_hour"] = cost_per_hour
    s["cost_per_1m_input_tokens"] = cost_per_million(cost_per_hour, d, i)
    s["cost_per_1m_output_tokens"] = cost_per_million(cost_per_hour, d, o)
    s["cost_per_1m_tokens"] = cost_per_million(cost_per_hour, d, i + o)


def parse_metrics(text: str) -> dict[str, float]:
    """The gauges of GAUGES from a Prometheus text page (the first sample of each name; the series of
    one server share labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            found.setdefault(sample.name, sample.value)
    out = {}
    for key, names in GAUGES.items():
        for name in names:
            if name in found:
                out[key] = float(found[name])
                break
    return out


class MetricsSampler:
    """Scrapes `url` every `interval` seconds until stopped; `summary()` gives mean and max per gauge.
    A server without /metrics (404, connection refused) simply yields no samples."""

    def __init__(self, url: str, interval: float = 0.5, headers: dict | None = None):
        self.url, self.interval, self.headers = url, interval, headers or {}
        self.samples: list[dict[str, float]] = []
        self._task = None
        self._stop = asyncio.Event()

    async def _run(self, client) -> None:
        while True:
            try:
                resp = await client.get(self.url, headers=self.headers)
                if resp.status_code == 200:
                    self.samples.append(parse_metrics(resp.text))
            except Exception:   # noqa: BLE001 - a scrape never fails the benchmark
                pass
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
                return
            except asyncio.TimeoutError:
                continue

    def start(self, client) -> None:
        self._task = asyncio.create_task(self._run(client))

    async def stop(self) -> dict:
        self._stop.set()
        if self._task is not None:
            await self._task
        return self.summary()

    def summary(self) -> dict:
        out: dict = {}
        for key in GAUGES:
            vals = [s[key] for s in self.samples if key in s]
            if vals:
                out[key] = {"mean": sum(vals) / len(vals), "max": max(vals), "samples": len(vals)}
        return out


def format_extras(s: dict) -> str:
    """Lines for the cost and the scraped gauges of one pass (empty when it has neither)."""
    lines = []
    if "cost_per_hour" in s:
        lines.append(f"{'Cost per 1M input tokens:':<40}{s['cost_per_1m_input_tokens']:<10.4f}")
        lines.append(f"{'Cost per 1M output tokens:':<40}{s['cost_per_1m_output_tokens']:<10.4f}")
        lines.append(f"{'Cost per 1M tokens (input + output):':<40}{s['cost_per_1m_tokens']:<10.4f}")
    m = s.get("server_metrics") or {}
    if "kv_cache_usage" in m:
        u = m["kv_cache_usage"]
        lines.append(f"{'KV-cache usage (mean / max %):':<40}{100 * u['mean']:.1f} / {100 * u['max']:.1f}")
    for key, label in (("resident_memory_bytes", "Server resident memory (max GiB):"),
                       ("cuda_memory_used_bytes", "CUDA memory used (max GiB):")):
        if key in m:
            lines.append(f"{label:<40}{m[key]['max'] / 2**30:.2f}")
    return "\n".join(lines)


def format_concurrency_table(rows: list[dict], percentile: str) -> str:
    """Markdown table of a concurrency sweep: throughput, latency at the chosen percentile, cost."""
    p = percentile
    cols = ["concurrency", "req/s", "output tok/s", f"p{p} TTFT ms", f"p{p} ITL ms", f"p{p} E2E ms"]
    has_cost = any("cost_per_hour" in r for r in rows)
    if has_cost:
        cols += ["cost / 1M in", "cost / 1M out"]
    has_kv = any("kv_cache_usage" in (r.get("server_metrics") or {}) for r in rows)
    if has_kv:
        cols += ["KV max %"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r["max_concurrency"]), f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
                 f"{r.get(f'p{p}_ttft_ms', math.nan):.1f}", f"{r.get(f'p{p}_itl_ms', math.nan):.1f}",
                 f"{r.get(f'p{p}_e2el_ms', math.nan):.1f}"]
        if has_cost:
            cells += [f"{r.get('cost_per_1m_input_tokens', math.nan):.4f}",
                      f"{r.get('cost_per_1m_output_tokens', math.nan):.4f}"]
        if has_kv:
            kv = (r.get("server_metrics") or {}).get("kv_cache_usage")
            cells.append(f"{100 * kv['max']:.1f}" if kv else "")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot_concurrency(curves: dict[str, list[dict]], path: str, percentile: str) -> str:
    """Seed 004's plot: output throughput (left) and p{percentile} TTFT / ITL / E2E latency (right)
    against concurrency, one line per server. Writes a PNG; returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, rows in curves.items():
        cs = [r["max_concurrency"] for r in rows]
        a1.plot(cs, [r["output_throughput"] for r in rows], "o-", label=label)
        for key, style in (("ttft", "o-"), ("itl", "s--"), ("e2el", "^:")):
            a2.plot(cs, [r.get(f"p{percentile}_{key}_ms", math.nan) for r in rows], style,
                    label=f"{label} p{percentile} {key.upper().replace('E2EL', 'E2E')}")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.grid(True, which="both", ls="--", alpha=0.5)
        ax.legend(fontsize=8)
    a1.set_ylabel("output tokens/s")
    a1.set_title("Throughput")
    a2.set_ylabel(f"p{percentile} latency (ms)")
    a2.set_yscale("log")
    a2.set_title(f"p{percentile} latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
