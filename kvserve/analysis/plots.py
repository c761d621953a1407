"""Plots for the planning commands (matplotlib, Agg backend). Each function draws figures from
numbers the analysis functions computed and writes a PNG; none invents data."""
from __future__ import annotations


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_step_times(sm, batches, contexts, path: str, title: str | None = None) -> str:
    """Seed 003's step-time model: decode step time and tokens/s against batch size at several
    contexts, with the knee B* of each marked."""
    import numpy as np
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    B = np.asarray(batches)
    for ctx in contexts:
        t = np.array([sm.decode_step_time(b, ctx) for b in B])
        a1.plot(B, t * 1e3, label=f"context {ctx}")
        a2.plot(B, B / t, label=f"context {ctx}")
        k = sm.knee_batch(ctx)
        if np.isfinite(k) and B.min() <= k <= B.max():
            a1.axvline(k, ls=":", color=a1.lines[-1].get_color())
    a1.set_xscale("log"); a1.set_yscale("log"); a2.set_xscale("log"); a2.set_yscale("log")
    a1.set_xlabel("decode batch B"); a1.set_ylabel("step time (ms)")
    a2.set_xlabel("decode batch B"); a2.set_ylabel("tokens / s")
    a1.set_title("t(B) = max(t_W + B t_K, B t_F) + t_0  (knees dotted)")
    a2.set_title(title or "aggregate decode throughput")
    for a in (a1, a2):
        a.grid(True, which="both", ls="--", alpha=0.4); a.legend(fontsize=8)
    fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)
    return path


def plot_batching(results: dict, path: str) -> str:
    """Seed 003's continuous-vs-static experiment: wait distributions per policy and rate.
    results: {rate: {"static": run, "continuous": run}} from simulate.batching_experiment."""
    import numpy as np
    plt = _plt()
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (rate, runs) in zip(axes[0], sorted(results.items())):
        for pol, run in runs.items():
            w = np.sort(run["waits"])
            ax.plot(w, np.arange(1, len(w) + 1) / len(w),
                    label=f"{pol}: util {run['utilization']:.1%}, mean wait {run['mean_wait']:.0f}")
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlabel("wait for a slot (steps)"); ax.set_ylabel("fraction of requests")
        ax.set_title(f"{rate} arrivals / step"); ax.grid(True, ls="--", alpha=0.4); ax.legend(fontsize=8)
    fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)
    return path


def plot_serving(rows: list[dict], path: str) -> str:
    """Seed 003's chunked-prefill trade-off: longest gap and p99 TTFT per policy / token budget."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, r in enumerate(rows):
        ax.scatter(r["longest_gap_s"] * 1e3, r["ttft_p99_s"], s=60)
        ax.annotate(r["policy"], (r["longest_gap_s"] * 1e3, r["ttft_p99_s"]), textcoords="offset points",
                    xytext=(6, 6) if i % 2 else (-6, -14), ha="left" if i % 2 else "right")
    ax.set_xscale("log"); ax.set_yscale("log")
    ax.set_xlabel("longest gap between two tokens of a stream (ms)")
    ax.set_ylabel("p99 TTFT (s)")
    ax.set_title("TTFT vs ITL: the token budget trades one for the other")
    ax.grid(True, which="both", ls="--", alpha=0.4)
    fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)
    return path


def plot_prefix(rows: list[dict], path: str) -> str:
    """Prefix-cache hit rate against pool size for chained hashes and the radix tree."""
    plt = _plt()
    fin = [r for r in rows if r["pool_tokens"] != float("inf")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = [r["pool_tokens"] for r in fin]
    ax.plot(x, [r["hash_chain"] for r in fin], "o-", label="hash chain (16-token blocks)")
    ax.plot(x, [r["radix"] for r in fin], "s--", label="radix tree (token granularity)")
    for r in rows:
        if r["pool_tokens"] == float("inf"):
            ax.axhline(r["hash_chain"], color="gray", ls=":", label=f"unlimited: {r['hash_chain']:.1%}")
    ax.set_xscale("log"); ax.set_ylim(0, 1)
    ax.set_xlabel("cache pool (tokens)"); ax.set_ylabel("share of prompt tokens that hit")
    ax.grid(True, which="both", ls="--", alpha=0.4); ax.legend()
    fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)
    return path


def plot_paging(runs: dict, path: str) -> str:
    """Running sequences and finished requests over time for each memory policy (allocator widget)."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        steps = [h["step"] for h in run["history"]]
        a1.plot(steps, [h["running_sequences"] for h in run["history"]], label=name)
        a2.plot(steps, [h["finished"] for h in run["history"]], label=name)
    a1.set_xlabel("step"); a1.set_ylabel("running sequences"); a2.set_xlabel("step"); a2.set_ylabel("finished requests")
    for a in (a1, a2):
        a.grid(True, ls="--", alpha=0.4); a.legend(fontsize=8)
    fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)
    return path


def plot_fit(fit, samples: list[dict], path: str) -> str:
    """Measured vs fitted step times of a calibration run."""
    import numpy as np
    plt = _plt()
    y = np.array([s["step_s"] for s in samples])
    p = fit.predict([s["n_tokens"] for s in samples], [s["ctx_sum"] for s in samples],
                    [s.get("n_seqs", 0) for s in samples])
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.loglog(y * 1e3, p * 1e3, ".", alpha=0.6)
    lo, hi = min(y.min(), p.min()) * 1e3, max(y.max(), p.max()) * 1e3
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.set_xlabel("measured step (ms)"); ax.set_ylabel("fitted step (ms)")
    ax.set_title(f"step-time fit: rel. RMSE {fit.rel_rmse:.1%}")
    ax.grid(True, which="both", ls="--", alpha=0.4)
    fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)
    return path
