"""Turning per-request timings into the latency vocabulary of seed 001, and drawing the curve.

Definitions (seed 001, "The Latency Vocabulary"; the same as `vllm bench serve`):

- TTFT: request sent -> first streamed token arrives (prefill + queueing).
- ITL: the gap between two consecutive streamed chunks of one request; every gap is one sample.
- TPOT: per request, (E2E - TTFT) / (output_tokens - 1): the mean decode cadence the user sees.
- E2E: request sent -> last byte of the response.
- Goodput: completed requests per second that met every SLO given (TTFT <= --slo-ttft-ms,
  TPOT <= --slo-tpot-ms, E2E <= --slo-e2e-ms).

Percentiles are `numpy.percentile` (linear interpolation), reported in milliseconds.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def latency_stats(values_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean / median / std / pXX of a list of seconds, in milliseconds (NaN when empty)."""
    arr = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    out: dict[str, float] = {}
    if arr.size == 0:
        out.update(mean=math.nan, median=math.nan, std=math.nan)
        for p in percentiles:
            out[f"p{_pname(p)}"] = math.nan
        return out
    out["mean"] = float(arr.mean())
    out["median"] = float(np.median(arr))
    out["std"] = float(arr.std())
    for p in percentiles:
        out[f"p{_pname(p)}"] = float(np.percentile(arr, p))
    return out


