"""`kvserve bench serve --tenant KEY:RATE[:N] --tenant ...`: several tenants at once, each with
its own API key, request rate and number of requests, all against one server (issue 15: one
tenant bursting at 10x another's rate, under `--scheduling-policy fcfs` and `vtc`).

Every tenant runs its own pass (its own prompts and Poisson arrivals) concurrently with the
others. The report gives each tenant's summary and a table: requests, p50/p99 TTFT, output
tokens, and its share of the tokens served while every tenant still had requests in flight
(the contention window, which ends when the first tenant's last request finishes; over the
whole run every request is served, so only this window shows who the server favoured).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics

from kvserve.bench.datasets import build_dataset


def add_cli_args(g) -> None:
    g.add_argument("--tenant", action="append", default=None, metavar="KEY:RATE[:N]",
                   help="run one tenant per flag concurrently: its API key, request rate (req/s "
                        "or inf) and number of requests (default --num-prompts)")


def parse_tenants(specs: list[str], default_n: int) -> list[tuple[str, float, int]]:
    out = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError(f"--tenant wants KEY:RATE[:N], got {spec!r}")
        n = int(parts[2]) if len(parts) == 3 else default_n
        rate = float(parts[1])
        if rate <= 0 or n < 1:
            raise ValueError(f"--tenant {spec!r}: the rate must be > 0 and N >= 1")
        out.append((parts[0], rate, n))
    return out


def _token_times(r) -> list[float]:
    if r.ttft is None or r.start is None:
        return []
    t = r.start + r.ttft
    times = [t]
    for gap in r.itl:
        t += gap
        times.append(t)
    return times


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))]


async def run_tenants(args, target, maker, run_pass, summarize, format_summary) -> dict:
    """One pass per tenant, concurrently; returns {"tenants": {key: summary + shares}}."""
    tenants = parse_tenants(args.tenant, args.num_prompts)
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    jobs = []
    for i, (key, rate, n) in enumerate(tenants):
        targs = argparse.Namespace(**{**vars(args), "num_prompts": n, "seed": args.seed + 1000 * i})
        convs = build_dataset(targs, maker)
        t = dataclasses.replace(target, api_key=key, label=key)
        jobs.append(run_pass(t, convs, targs, rate, quiet=True))
    runs = await asyncio.gather(*jobs)
    ends = [max((r.start or 0) + (r.e2e or 0) for r in results) for results, _ in runs]
    window = min(ends)
    out = {}
    served = {key: sum(1 for r in results for t in _token_times(r) if t <= window)
              for (key, _, _), (results, _) in zip(tenants, runs)}
    total_window = sum(served.values()) or 1
    total = sum(r.output_len for results, _ in runs for r in results) or 1
    rows = []
    for (key, rate, n), (results, duration) in zip(tenants, runs):
        s = summarize(results, duration, percentiles, args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
        print(format_summary(dict(s, request_rate=rate), f"tenant {key} @ {rate:g} req/s", percentiles))
        ttfts = [r.ttft for r in results if r.success and r.ttft is not None]
        out_tokens = sum(r.output_len for r in results)
        row = {"tenant": key, "request_rate": rate, "requests": n,
               "completed": sum(r.success for r in results),
               "p50_ttft_ms": 1000 * statistics.median(ttfts) if ttfts else None,
               "p99_ttft_ms": 1000 * _pct(ttfts, 99) if ttfts else None,
               "output_tokens": out_tokens, "share_window": served[key] / total_window,
               "share_total": out_tokens / total}
        rows.append(row)
        out[key] = dict(s, **row)
    print(f"\ncontention window: the first {window:.2f} s (until a tenant's last request finished)")
    print("| tenant | rate | requests | p50 TTFT ms | p99 TTFT ms | output tokens | share in window | share overall |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tenant']} | {r['request_rate']:g} | {r['completed']}/{r['requests']} | "
              f"{_fmt(r['p50_ttft_ms'])} | {_fmt(r['p99_ttft_ms'])} | {r['output_tokens']} | "
              f"{r['share_window']:.2f} | {r['share_total']:.2f} |")
    result = {"runs": {key: [s] for key, s in out.items()}, "tenants": out, "window_s": window}
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print(f"results written to {args.save_result}")
    return result


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"