def _pname(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def summarize(results: list, duration_s: float, percentiles: Sequence[float] = (50, 90, 99),
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              slo_e2e_ms: float | None = None) -> dict:
    """Aggregate a pass of `RequestResult`s (see bench/serve.py) into the report dictionary."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.e2e for r in ok]
    in_tokens = sum(r.prompt_len for r in ok)
    counted = [r for r in ok if getattr(r, "usage_reported", False)]
    mismatched = [r for r in counted if getattr(r, "exact_len", False)
                  and r.prompt_len != getattr(r, "requested_prompt_len", r.prompt_len)]
    out_tokens = sum(r.output_len for r in ok)
    d = max(duration_s, 1e-9)
    s: dict = {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "errors": _error_counts(failed),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        # the server's own usage.prompt_tokens against what was asked (see length_warning)
        "total_requested_input_tokens": sum(getattr(r, "requested_prompt_len", 0) or r.prompt_len
                                            for r in ok),
        "usage_reported": len(counted),
        "prompt_len_mismatches": len(mismatched),
        "prompt_len_mismatch_examples": [(getattr(r, "requested_prompt_len", 0), r.prompt_len)
                                         for r in mismatched[:5]],
        "request_throughput": len(ok) / d,
        "output_throughput": out_tokens / d,
        "total_token_throughput": (in_tokens + out_tokens) / d,
        "max_concurrent_requests": _max_concurrency(results),
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for k, v in latency_stats(vals, percentiles).items():
            s[f"{k}_{name}_ms"] = v
    if slo_ttft_ms is not None or slo_tpot_ms is not None or slo_e2e_ms is not None:
        good = 0
        for r in ok:
            if slo_ttft_ms is not None and r.ttft * 1000 > slo_ttft_ms:
                continue
            if slo_tpot_ms is not None and r.tpot is not None and r.tpot * 1000 > slo_tpot_ms:
                continue
            if slo_e2e_ms is not None and r.e2e * 1000 > slo_e2e_ms:
                continue
            good += 1
        s["good_requests"] = good
        s["goodput"] = good / d
        s["slo"] = {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "e2e_ms": slo_e2e_ms}
    return s


def length_warning(s: dict) -> str | None:
    """A loud warning when the server counted other prompt lengths than the benchmark asked for
    (the input side of the run is then not the workload it claims), or reported no usage."""
    lines = []
    if s.get("prompt_len_mismatches"):
        ex = ", ".join(f"{a} -> {b}" for a, b in s["prompt_len_mismatch_examples"])
        lines.append(f"WARNING: the server counted {s['prompt_len_mismatches']} of {s['completed']} "
                     f"prompts at another length than requested (requested -> usage.prompt_tokens: "
                     f"{ex}); {s['total_input_tokens']} prompt tokens served against "
                     f"{s['total_requested_input_tokens']} requested. TTFT and throughput are not "
                     f"those of the requested workload: send token ids (--prompt-format token-ids "
                     f"with --tokenizer) or give the server's tokenizer.")
    missing = s.get("completed", 0) - s.get("usage_reported", s.get("completed", 0))
    if missing > 0:
        lines.append(f"WARNING: the server reported no usage for {missing} of {s['completed']} requests: "
                     f"their prompt lengths are the requested ones and their output lengths the "
                     f"number of streamed chunks, not the server's counts.")
    return "\n".join(lines) or None


def _error_counts(failed) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in failed:
        key = (r.error or "unknown").splitlines()[0][:120]
        out[key] = out.get(key, 0) + 1
    return out


def _max_concurrency(results) -> int:
    """Most requests in flight at once, from each request's [start, start + e2e] interval."""
    events = []
    for r in results:
        if r.start is None:
            continue
        events.append((r.start, 1))
        events.append((r.start + (r.e2e if r.e2e is not None else 0.0), -1))
    events.sort(key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, delta in events:
        cur += delta
        best = max(best, cur)
    return best


def format_summary(s: dict, title: str = "Serving Benchmark Result",
                   percentiles: Sequence[float] = (50, 90, 99)) -> str:
    """The familiar `vllm bench serve` text block."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label, value, fmt="{:<10}"):
        lines.append(f"{label:<40}" + fmt.format(value))

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    if s.get("request_rate") is not None:
        row("Request rate configured (RPS):", _fmt_rate(s["request_rate"]))
    if s.get("max_concurrency") is not None:
        row("Maximum request concurrency:", s["max_concurrency"])
    row("Benchmark duration (s):", s["duration_s"], "{:<10.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    if "total_requested_input_tokens" in s:
        row("Requested input tokens:", s["total_requested_input_tokens"])
        row("Prompt length mismatches:", s["prompt_len_mismatches"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"], "{:<10.2f}")
    if "goodput" in s:
        row("Request goodput (req/s):", s["goodput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", s["output_throughput"], "{:<10.2f}")
    row("Total token throughput (tok/s):", s["total_token_throughput"], "{:<10.2f}")
    row("Peak concurrent requests:", s["max_concurrent_requests"])
    for m in LATENCY_METRICS:
        label = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}[m]
        lines.append(f"{' ' + METRIC_TITLES[m] + ' ':-^{w}}")
        row(f"Mean {label} (ms):", s[f"mean_{m}_ms"], "{:<10.2f}")
        row(f"Median {label} (ms):", s[f"median_{m}_ms"], "{:<10.2f}")
        for p in percentiles:
            row(f"P{_pname(p)} {label} (ms):", s[f"p{_pname(p)}_{m}_ms"], "{:<10.2f}")
    if s["errors"]:
        lines.append(f"{' Errors ':-^{w}}")
        for msg, count in s["errors"].items():
            lines.append(f"{count:>6} x {msg}")
    warning = length_warning(s) if "total_requested_input_tokens" in s else None
    if warning:
        lines.append(f"{' !!! prompt lengths !!! ':!^{w}}")
        lines.append(warning)
    lines.append("=" * w)
    return "\n".join(lines)


def _fmt_rate(r) -> str:
    return "inf" if r is None or (isinstance(r, float) and math.isinf(r)) else f"{r:g}"


def format_sweep_table(rows: list[dict], label: str | None = None) -> str:
    """A Markdown table, one row per request rate: ready for a README."""
    head = ("| rate (req/s) | achieved req/s | output tok/s | p50 TTFT ms | p99 TTFT ms | "
            "p50 ITL ms | p99 ITL ms | p99 TPOT ms | p99 E2E ms | failed |")
    if label:
        head = "| server " + head
    sep = "|" + "---|" * (head.count("|") - 1)
    out = [head, sep]
    for s in rows:
        cells = [_fmt_rate(s.get("request_rate")), f"{s['request_throughput']:.2f}",
                 f"{s['output_throughput']:.1f}", f"{s['p50_ttft_ms']:.1f}", f"{s['p99_ttft_ms']:.1f}",
                 f"{s['p50_itl_ms']:.1f}", f"{s['p99_itl_ms']:.1f}", f"{s['p99_tpot_ms']:.1f}",
                 f"{s['p99_e2el_ms']:.1f}", str(s["failed"])]
        if label:
            cells.insert(0, label)
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def find_knee(xs: Sequence[float], ys: Sequence[float]) -> int | None:
    """Index of the knee of a latency-throughput curve (Kneedle, Satopaa et al. 2011).

    Points are taken in load order (increasing offered rate). Both axes are scaled to [0, 1]
    over the curve; the knee is the point furthest below the chord from the lightest-load to the
    heaviest-load point, i.e. argmax(x_norm - y_norm): the last point where throughput still grew
    faster than latency. Returns None for fewer than three finite points or a flat curve.
    """
    pts = [(i, x, y) for i, (x, y) in enumerate(zip(xs, ys)) if math.isfinite(x) and math.isfinite(y)]
    if len(pts) < 3:
        return None
    x = np.array([p[1] for p in pts])
    y = np.array([p[2] for p in pts])
    if np.ptp(x) <= 0 or np.ptp(y) <= 0:
        return None
    xn = (x - x.min()) / np.ptp(x)
    yn = (y - y.min()) / np.ptp(y)
    # Chord from the first to the last point, in normalized coordinates.
    x0, y0, x1, y1 = xn[0], yn[0], xn[-1], yn[-1]
    dx, dy = x1 - x0, y1 - y0
    norm = math.hypot(dx, dy)
    if norm == 0:
        return None
    # Signed distance of each point from the chord; positive = below/right of it (before the rise).
    dist = (dx * (yn - y0) - dy * (xn - x0)) / norm
    k = int(np.argmin(dist))
    if dist[k] >= 0 or k in (0, len(pts) - 1):
        return None
    return pts[k][0]


def plot_sweep(curves: dict[str, list[dict]], path: str, title: str | None = None) -> dict[str, int | None]:
    """Write the latency-throughput PNG: p99 TTFT and p99 ITL against achieved output tok/s.

    `curves` maps a label (server) to its sweep summaries in increasing request-rate order.
    The knee of each p99 TTFT curve is circled and annotated with its request rate. Returns the
    knee index per label.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    knees: dict[str, int | None] = {}
    for ci, (label, rows) in enumerate(curves.items()):
        color = f"C{ci}"
        xs = [r["output_throughput"] for r in rows]
        ttft = [r["p99_ttft_ms"] for r in rows]
        itl = [r["p99_itl_ms"] for r in rows]
        ax1.plot(xs, ttft, "o-", color=color, label=label)
        ax2.plot(xs, itl, "s-", color=color, label=label)
        for x, y, r in zip(xs, ttft, rows):
            ax1.annotate(_fmt_rate(r.get("request_rate")), (x, y), textcoords="offset points",
                         xytext=(4, 4), fontsize=7, color=color)
        k = find_knee(xs, ttft)
        knees[label] = k
        if k is not None:
            for ax, ys in ((ax1, ttft), (ax2, itl)):
                ax.plot([xs[k]], [ys[k]], "o", ms=14, mfc="none", mec="red", mew=2)
            ax1.annotate(f"knee: {_fmt_rate(rows[k].get('request_rate'))} req/s",
                         (xs[k], ttft[k]), textcoords="offset points", xytext=(-10, 18),
                         color="red", fontsize=9, ha="right")
    ax1.set_xlabel("achieved output throughput (tok/s)")
    ax1.set_ylabel("p99 TTFT (ms)")
    ax1.set_title("p99 time to first token")
    ax2.set_xlabel("achieved output throughput (tok/s)")
    ax2.set_ylabel("p99 ITL (ms)")
    ax2.set_title("p99 inter-token latency")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "latency-throughput curve (points labelled with offered req/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return knees
